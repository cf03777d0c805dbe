"""Agent sessions under load (issue 24 §4): 16 concurrent tool-calling sessions on ONE
embedded engine, with and without program-level scheduling.

The sessions are those of ``bench/agent_loop.py`` (its system preamble with the session
id first, its task, its ``shell`` tool, greedy decoding, ``tool_choice="required"``
on every turn, so each session has exactly its number of turns; the last turn's call
is not run), but of mixed lengths (``--turns``: 6 to 35 by default) and all running at
once: they arrive ``--arrival-gap-s`` apart in a seeded shuffled order, and every
variant gets the same sessions in the same order at the same offsets. The tool takes
``--tool-s`` and returns a fixed shell output per command (``bench/agent_session.py``'s
texts), so the same model choices give the same conversation in every variant.

Variants, each on its own ``flowlift serve`` with the same ``--max-concurrency`` (the
engine slots that the proxy's queue orders):

* **las**: agent steps (``@step(tools=[shell], max_turns=N)``, the proxy loops, the app
  runs the tool), program scheduling on (least attained service over sessions,
  :mod:`flowlift.proxy.dispatch.slots.programs`);
* **no_las**: the same agent steps with ``--no-program-scheduling`` (the proxy's class
  and critical-path order only): the scheduling's own effect is las vs no_las;
* **chat_fcfs**: the same sessions as app-driven ``/v1/chat/completions`` with
  ``X-Flowlift-Session`` (what agent frameworks do) on ``--scheduling fcfs``: first come,
  first served, no program scheduling;
* **chat_las** (not run by default): the same chat completions with program scheduling
  on (the session header names the program).

Per session: completion time, from its arrival to its last answer (for agent steps,
the end of its ``workflow`` block). Reported per variant: mean, median, p90 and max
session completion time, the makespan (first arrival to last end) and throughput
(turns and completion tokens per second of makespan), and the ratios chat_fcfs / las
and no_las / las (the goal: mean >= 2x, p90 >= 1x).

The tools are app ``@tool`` s (``--tools app``); proxy-run tools plug in through
:data:`TOOL_BINDINGS` once the proxy runs them.

    .venv/bin/python bench/agent_load.py [--turns 6 6 ... 35] [--max-concurrency 4]
        [--arrival-gap-s 1] [--tool-s 0.2] [--max-tokens 40] [--variants las no_las chat_fcfs]
    .venv/bin/python bench/agent_load.py --smoke   # seconds, fake engine: plumbing only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_loop import OPENAI_TOOLS, Command, system_text
from bench.agent_session import TASK, TOOLS
from bench.harness import pct, proxy, save
from flowlift import WorkflowFailed, step, tool, workflow

DEFAULT_TURNS = [6, 6, 6, 6, 6, 6, 8, 8, 10, 10, 12, 15, 20, 25, 30, 35]
"""16 sessions, 6-35 turns, mostly short (as agent traffic is): 219 turns in all."""
VARIANTS = {
    "las": ("agent", ()),
    "no_las": ("agent", ("--no-program-scheduling",)),
    "chat_fcfs": ("chat", ("--scheduling", "fcfs")),
    "chat_las": ("chat", ()),
}
DEFAULT_VARIANTS = ["las", "no_las", "chat_fcfs"]
OUTPUT = dict(zip(("ls", "grep", "sed", "pytest", "run"), TOOLS, strict=True))
"""The tool's fixed output per command (the same text in every variant)."""
TOOL_S = {"s": 0.2}  # the tool's run time (set from --tool-s)


@tool
async def shell(command: Command) -> str:
    """Run one shell command in the repository and return its output."""
    await asyncio.sleep(TOOL_S["s"])
    return OUTPUT[command]


TOOL_BINDINGS: dict[str, list[Any]] = {"app": [shell]}
"""``--tools`` -> the agent step's tools (app ``@tool`` s; proxy tools join here)."""


# -- one session per variant -------------------------------------------------------------

async def agent_session(base: str, sid: str, turns: int, max_tokens: int,
                        tools: list[Any]) -> dict[str, Any]:
    """One agent step of ``turns`` turns (ends with StepFailed at max_turns, as
    expected with ``tool_choice="required"``)."""
    @step(tools=tools, max_turns=turns, tool_choice="required", max_tokens=max_tokens,
          name="agent")
    def agent(session: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system_text(session)},
                {"role": "user", "content": TASK}]

    error = None
    try:
        async with workflow("bench-agent-load", base_url=base, progress=False) as wf:
            agent(sid)
    except WorkflowFailed:
        error = str(next(iter(wf.failures.values()), "failed"))
    record = next((r for r in wf.trace if r.get("step_id") == "agent_1"), {})
    attempts = record.get("attempts") or []
    return {"turns_done": len(attempts),
            "completion_tokens": sum(a.get("completion_tokens") or 0 for a in attempts),
            "error": None if error is not None and f"after {turns} turns" in error
            else error}


