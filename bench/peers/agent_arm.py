"""P7 (c): the same agent sessions as one flowlift agent step each, tools on the proxy.

Where the chat arms (:mod:`bench.peers.workload`) send every turn as a chat completion
and sleep through the tool wait in the client, this arm sends each session once, as a
workflow of one agent step (``@step(tools=[proxy_tool(...)])``), and the proxy runs the
loop: a model turn, the tool call run by the proxy itself (a ``[tools.peers]``
callable), its result appended as a ``tool`` message, the next turn on the same
program, until the last turn answers.

Matching the chat arms' turns. SmolLM2-135M does not call tools reliably by itself, so
the step forces them: ``tool_choice="required"`` makes each turn call a tool, and
``on_max_turns="answer"`` with ``max_turns`` = the session's planned turns makes the
last turn the answer, asked with the tools off (:mod:`flowlift.proxy.workflows.agent`;
that turn also gets the loop's one-line "last turn" instruction), and
``parallel_tool_calls=False`` holds a turn to one call (else SmolLM2 keeps appending
calls to the forced call array until ``max_tokens`` cuts the turn off: the first run of
this arm, bench/RESULTS.md issue 35, "P7 (c)"). A session of N
planned turns is then N-1 forced calls and one answer, as in the chat arms. What still
differs, and is reported (``turns_taken``, ``tool_calls``, the token totals): a turn's
output is the call's constrained JSON (~20 tokens: the arm needs a larger
``max_tokens`` than the chat arms' 16 or its calls are cut), the tools' description is
part of the prompt, and an answer the loop takes for a fragment is tried once more
(one more turn than planned).

The tool. Each session gets its own proxy tool, named after the plan's session id
(:func:`tool_name`), taking no arguments: the n-th call waits the session's n-th drawn
tool wait and returns :func:`bench.agent_session.tool_result` of n, the chat arms' tool
result of that turn. Calls of one turn (the model may ask for several at once) run
together and share the turn's index (:class:`SessionTools`). The proxy imports the
tools from this module (``bench.peers.agent_arm:<name>``, module ``__getattr__``) and
reads the plan from the JSON file named by :data:`PLAN_ENV`.

    write_plan(path, plans); config_text(plans)  # before the server starts
    await run_sessions(base, model, plans, arm, max_tokens)  # rows as workload's
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.agent_session import tool_result
from bench.peers.workload import SessionPlan, first_messages, token_totals

PLAN_ENV = "FLOWLIFT_PEERS_AGENT_PLAN"
"""The environment variable naming the plan file the proxy's tools read."""
SERVER = "peers"
"""The ``[tools.<name>]`` of the arm's proxy config."""
MODULE = "bench.peers.agent_arm"
TOOL_TIMEOUT_S = 3600
"""The tools' ``timeout_s``: far above any drawn wait (the tool must never time out)."""


def tool_name(sid: str) -> str:
    """A session's tool name: its plan id as a Python identifier (what a proxy
    callable's name must be, and a tool name may hold: ``[A-Za-z_][A-Za-z0-9_]{0,63}``),
    other characters as ``_``."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", sid)
    return (name if name[:1].isalpha() else f"s_{name}")[:64]


def write_plan(path: Path, plans: Sequence[SessionPlan]) -> None:
    """The tool waits of every session of ``plans``, by tool name, as JSON at ``path``.

    Raises:
        ValueError: two sessions would get the same tool name.
    """
    table = {tool_name(p.sid): list(p.tool_waits_s) for p in plans}
    if len(table) != len(plans):
        raise ValueError("two sessions of the plan share a tool name")
    path.write_text(json.dumps(table), encoding="utf-8")


def config_text(plans: Sequence[SessionPlan]) -> str:
    """The ``flowlift serve --config`` TOML that makes every session's tool a proxy
    callable of this module."""
    paths = ", ".join(f'"{MODULE}:{tool_name(p.sid)}"' for p in plans)
    return f"[tools.{SERVER}]\ncallables = [{paths}]\ntimeout_s = {TOOL_TIMEOUT_S}\n"


@dataclass(slots=True)
class _Calls:
    next: int = 0  # the index the next turn's calls get
    index: int = 0  # the index of the calls in flight
    inflight: int = 0


class SessionTools:
    """Every session's tool: the n-th turn's calls wait the session's n-th tool wait and
    return the n-th tool result.

    A call that starts while another call of the same session is in flight is of the
    same turn (the agent loop runs one turn's calls together, and a session's turns one
    after another), so it gets the same index; a call past the plan's waits (a model
    that called more often than planned) waits nothing.

    Args:
        waits: tool name -> that session's tool waits (seconds), in turn order.
        sleep: waits a number of seconds (tests inject their own).
    """

    def __init__(self, waits: dict[str, Sequence[float]],
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.waits = {name: tuple(w) for name, w in waits.items()}
        self._sleep = sleep
        self._calls = {name: _Calls() for name in self.waits}
        self.log: list[tuple[str, int]] = []
        """(tool, turn index) per call, in the order they started."""

    async def call(self, name: str) -> str:
        """Run one call of session ``name``'s tool.

        Raises:
            KeyError: no such session in the plan.
        """
        state, waits = self._calls[name], self.waits[name]
        if state.inflight == 0:
            state.index, state.next = state.next, state.next + 1
        n = state.index
        state.inflight += 1
        self.log.append((name, n))
        try:
            await self._sleep(waits[n] if n < len(waits) else 0.0)
            return tool_result(n)
        finally:
            state.inflight -= 1


@functools.cache
def _session_tools(path: str) -> SessionTools:
    """The tools of the plan file at ``path`` (read once per file, in the proxy)."""
    return SessionTools(json.loads(Path(path).read_text(encoding="utf-8")))


def make_tool(tools: SessionTools, name: str) -> Callable[[], Awaitable[str]]:
    """Session ``name``'s tool as an async function of no arguments, named ``name``."""
    async def run() -> str:
        return await tools.call(name)

    run.__name__ = run.__qualname__ = name
    run.__doc__ = "Run this session's next command and return its output."
    return run


