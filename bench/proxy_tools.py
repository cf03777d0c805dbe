"""Proxy tools (issue 24 §4, second bullet): one tool-calling session, the tool run by
the proxy itself vs by the app over chat completions.

A session is ``--turns`` model turns (35 by default), ``tool_choice="required"`` on
each, the conversation growing as in ``bench/agent_loop.py`` (same preamble, task and
tool outputs: ``bench/agent_session.py``). The tool, ``shell(command)``, returns fixed
output by command, so both variants compute the same results:

* **a. agent step, proxy tools**: ``@step(tools=[proxy_tool("bench.shell")], ...)``;
  the proxy's config names this module's :func:`shell` as ``[tools.bench] callables``,
  so every turn's call runs on the proxy: the app sends the graph once and reads the
  end of the run, no round trip per turn.
* **c. chat completions**: the app drives ``/v1/chat/completions`` turn by turn with
  the same tool definition and ``X-Flowlift-Session``, running the tool itself.

Both run ``--reps`` times (alternating), with the app on the same host and through the
delay line of ``bench/chain_rtt.py`` (``--rtt-ms``, 80 ms: half each way on every byte).
Per session: end to end (app clock), engine time (a: the trace's attempts; c: each
answer's ``Server-Timing`` engine time), tool time (a: the trace's ``tool_run`` calls,
only the time no turn was streaming: an early-started call overlaps its turn) and
**overhead per turn** = (end to end - engine time - tool time) / turns: what a turn
costs beyond the model and the tool (proxy work, and for c the app round trip). Goal:
the agent step pays no app round trip per turn (overhead per turn at 80 ms <= 10 ms,
against ~85 ms for c).

    .venv/bin/python bench/proxy_tools.py [--turns 35] [--reps 3] [--rtt-ms 80]
        [--engine vllm|fake]
    .venv/bin/python bench/proxy_tools.py --smoke   # seconds, fake engine: plumbing only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_loop import Command, run_chat, system_text
from bench.agent_session import TASK, TOOLS
from bench.chain_rtt import DelayLine
from bench.harness import proxy, save
from flowlift import WorkflowFailed, proxy_tool, step, workflow
from flowlift.tool_schema import function_schema
from flowlift.tracing.recorder import union_ms

VARIANTS = ("a_proxy_tools", "c_chat_completions")
OUTPUTS = dict(zip(get_args(Command), TOOLS, strict=False))
CONFIG = '[tools.bench]\ncallables = ["bench.proxy_tools:shell"]\n'


def shell(command: Command) -> str:
    """Run one shell command in the repository and return its output."""
    return OUTPUTS[command]


OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "shell", "description": shell.__doc__, "parameters": function_schema(shell)}}]


def _result_of(call: dict[str, Any]) -> str:
    return shell(json.loads(call["function"]["arguments"])["command"])


def run_proxy_tools(base: str, sid: str, turns: int, max_tokens: int) -> dict[str, Any]:
    """One session as an agent step whose tool runs on the proxy."""
    @step(tools=[proxy_tool("bench.shell")], max_turns=turns, tool_choice="required",
          max_tokens=max_tokens, name="agent")
    def agent(sid: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system_text(sid)},
                {"role": "user", "content": TASK}]

    t0 = time.perf_counter()
    error = None
    try:
        with workflow("bench-proxy-tools", base_url=base, progress=False) as wf:
            agent(sid)
    except WorkflowFailed:
        error = str(next(iter(wf.failures.values()), "failed"))
    e2e = time.perf_counter() - t0
    record = next(r for r in wf.trace if r.get("step_id") == "agent_1")
    turns_ = [(a["started_ms"], a["finished_ms"]) for a in record["attempts"]
              if a.get("finished_ms") is not None]
    calls = [(c["wanted_ms"], c["finished_ms"]) for c in record["tool_calls"]
             if c.get("finished_ms") is not None]
    engine_ms = union_ms(turns_)
    # a call started early overlaps its turn's stream: only its time past the turns
    tool_ms = union_ms(turns_ + calls) - engine_ms
    return _session(e2e, len(record["attempts"]), engine_ms, tool_ms,
                    None if error is not None and f"after {turns} turns" in error else error,
                    _tokens(record["attempts"]))


def _tokens(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Prompt, cached and completion tokens summed over a session's turns."""
    return {k: sum(int(r.get(k) or 0) for r in rows)
            for k in ("prompt_tokens", "cached_tokens", "completion_tokens")}



def run_chat_completions(base: str, sid: str, turns: int, max_tokens: int
                         ) -> dict[str, Any]:
    """One session driven by the app over chat completions, the tool run in the app."""
    s = run_chat(base, sid, turns, max_tokens, stateless=False, tools=OPENAI_TOOLS,
                 result_of=_result_of)
    engine_ms = sum(t.get("engine_ms") or 0.0 for t in s["turns"])
    return _session(s["end_to_end_s"] or 0.0, s["turns_done"], engine_ms, 0.0, s["error"],
                    _tokens(s["turns"]))