async def chat_session(base: str, sid: str, turns: int, max_tokens: int,
                       tools: list[Any]) -> dict[str, Any]:
    """The app drives ``/v1/chat/completions`` turn by turn with ``X-Flowlift-Session``."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_text(sid)},
                                      {"role": "user", "content": TASK}]
    done, tokens, error = 0, 0, None
    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        for k in range(turns):
            r = await client.post("/v1/chat/completions", headers={"X-Flowlift-Session": sid},
                                  json={"model": "default", "messages": messages,
                                        "tools": OPENAI_TOOLS, "tool_choice": "required",
                                        "max_tokens": max_tokens, "temperature": 0})
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {r.text[:200]}"
                break
            body = r.json()
            done += 1
            tokens += body["usage"]["completion_tokens"]
            calls = body["choices"][0]["message"].get("tool_calls") or []
            if not calls:
                error = f"turn {k + 1} called no tool"
                break
            if k == turns - 1:
                break
            results = await asyncio.gather(*(_run_tool(c) for c in calls))
            messages += [{"role": "assistant", "content": None, "tool_calls": calls},
                         *({"role": "tool", "tool_call_id": c["id"], "content": text}
                           for c, text in zip(calls, results, strict=True))]
    return {"turns_done": done, "completion_tokens": tokens, "error": error}


async def _run_tool(call: dict[str, Any]) -> str:
    try:
        command = json.loads(call["function"]["arguments"]).get("command")
    except ValueError:
        return "error: arguments are not JSON"
    await asyncio.sleep(TOOL_S["s"])
    return OUTPUT.get(command, f"error: unknown command {command!r}")


Session = Callable[[str, str, int, int, list[Any]], Awaitable[dict[str, Any]]]
KINDS: dict[str, Session] = {"agent": agent_session, "chat": chat_session}


# -- a variant: every session at its offset ----------------------------------------------

def schedule(turns: list[int], gap_s: float, seed: int) -> list[tuple[float, int]]:
    """``(arrival offset s, turns)`` per session: a seeded shuffle, ``gap_s`` apart."""
    order = list(turns)
    random.Random(seed).shuffle(order)
    return [(i * gap_s, n) for i, n in enumerate(order)]


async def run_variant(base: str, kind: str, plan: list[tuple[float, int]], max_tokens: int,
                      tools: list[Any], tag: str) -> list[dict[str, Any]]:
    t0 = time.perf_counter()

    async def one(i: int, offset: float, turns: int) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
        start = time.perf_counter()
        out = await KINDS[kind](base, f"{tag}-{i}", turns, max_tokens, tools)
        end = time.perf_counter()
        return {"session": i, "turns": turns, "arrived_s": round(start - t0, 3),
                "ended_s": round(end - t0, 3), "completion_s": round(end - start, 3), **out}
    return list(await asyncio.gather(*(one(i, o, n) for i, (o, n) in enumerate(plan))))


def summarize(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    times = [s["completion_s"] for s in sessions]
    makespan = max(s["ended_s"] for s in sessions) - min(s["arrived_s"] for s in sessions)
    turns = sum(s["turns_done"] for s in sessions)
    short = [s["completion_s"] for s in sessions if s["turns"] <= 10]
    long_ = [s["completion_s"] for s in sessions if s["turns"] > 10]
    return {"sessions": len(sessions), "mean_s": round(statistics.mean(times), 2),
            "median_s": round(statistics.median(times), 2),
            "p90_s": round(pct(times, 90), 2), "max_s": round(max(times), 2),
            "mean_short_s": round(statistics.mean(short), 2) if short else None,
            "mean_long_s": round(statistics.mean(long_), 2) if long_ else None,
            "makespan_s": round(makespan, 2), "turns_done": turns,
            "turns_per_s": round(turns / makespan, 3) if makespan else None,
            "completion_tokens_per_s": round(
                sum(s["completion_tokens"] for s in sessions) / makespan, 2)
            if makespan else None,
            "errors": [f"session {s['session']}: {s['error']}" for s in sessions
                       if s["error"]]}


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each other variant's mean, p90 and makespan over ``las``'s (>1: las is better)."""
    base = summary.get("las")
    if base is None:
        return {}
    return {v: {k: round(s[k] / base[k], 2) if base.get(k) else None
                for k in ("mean_s", "p90_s", "makespan_s", "mean_short_s", "mean_long_s")}
            for v, s in summary.items() if v != "las"}