def __getattr__(name: str) -> Callable[[], Awaitable[str]]:
    """``bench.peers.agent_arm:<tool name>`` (the proxy's ``callables``)."""
    path = os.environ.get(PLAN_ENV)
    if name.startswith("_") or not path:
        raise AttributeError(name if path else f"{name}: {PLAN_ENV} is not set (the "
                             "agent arm's plan file)")
    tools = _session_tools(path)
    if name not in tools.waits:
        raise AttributeError(f"no session {name!r} in the plan {path}")
    return make_tool(tools, name)


# -- the client: one workflow per session ------------------------------------------------

def rows_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-turn rows of an agent step's trace record, shaped as the chat arms'
    (:func:`bench.peers.workload.token_totals`): each attempt's prompt, cached and
    completion tokens, its latency (s), and ``reusable_tokens`` (the previous turn's
    prompt and answer, which this turn's prompt starts with)."""
    rows: list[dict[str, Any]] = []
    for a in record.get("attempts") or []:
        prev = rows[-1] if rows else None
        done = a.get("finished_ms")
        rows.append({
            "prompt_tokens": int(a.get("prompt_tokens") or 0),
            "cached_tokens": int(a.get("cached_tokens") or 0),
            "completion_tokens": int(a.get("completion_tokens") or 0),
            "latency_s": (done - a["started_ms"]) / 1000 if done is not None else None,
            "outcome": a.get("outcome"),
            "reusable_tokens": prev["prompt_tokens"] + prev["completion_tokens"]
            if prev else 0})
    return rows


async def run_session(base: str, model: str, p: SessionPlan, tool: str, max_tokens: int,
                      t0: float) -> dict[str, Any]:
    """Session ``p`` as one agent step on ``base``, from its arrival to its answer;
    the chat arms' record (:func:`bench.peers.workload.run_session`) plus
    ``turns_taken`` and ``tool_calls``."""
    from flowlift import proxy_tool, step, workflow
    from flowlift.errors import FlowliftError

    await asyncio.sleep(max(0.0, p.arrival_s - (time.perf_counter() - t0)))
    start = time.perf_counter()

    @step(tools=[proxy_tool(f"{SERVER}.{tool}")], max_turns=p.turns,
          tool_choice="required", on_max_turns="answer", parallel_tool_calls=False,
          max_tokens=max_tokens,
          temperature=0, model=model, name="agent")
    def agent(sid: str) -> list[dict[str, Any]]:
        return first_messages(sid)

    error = None
    wf = workflow("peers-agent", base_url=base, progress=False)
    try:
        async with wf:
            agent(p.sid)
    except FlowliftError as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    record = next((r for r in wf.trace or [] if r.get("step_id") == "agent_1"), {})
    rows = rows_of(record)
    return {"sid": p.sid, "turns": p.turns, "arrived_s": round(start - t0, 3),
            "ended_s": round(end - t0, 3), "session_s": round(end - start, 3),
            "tool_wait_s": round(sum(p.tool_waits_s), 3), "rows": rows, "error": error,
            "turns_taken": len(rows), "tool_calls": len(record.get("tool_calls") or [])}


async def run_sessions(base: str, model: str, plans: Sequence[SessionPlan], arm: str,
                       max_tokens: int) -> list[dict[str, Any]]:
    """Every session of ``plans`` (untagged: their ids name the tools) as agent steps
    on ``base`` at its arrival offset; each session's id tagged with ``arm``."""
    t0 = time.perf_counter()
    return list(await asyncio.gather(*(
        run_session(base, model, SessionPlan(f"{arm}-{p.sid}", p.arrival_s, p.tool_waits_s),
                    tool_name(p.sid), max_tokens, t0) for p in plans)))


def turn_counts(sessions: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Turns planned against turns taken and tool calls made (planned: one fewer than
    the turns, per session), summed over ``sessions``; and the tokens re-prefilled by
    the sessions' last turns alone (the answer, asked with the tools off: its prompt
    lacks the tools' text that the earlier turns' system message held)."""
    return {"turns_planned": sum(s["turns"] for s in sessions),
            "turns_taken": sum(s["turns_taken"] for s in sessions),
            "calls_planned": sum(s["turns"] - 1 for s in sessions),
            "tool_calls": sum(s["tool_calls"] for s in sessions),
            "sessions_off_plan": sum(s["turns_taken"] != s["turns"] for s in sessions),
            "reprefilled_last_turns": token_totals(
                [s["rows"][-1] for s in sessions if s["rows"]])["reprefilled_tokens"]}
