"""Agent sessions (case W5): per-turn latency with session reuse vs stateless re-prefill.

An agent session: a system preamble and a task, then each turn sends everything so far,
gets the model's answer, and appends the answer and a tool result (as a user message:
``Tool result: ...``) for the next turn. Two arms on ONE proxy with the embedded engine
(prefix caching on), turn by turn, alternating so machine noise hits both alike:

* **reuse**: the session as it is, with ``X-Flowlift-Session``; turn N+1 repeats turn
  N's prompt and answer, which the engine's prefix cache serves.
* **stateless**: the same messages (the reuse arm's answers, so both arms send the same
  context) behind a unique per-request nonce at the very start of the system message:
  no prefix can match, so every turn re-prefills the whole context, as a stateless
  server without a prefix cache would (the nonce adds a few tokens, reported).

Per turn: end-to-end latency (streamed, so TTFT too), prompt/completion/cached tokens,
and (W5) how much of the previous answer the cache served. Reported: median and p90 of
the per-turn ratio stateless / reuse, for a 6-turn and a 35-turn session. The seed paper
reports 2.1x per turn for 6 turns and 4.2x median for 35 (against vLLM/SGLang on GPUs).

    .venv/bin/python bench/agent_session.py [--turns 6 35] [--max-tokens 12]
    .venv/bin/python bench/agent_session.py --smoke   # seconds, fake engine: plumbing only
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import pct, proxy, save

PREAMBLE = (
    "You are a coding agent working in a Python repository. You have a shell tool. "
    "Each turn, read the latest tool result, then state the next command to run and "
    "why, in one short sentence. Rules: never edit files outside src/; run the tests "
    "after each change; prefer small, reversible steps; report failures verbatim. "
    "The repository layout: src/app.py (entry point), src/parse.py (argument parsing), "
    "src/run.py (the main loop), tests/test_app.py, tests/test_parse.py, README.md, "
    "pyproject.toml. The task: the command-line option --limit is ignored when it is "
    "zero; find out why, fix it, and add a test that fails before the fix.")
TASK = "Start: look at the repository and decide the first command."
TOOLS = [
    "$ ls src tests\nsrc: app.py parse.py run.py\ntests: test_app.py test_parse.py",
    "$ grep -n limit src/*.py\nsrc/parse.py:14: p.add_argument('--limit', type=int)\n"
    "src/run.py:22:     if args.limit:\nsrc/run.py:23:         items = items[:args.limit]",
    "$ sed -n 15,30p src/run.py\n    items = load(args.path)\n    if args.limit:\n"
    "        items = items[:args.limit]\n    for item in items:\n        handle(item)",
    "$ pytest -q\n12 passed in 0.41s",
    "$ python -m app --limit 0 data.txt | wc -l\n57",
]


def tool_result(turn: int) -> str:
    return f"Tool result (turn {turn}):\n{TOOLS[turn % len(TOOLS)]}"


def chat(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int,
         session: str | None) -> dict[str, Any]:
    """One streamed turn: answer text, usage, TTFT and latency (s)."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"X-Flowlift-Session": session} if session else {}
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - t0
    assert usage is not None, "no usage chunk"
    return {"latency_s": round(latency, 3), "ttft_s": round(ttft or latency, 3),
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "text": text}


