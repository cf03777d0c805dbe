"""Agent loops (issue 14): one tool-calling session run four ways on one engine.

A session is ``--turns`` model turns (6 and 35 by default); each turn's answer calls a
tool, and the answer and the tool's result join the conversation for the next turn
(the stateful-inference paper's agent sessions). The tool is a deterministic Python
function returning fixed shell output of realistic size (``bench/agent_session.py``'s
texts, 10-55 tokens each; a 35-turn session ends near 3,800 prompt tokens, inside
SmolLM2's 4,096-token context). Every variant sends the same conversation with the same
tool definition, ``max_tokens``, greedy decoding and ``tool_choice="required"`` on
every turn (so a 135M model calls the tool each turn and every session has exactly
``--turns`` turns; the last turn's call is not run):

* **a. agent step**: ``@step(tools=[shell], max_turns=N, tool_choice="required")``: one
  run; the proxy loops, the app only runs the tool (one ``tool.wanted`` event and one
  result ``POST`` per turn). A required loop never answers, so the step ends at
  ``max_turns`` with ``StepFailed``, which is the expected end here.
* **b. open run**: a Python loop in ``with workflow(...)``: each turn is a step (the
  conversation rendered as the engine sees it, the same JSON Schema as a contract),
  ``.get()`` waits for it, the app runs the tool as a plain Python call and loops; one
  run, one flush ``POST`` per turn.
* **c. chat completions**: the app drives ``/v1/chat/completions`` turn by turn with
  ``tools``, ``tool_choice`` and ``X-Flowlift-Session`` (what agent frameworks do).
* **d. stateless**: as c, with a unique nonce at the very start of the system message
  on every request and no session: every turn re-prefills the whole conversation.
* **e. responses**: the Responses API (issue 25), delta-only: each turn sends
  ``previous_response_id`` and only its new items (the tool results), the proxy keeps
  the conversation and keys affinity by it. Beside c and d it shows what the stateful
  interface saves: the bytes the app sends per turn (``bytes_sent``, every variant
  that posts JSON: c, d, e) stay flat instead of growing with the conversation.

Each session starts with its own id in the system message, so no session reuses
another's prefix. The variants run alternately (the order rotates per repetition),
first with the app on the same host, then through the delay line of
``bench/chain_rtt.py`` (``--rtt-ms``, 80 ms by default: half each way, on every byte
between the app and the proxy, so on each round trip of every variant).

Per turn, measured in the app: latency (from the previous turn's answer, or the
session's start, to this turn's answer: for a, when the SDK runs the tool; for the
last turn, when the block ends). From the proxy: prompt and cached tokens per turn
(the trace for a and b, ``usage`` for c and d) and the engine's TTFT (the trace's first
token for a and b; c and d stream no token before a tool call is whole, so their
``Server-Timing`` engine time stands in). Reported per variant: per-turn median and
p90, end to end, cached / prompt tokens; and the ratio of each variant to a.

    .venv/bin/python bench/agent_loop.py [--turns 6 35] [--reps 1] [--max-tokens 40]
        [--rtt-ms 80] [--far-turns 6 35] [--variants c_chat_completions e_responses ...]
    .venv/bin/python bench/agent_loop.py --smoke   # seconds, fake engine: plumbing only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_session import PREAMBLE, TASK, TOOLS
from bench.chain_rtt import DelayLine
from bench.harness import pct, proxy, save
from flowlift import WorkflowFailed, step, tool, workflow
from flowlift.proxy.wire.tool_calls import (
    FunctionCall,
    FunctionDef,
    Message,
    ToolCall,
    ToolPlan,
    engine_messages,
)
from flowlift.proxy.wire.tool_calls import Tool as ToolDef
from flowlift.sdk.agents import tool_spec
from flowlift.testing import running_proxy

VARIANTS = ("a_agent_step", "b_open_run", "c_chat_completions", "d_stateless",
            "e_responses")
Command = Literal["ls", "grep", "sed", "pytest", "run"]


class Stamps:
    """When the app saw each turn's answer (``time.perf_counter``), and how many tool
    calls ran; reset per session (sessions run one at a time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.times: list[float] = []
        self.calls = 0

    def reset(self) -> float:
        with self.lock:
            self.times, self.calls = [], 0
        return time.perf_counter()

    def mark(self) -> None:
        with self.lock:
            self.times.append(time.perf_counter())

    def next_result(self) -> str:
        """The tool's fixed output for the next call (by call number, not by argument,
        so every variant gets the same text whatever command the model picked)."""
        with self.lock:
            n, self.calls = self.calls, self.calls + 1
        return TOOLS[n % len(TOOLS)]


STAMPS = Stamps()


@tool
def shell(command: Command) -> str:
    """Run one shell command in the repository and return its output."""
    STAMPS.mark()  # a: the SDK runs the tool when a turn's answer arrives
    return STAMPS.next_result()


SPEC = tool_spec(shell)
PLAN = ToolPlan((ToolDef(type="function", function=FunctionDef(
    name=SPEC.name, description=SPEC.description, parameters=SPEC.parameters)),),
    "required", True, {"type": "string"})
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": SPEC.name, "description": SPEC.description, "parameters": SPEC.parameters}}]


def system_text(sid: str) -> str:
    return f"Session {sid}. {PREAMBLE}"


# -- a. agent step ---------------------------------------------------------------------

def _agent_step(turns: int, max_tokens: int) -> Any:
    @step(tools=[shell], max_turns=turns, tool_choice="required", max_tokens=max_tokens,
          name="agent")
    def agent(sid: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system_text(sid)},
                {"role": "user", "content": TASK}]
    return agent