def _session(e2e_s: float, turns: int, engine_ms: float, tool_ms: float,
             error: str | None, tokens: dict[str, int]) -> dict[str, Any]:
    overhead = (e2e_s * 1000 - engine_ms - tool_ms) / max(1, turns)
    return {"end_to_end_s": round(e2e_s, 3), "turns_done": turns, **tokens,
            "engine_ms": round(engine_ms, 1), "tool_ms": round(tool_ms, 1),
            "overhead_per_turn_ms": round(overhead, 1), "error": error}


RUNNERS = {"a_proxy_tools": run_proxy_tools, "c_chat_completions": run_chat_completions}


def measure(base: str, turns: int, reps: int, max_tokens: int, where: str
            ) -> dict[str, Any]:
    """``reps`` sessions of each variant, alternating; medians per variant."""
    sessions: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for v in VARIANTS[rep % 2:] + VARIANTS[:rep % 2]:
            s = RUNNERS[v](base, f"{v[0]}-{where}-{rep}-{secrets.token_hex(3)}", turns,
                           max_tokens)
            sessions[v].append(s)
            print(f"  {where} rep {rep + 1} {v:20s} e2e {s['end_to_end_s']} s, "
                  f"{s['turns_done']} turns, overhead/turn {s['overhead_per_turn_ms']} ms"
                  + (f", error: {s['error'][:120]}" if s["error"] else ""), flush=True)
    summary = {v: {k: statistics.median(s[k] for s in ss)
                   for k in ("end_to_end_s", "engine_ms", "tool_ms", "overhead_per_turn_ms")}
               | {"turns_done": [s["turns_done"] for s in ss],
                  "errors": [s["error"] for s in ss if s["error"]]}
               for v, ss in sessions.items()}
    return {"summary": summary, "sessions": sessions}


def markdown(results: dict[str, Any]) -> str:
    """A RESULTS.md table: one row per (where, variant)."""
    lines = ["| where | variant | overhead per turn, median (ms) | end to end, median (s) "
             "| engine time, median (ms) | tool time, median (ms) | turns done |",
             "|---|---|---|---|---|---|---|"]
    for where, out in results.get("measured", {}).items():
        for v in VARIANTS:
            s = out["summary"][v]
            lines.append(f"| {where} | {v} | {s['overhead_per_turn_ms']} | "
                         f"{s['end_to_end_s']} | {s['engine_ms']} | {s['tool_ms']} | "
                         f"{', '.join(map(str, s['turns_done']))} |")
    return "\n".join(lines)


@contextlib.contextmanager
def started(smoke: bool) -> Iterator[str]:
    """A proxy whose config names :func:`shell` as ``[tools.bench]`` (fake engine for
    ``--smoke``)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "bench_tools.toml"
        cfg.write_text(CONFIG, encoding="utf-8")
        flags = ("--config", str(cfg), "--max-concurrency", "4")
        with proxy(*flags, name="proxy_tools", engine="fake" if smoke else "vllm") as base:
            yield base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=35)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=40,
                        help="per turn; a forced tool call is ~20 tokens of JSON")
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--engine", choices=("vllm", "fake"), default="vllm",
                        help="fake: the proxy's fake engine (20 ms a chunk): overhead "
                             "without model noise")
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine, 3 turns, 1 rep, 20 ms: the plumbing in seconds")
    parser.add_argument("--out", default=None,
                        help="results name in bench/results (default proxy_tools, "
                             "proxy_tools_fake with --engine fake)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.turns, args.reps, args.rtt_ms, args.engine = 3, 1, 20.0, "fake"
    results: dict[str, Any] = {
        "command": "python bench/proxy_tools.py " + " ".join(argv or sys.argv[1:]),
        "engine": "fake (smoke)" if args.smoke else "fake (--fake-delay-s 0.01)"
        if args.engine == "fake" else
        "embedded vLLM CPU build, SmolLM2-135M-Instruct, 2 shared CPU cores",
        "turns": args.turns, "reps": args.reps, "rtt_ms": args.rtt_ms,
        "max_tokens": args.max_tokens, "measured": {}}
    with started(args.engine == "fake") as base:
        line = DelayLine(int(base.rsplit(":", 1)[1]), args.rtt_ms / 2000.0)
        run_chat(base, "warm-up", 1, 4, stateless=True, tools=OPENAI_TOOLS)
        for where, url in (("local", base), (f"{args.rtt_ms:g}ms",
                                              f"http://127.0.0.1:{line.port}")):
            print(f"{where}: {args.turns}-turn sessions", flush=True)
            results["measured"][where] = measure(url, args.turns, args.reps,
                                                 args.max_tokens, where)
            if not args.smoke:  # after each: a partial run keeps its figures
                save(args.out or ("proxy_tools" if args.engine == "vllm"
                                  else "proxy_tools_fake"), results)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