def session(client: httpx.Client, turns: int, max_tokens: int) -> dict[str, Any]:
    """Run one agent session in both arms, turn by turn."""
    sid = f"agent-{secrets.token_hex(4)}"
    # the session id leads the preamble: a session shares no cached prefix with another
    messages = [{"role": "system", "content": f"Session {sid}. {PREAMBLE}"},
                {"role": "user", "content": TASK}]
    rows: list[dict[str, Any]] = []
    for n in range(turns):
        reuse = chat(client, messages, max_tokens, sid)
        nonce = f"[request {secrets.token_hex(8)}] "
        busted = [{**messages[0], "content": nonce + messages[0]["content"]}, *messages[1:]]
        stateless = chat(client, busted, max_tokens, None)
        prev = rows[-1]["reuse"] if rows else None
        reusable = prev["prompt_tokens"] + prev["completion_tokens"] if prev else 0
        answer_cached = (max(0, min(reuse["cached_tokens"], reusable) - prev["prompt_tokens"])
                         if prev else None)
        row = {"turn": n + 1, "reuse": {k: v for k, v in reuse.items() if k != "text"},
               "stateless": {k: v for k, v in stateless.items() if k != "text"},
               "reusable_tokens": reusable, "previous_answer_cached_tokens": answer_cached,
               "ratio": round(stateless["latency_s"] / reuse["latency_s"], 3),
               "ttft_ratio": round(stateless["ttft_s"] / reuse["ttft_s"], 3)}
        rows.append(row)
        print(f"  turn {n + 1:2d}: prompt {reuse['prompt_tokens']:5d} cached "
              f"{reuse['cached_tokens']:5d} (prev answer {answer_cached}) | reuse "
              f"{reuse['latency_s']:.2f}s stateless {stateless['latency_s']:.2f}s "
              f"x{row['ratio']:.2f}", flush=True)
        messages = [*messages, {"role": "assistant", "content": reuse["text"]},
                    {"role": "user", "content": tool_result(n)}]
    return {"session_id": sid, "turns": rows, **summary(rows),
            "server_view": server_view(client, sid)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = rows[1:]  # turn 1 has nothing to reuse in either arm
    ratios = [r["ratio"] for r in later]
    ttft = [r["ttft_ratio"] for r in later]
    prev_answer = [(r["previous_answer_cached_tokens"], rows[i]["reuse"]["completion_tokens"])
                   for i, r in enumerate(later)]
    return {
        "ratio_median": round(statistics.median(ratios), 2) if ratios else None,
        "ratio_p90": round(pct(ratios, 90), 2) if ratios else None,
        "ttft_ratio_median": round(statistics.median(ttft), 2) if ttft else None,
        "ttft_ratio_p90": round(pct(ttft, 90), 2) if ttft else None,
        "reuse_total_s": round(sum(r["reuse"]["latency_s"] for r in rows), 2),
        "stateless_total_s": round(sum(r["stateless"]["latency_s"] for r in rows), 2),
        "cached_over_prompt_reuse": round(
            sum(r["reuse"]["cached_tokens"] for r in later)
            / max(1, sum(r["reuse"]["prompt_tokens"] for r in later)), 3),
        "cached_tokens_stateless": sum(r["stateless"]["cached_tokens"] for r in rows),
        "previous_answer_tokens_cached": sum(a for a, _ in prev_answer),
        "previous_answer_tokens": sum(c for _, c in prev_answer),
    }


def server_view(client: httpx.Client, sid: str) -> dict[str, Any] | None:
    """``GET /v1/sessions/{id}`` totals, when the proxy serves that route."""
    r = client.get(f"/v1/sessions/{sid}")
    if r.status_code != 200:
        return None
    body = r.json()
    return {k: body[k] for k in ("turn_count", "prompt_tokens", "cached_tokens",
                                 "reusable_tokens", "reuse_ratio", "backend")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[6, 35])
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=None,
                        help="the engine's KV block size (flowlift serve --block-size; "
                             "default: vLLM's, 128 on CPU)")
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine, one 3-turn session, nothing saved")
    args = parser.parse_args()
    if args.smoke:
        args.turns, args.max_tokens = [3], 6
    results: dict[str, Any] = {
        "max_tokens": args.max_tokens, "arms": {
            "reuse": "same session, X-Flowlift-Session, engine prefix cache",
            "stateless": "same messages behind a unique nonce at the start of the system "
                         "message: every turn re-prefills the whole context"},
        "machine": "2 CPU cores, vLLM CPU build, SmolLM2-135M float32, shared and noisy",
        "command": "python bench/agent_session.py " + " ".join(sys.argv[1:])}
    extra = ("--block-size", str(args.block_size)) if args.block_size else ()
    name = f"agent_session_bs{args.block_size}" if args.block_size else "agent_session"
    results["block_size"] = args.block_size
    with proxy("--max-concurrency", "4", *extra, name=name,
               engine="fake" if args.smoke else "vllm") as base, \
            httpx.Client(base_url=base, timeout=600) as client:
        chat(client, [{"role": "user", "content": "warm up"}], 4, None)
        for turns in args.turns:
            print(f"{turns}-turn session", flush=True)
            t0 = time.monotonic()
            out = session(client, turns, args.max_tokens)
            out["wall_s"] = round(time.monotonic() - t0, 1)
            results[f"turns_{turns}"] = out
            print({k: v for k, v in out.items() if k not in ("turns",)}, flush=True)
    save(name, results, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