def run_agent_step(base: str, sid: str, turns: int, max_tokens: int) -> dict[str, Any]:
    agent = _agent_step(turns, max_tokens)
    t0 = STAMPS.reset()
    error = None
    try:
        with workflow("bench-agent-step", base_url=base, progress=False) as wf:
            agent(sid)
    except WorkflowFailed:
        error = str(next(iter(wf.failures.values()), "failed"))
    end = time.perf_counter()
    record = next(r for r in wf.trace if r.get("step_id") == "agent_1")
    rows = [_trace_row(a) for a in record["attempts"]]
    expected = f"after {turns} turns"
    return _session(t0, [*STAMPS.times, end], rows, wf.run_id,
                    None if error is not None and expected in error else error)


def _trace_row(a: dict[str, Any]) -> dict[str, Any]:
    first, started = a.get("first_token_ms"), a.get("started_ms")
    done = a.get("finished_ms") or a.get("generated_ms")
    return {"prompt_tokens": a.get("prompt_tokens", 0),
            "cached_tokens": a.get("cached_tokens", 0),
            "completion_tokens": a.get("completion_tokens", 0),
            "engine_ttft_ms": (round(first - started, 1)
                               if first is not None and started is not None else None),
            "engine_ms": (round(done - started, 1)
                          if done is not None and started is not None else None)}


# -- b. open run -----------------------------------------------------------------------

def _turn_step(max_tokens: int) -> Any:
    @step(output=PLAN.schema(), max_tokens=max_tokens, name="turn")
    def turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
        return messages
    return turn


def _run_calls(calls: list[dict[str, Any]]) -> list[Message]:
    """The assistant message calling ``calls`` and the tool results (plain Python)."""
    # ids shaped as the proxy's own (call_ + 24 hex digits): the same prompt lengths as a
    ids = [f"call_{secrets.token_hex(12)}" for _ in calls]
    out = [Message(role="assistant", tool_calls=[
        ToolCall(id=i, function=FunctionCall(name=c["name"], arguments=json.dumps(
            c["arguments"]))) for i, c in zip(ids, calls, strict=True)])]
    return out + [Message(role="tool", tool_call_id=i, content=STAMPS.next_result())
                  for i in ids]