def markdown(results: dict[str, Any]) -> str:
    lines = ["| variant | mean / median / p90 / max session time (s) | mean short (<=10 "
             "turns) / long (s) | makespan (s) | turns/s | completion tok/s | x of las "
             "(mean / p90) |", "|---|---|---|---|---|---|---|"]
    for v, s in results["summary"].items():
        r = results["ratios_over_las"].get(v, {"mean_s": 1.0, "p90_s": 1.0})
        lines.append(f"| {v} | {s['mean_s']} / {s['median_s']} / {s['p90_s']} / "
                     f"{s['max_s']} | {s['mean_short_s']} / {s['mean_long_s']} | "
                     f"{s['makespan_s']} | {s['turns_per_s']} | "
                     f"{s['completion_tokens_per_s']} | {r['mean_s']} / {r['p90_s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=DEFAULT_TURNS,
                        help="turns per session (one number per session)")
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--arrival-gap-s", type=float, default=1.0)
    parser.add_argument("--tool-s", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tools", choices=sorted(TOOL_BINDINGS), default="app")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        default=DEFAULT_VARIANTS)
    parser.add_argument("--serve", nargs="*", default=[], metavar="FLAG",
                        help="more `flowlift serve` flags for every variant (e.g. "
                             "--serve=--no-prefill-ahead)")
    parser.add_argument("--fake-delay-s", type=float, default=None,
                        help="run on the fake engine with this delay per chunk instead "
                             "(the proxy's and SDK's paths without engine compute)")
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine, 4 short sessions: the plumbing in seconds")
    parser.add_argument("--out", default=None, help="results name in bench/results "
                        "(default agent_load; nothing written with --smoke)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.turns, args.arrival_gap_s, args.tool_s = [2, 3, 2, 4], 0.05, 0.01
    TOOL_S["s"] = args.tool_s
    plan = schedule(args.turns, args.arrival_gap_s, args.seed)
    results: dict[str, Any] = {
        "command": "python bench/agent_load.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv),
        "engine": "fake (smoke)" if args.smoke else
        "embedded vLLM CPU build, SmolLM2-135M-Instruct, 2 shared CPU cores",
        "max_concurrency": args.max_concurrency, "max_tokens": args.max_tokens,
        "tool_s": args.tool_s, "arrival_gap_s": args.arrival_gap_s, "tools": args.tools,
        "serve_flags": args.serve, "plan": plan,
        "variants": {v: " ".join(VARIANTS[v][1]) or "(defaults)" for v in args.variants},
        "summary": {}, "sessions": {}}
    tools = TOOL_BINDINGS[args.tools]
    fake = args.smoke or args.fake_delay_s is not None
    if args.fake_delay_s is not None:
        args.serve = [*args.serve, "--fake-delay-s", str(args.fake_delay_s)]
        results["engine"] = f"fake, {args.fake_delay_s} s per chunk"
    for v in args.variants:
        kind, flags = VARIANTS[v]
        with proxy("--max-concurrency", str(args.max_concurrency), *flags, *args.serve,
                   name=f"agent_load_{v}", engine="fake" if fake else "vllm") as base:
            httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
                "model": "default", "max_tokens": 2,
                "messages": [{"role": "user", "content": "warm up"}]})
            sessions = asyncio.run(run_variant(base, kind, plan, args.max_tokens, tools, v))
            programs = httpx.get(f"{base}/readyz", timeout=30).json().get("programs")
        results["sessions"][v] = sessions
        results.setdefault("programs", {})[v] = programs  # the table at the end
        results["summary"][v] = s = summarize(sessions)
        print(f"{v:10s} mean {s['mean_s']} s p90 {s['p90_s']} s max {s['max_s']} s, "
              f"makespan {s['makespan_s']} s, {s['turns_per_s']} turns/s, "
              f"errors {len(s['errors'])}", flush=True)
        results["ratios_over_las"] = ratios(results["summary"])
        save(args.out or "agent_load", results, smoke=args.smoke)
    print(f"over las: {results['ratios_over_las']}")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