def run_open_run(base: str, sid: str, turns: int, max_tokens: int) -> dict[str, Any]:
    turn = _turn_step(max_tokens)
    convo = [Message(role="system", content=system_text(sid)),
             Message(role="user", content=TASK)]
    t0 = STAMPS.reset()
    error = None
    with workflow("bench-open-run", base_url=base, progress=False) as wf:
        for k in range(turns):
            rendered = [{"role": m.role, "content": m.content}
                        for m in engine_messages(convo, PLAN)]
            try:
                answer = turn(rendered).get()
            except Exception as exc:  # a broken turn ends the session, reported
                error = f"{type(exc).__name__}: {exc}"
                break
            STAMPS.mark()
            if k < turns - 1:
                convo += _run_calls(answer["tool_calls"])
    records = {r["step_id"]: r for r in wf.trace if r.get("type") == "step"}
    rows = [_trace_row(records[f"turn_{k + 1}"]) for k in range(len(STAMPS.times))]
    return _session(t0, STAMPS.times, rows, wf.run_id, error)


# -- c and d. chat completions ---------------------------------------------------------

def run_chat(base: str, sid: str, turns: int, max_tokens: int, *,
             stateless: bool, tools: list[dict[str, Any]] | None = None,
             result_of: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Any]:
    """One session driven by the app over ``/v1/chat/completions`` (``tools``: the
    definitions sent, default the shell tool's; ``result_of``: an OpenAI tool call ->
    its result, default the next fixed output)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_text(sid)},
                                      {"role": "user", "content": TASK}]
    headers = {} if stateless else {"X-Flowlift-Session": sid}
    rows: list[dict[str, Any]] = []
    t0 = STAMPS.reset()
    error = None
    with httpx.Client(base_url=base, timeout=600) as client:
        for k in range(turns):
            sent = messages
            if stateless:
                nonce = f"[request {secrets.token_hex(8)}] "
                sent = [{**messages[0], "content": nonce + messages[0]["content"]},
                        *messages[1:]]
            payload = json.dumps({
                "model": "default", "messages": sent, "tools": tools or OPENAI_TOOLS,
                "tool_choice": "required", "max_tokens": max_tokens, "temperature": 0}).encode()
            r = client.post("/v1/chat/completions", content=payload,
                            headers={**headers, "Content-Type": "application/json"})
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {r.text[:200]}"
                break
            STAMPS.mark()
            body = r.json()
            usage = body["usage"]
            m = re.search(r"engine;dur=([\d.]+)", r.headers.get("server-timing", ""))
            rows.append({"prompt_tokens": usage["prompt_tokens"],
                         "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                         "completion_tokens": usage["completion_tokens"],
                         "engine_ms": float(m.group(1)) if m else None,
                         "bytes_sent": len(payload)})
            calls = body["choices"][0]["message"].get("tool_calls") or []
            if not calls:
                error = f"turn {k + 1} called no tool"
                break
            if k < turns - 1:
                messages += [{"role": "assistant", "content": None, "tool_calls": calls},
                             *({"role": "tool", "tool_call_id": c["id"],
                                "content": STAMPS.next_result() if result_of is None
                                else result_of(c)} for c in calls)]
    return _session(t0, STAMPS.times, rows, None, error)


# -- e. the Responses API, delta-only -------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", "name": SPEC.name, "description": SPEC.description,
                    "parameters": SPEC.parameters}]


def run_responses(base: str, sid: str, turns: int, max_tokens: int) -> dict[str, Any]:
    """c's session through ``/v1/responses``: turn 1 sends the task, every later turn
    ``previous_response_id`` and the tool results only (the proxy keeps the rest)."""
    new: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    previous: str | None = None
    rows: list[dict[str, Any]] = []
    t0 = STAMPS.reset()
    error = None
    with httpx.Client(base_url=base, timeout=600) as client:
        for k in range(turns):
            payload = json.dumps({
                "model": "default", "instructions": system_text(sid), "input": new,
                "tools": RESPONSES_TOOLS, "tool_choice": "required", "temperature": 0,
                "max_output_tokens": max_tokens,
                **({"previous_response_id": previous} if previous else {})}).encode()
            r = client.post("/v1/responses", content=payload,
                            headers={"Content-Type": "application/json"})
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {r.text[:200]}"
                break
            STAMPS.mark()
            body = r.json()
            usage = body["usage"]
            m = re.search(r"engine;dur=([\d.]+)", r.headers.get("server-timing", ""))
            rows.append({"prompt_tokens": usage["input_tokens"],
                         "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                         "completion_tokens": usage["output_tokens"],
                         "engine_ms": float(m.group(1)) if m else None,
                         "bytes_sent": len(payload)})
            calls = [o for o in body["output"] if o["type"] == "function_call"]
            if not calls:
                error = f"turn {k + 1} called no tool"
                break
            previous = body["id"]
            new = [{"type": "function_call_output", "call_id": c["call_id"],
                    "output": STAMPS.next_result()} for c in calls]
    return _session(t0, STAMPS.times, rows, previous, error)


# -- figures ---------------------------------------------------------------------------

def _session(t0: float, marks: list[float], rows: list[dict[str, Any]], run_id: str | None,
             error: str | None) -> dict[str, Any]:
    latencies = [b - a for a, b in zip([t0, *marks], marks, strict=False)]
    for row, lat in zip(rows, latencies, strict=False):
        row["latency_s"] = round(lat, 3)
    return {"turns_done": len(rows), "end_to_end_s": round(marks[-1] - t0, 3) if marks
            else None, "turns": rows, "run_id": run_id, "error": error}


def summarize(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-turn median/p90 (turns 2..N: turn 1 has nothing to reuse), end to end, tokens."""
    later = [t for s in sessions for t in s["turns"][1:]]
    lat = [t["latency_s"] for t in later if "latency_s" in t]
    ttft = [t["engine_ttft_ms"] for t in later if t.get("engine_ttft_ms") is not None]
    engine = [t["engine_ms"] for t in later if t.get("engine_ms") is not None]
    prompt = sum(t["prompt_tokens"] for t in later)
    completion = [t.get("completion_tokens") for t in later if t.get("completion_tokens")]
    out: dict[str, Any] = {
        "sessions": len(sessions), "turns_done": [s["turns_done"] for s in sessions],
        "errors": [s["error"] for s in sessions if s["error"]],
        "turn_latency_median_s": round(statistics.median(lat), 3) if lat else None,
        "turn_latency_p90_s": round(pct(lat, 90), 3) if lat else None,
        "end_to_end_median_s": round(statistics.median(
            s["end_to_end_s"] for s in sessions if s["end_to_end_s"] is not None), 3)
        if any(s["end_to_end_s"] is not None for s in sessions) else None,
        "prompt_tokens": prompt, "cached_tokens": sum(t["cached_tokens"] for t in later),
        "cached_over_prompt": round(sum(t["cached_tokens"] for t in later) / max(1, prompt), 3),
        "completion_tokens_median": statistics.median(completion) if completion else None,
    }
    if ttft:
        out["engine_ttft_median_ms"] = round(statistics.median(ttft), 1)
        out["engine_ttft_p90_ms"] = round(pct(ttft, 90), 1)
    if engine:
        out["engine_ms_median"] = round(statistics.median(engine), 1)
    sent = [[t["bytes_sent"] for t in s["turns"] if "bytes_sent" in t] for s in sessions]
    if any(sent):  # per turn, turn 1 included: what the app sends grows or stays flat
        per_turn = [b for ss in sent for b in ss]
        out["bytes_sent_median"] = statistics.median(per_turn)
        out["bytes_sent_last_turn_median"] = statistics.median(ss[-1] for ss in sent if ss)
        out["bytes_sent_total_median"] = statistics.median(sum(ss) for ss in sent if ss)
    return out


def ratios(summary: dict[str, dict[str, Any]], base_variant: str = "a_agent_step"
           ) -> dict[str, Any]:
    """Each variant's median turn latency and end to end over ``base_variant``'s."""
    if base_variant not in summary:
        return {}
    base = summary[base_variant]
    out = {}
    for v in summary:
        if v == base_variant:
            continue
        s = summary[v]
        out[v] = {k: round(s[k] / base[k], 2) if s.get(k) and base.get(k) else None
                  for k in ("turn_latency_median_s", "turn_latency_p90_s",
                            "end_to_end_median_s")}
    return out


Runner = Callable[[str, str, int, int], dict[str, Any]]
RUNNERS: dict[str, Runner] = {
    "a_agent_step": run_agent_step,
    "b_open_run": run_open_run,
    "c_chat_completions": lambda b, s, t, m: run_chat(b, s, t, m, stateless=False),
    "d_stateless": lambda b, s, t, m: run_chat(b, s, t, m, stateless=True),
    "e_responses": run_responses,
}


def measure(base: str, turns: int, reps: int, max_tokens: int, where: str,
            variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """``reps`` sessions of each variant, alternating (the order rotates per rep)."""
    sessions: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(reps):
        shift = rep % len(variants)
        order = variants[shift:] + variants[:shift]
        for v in order:
            sid = f"{v[0]}-{where}-{turns}-{rep}-{secrets.token_hex(3)}"
            s = RUNNERS[v](base, sid, turns, max_tokens)
            sessions[v].append(s)
            print(f"  {where} {turns:2d} turns rep {rep + 1} {v:20s} e2e "
                  f"{s['end_to_end_s']} s, {s['turns_done']} turns"
                  + (f", error: {s['error'][:120]}" if s["error"] else ""), flush=True)
    summary = {v: summarize(ss) for v, ss in sessions.items()}
    return {"summary": summary, "ratios_over_a": ratios(summary),
            "ratios_over_c": ratios(summary, "c_chat_completions"), "sessions": sessions}


def markdown(results: dict[str, Any]) -> str:
    """A RESULTS.md table of a results file: one row per (where, turns, variant)."""
    lines = ["| where | turns | variant | per-turn median / p90 (s) | end to end (s) | "
             "x of a (turn median / e2e) | engine TTFT median (ms) | engine time median "
             "(ms) | cached / prompt tokens (turns 2..N) | bytes sent per turn median / "
             "last / session | turns done |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, out in results.items():
        if not key.endswith(tuple(f"_turns_{n}" for n in range(1, 201))):
            continue
        where, turns = key.rsplit("_turns_", 1)
        for v, s in out["summary"].items():
            r = out["ratios_over_a"].get(v, {"turn_latency_median_s": "n/a",
                                              "end_to_end_median_s": "n/a"})
            sent = (f"{s['bytes_sent_median']} / {s['bytes_sent_last_turn_median']} / "
                    f"{s['bytes_sent_total_median']}" if "bytes_sent_median" in s else "n/a")
            lines.append(
                f"| {where} | {turns} | {v} | {s['turn_latency_median_s']} / "
                f"{s['turn_latency_p90_s']} | {s['end_to_end_median_s']} | "
                f"{r['turn_latency_median_s']} / {r['end_to_end_median_s']} | "
                f"{s.get('engine_ttft_median_ms', 'n/a')} | {s.get('engine_ms_median', 'n/a')} | "
                f"{s['cached_tokens']} / {s['prompt_tokens']} ({s['cached_over_prompt']}) | "
                f"{sent} | {', '.join(map(str, s['turns_done']))} |")
    return "\n".join(lines)


@contextlib.contextmanager
def fake_proxy() -> Iterator[str]:
    """``flowlift serve --engine fake`` (its log in a temporary folder)."""
    with tempfile.TemporaryDirectory() as tmp, running_proxy(
            "--engine", "fake", "--state-db", ":memory:", "--log-level", "warning",
            log_path=Path(tmp) / "proxy.log", ready_timeout_s=120) as (base, _):
        yield base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[6, 35])
    parser.add_argument("--far-turns", type=int, nargs="*", default=None,
                        help="session lengths through the delay line (default: --turns)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=40,
                        help="per turn; a forced tool call is ~20 tokens of JSON")
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="which variants to run (default: all)")
    parser.add_argument("--table", metavar="JSON", default=None,
                        help="only print a results file as a markdown table")
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine, 3 and 4 turns, 20 ms: the plumbing in seconds")
    parser.add_argument("--out", default=None,
                        help="results name in bench/results (default agent_loop; with "
                             "--smoke nothing is written unless --out is given)")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(markdown(json.loads(Path(args.table).read_text())))
        return 0
    if args.smoke:
        args.turns, args.far_turns, args.rtt_ms, args.reps = [3, 4], [3], 20.0, 1
    far_turns = args.turns if args.far_turns is None else args.far_turns
    name = args.out or (None if args.smoke else "agent_loop")
    results: dict[str, Any] = {
        "command": "python bench/agent_loop.py " + " ".join(argv or sys.argv[1:]),
        "engine": "fake (smoke)" if args.smoke else
        "embedded vLLM CPU build, SmolLM2-135M-Instruct, 2 shared CPU cores",
        "max_tokens": args.max_tokens, "reps": args.reps, "rtt_ms": args.rtt_ms,
        "tool_choice": "required on every turn (the last turn's call is not run)",
        "variants": {
            "a_agent_step": "@step(tools=[shell], max_turns=N, tool_choice='required'): "
                            "the proxy loops; ends with StepFailed at max_turns, as expected",
            "b_open_run": "Python loop in with workflow(...): one step per turn, .get(), "
                          "the tool as a plain call",
            "c_chat_completions": "the app drives /v1/chat/completions with tools and "
                                  "X-Flowlift-Session",
            "d_stateless": "as c with a unique nonce first in the system message, no "
                           "session: every turn re-prefills",
            "e_responses": "/v1/responses with previous_response_id: each turn sends only "
                           "its tool results (delta-only client)"}}
    started = fake_proxy() if args.smoke else proxy("--max-concurrency", "4",
                                                    name="agent_loop")
    with started as base:
        port = int(base.rsplit(":", 1)[1])
        line = DelayLine(port, args.rtt_ms / 2000.0)
        far = f"http://127.0.0.1:{line.port}"
        run_chat(base, "warm-up", 1, 4, stateless=True)
        for where, url, lengths in (("local", base, args.turns),
                                    (f"{args.rtt_ms:g}ms", far, far_turns)):
            for turns in lengths:
                print(f"{where}: {turns}-turn sessions", flush=True)
                out = measure(url, turns, args.reps, args.max_tokens, where,
                              tuple(args.variants))
                results[f"{where}_turns_{turns}"] = out
                for v, s in out["summary"].items():
                    print(f"  {v:20s} turn median {s['turn_latency_median_s']} s p90 "
                          f"{s['turn_latency_p90_s']} s, e2e {s['end_to_end_median_s']} s, "
                          f"cached/prompt {s['cached_over_prompt']}, bytes sent per turn "
                          f"{s.get('bytes_sent_median', 'n/a')} (last "
                          f"{s.get('bytes_sent_last_turn_median', 'n/a')})", flush=True)
                print(f"  over a: {out['ratios_over_a']}", flush=True)
                print(f"  over c: {out['ratios_over_c']}", flush=True)
                if name is not None:  # after each size: a partial run keeps its figures
                    save(name, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
