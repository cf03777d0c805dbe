"""The agent-session workload of the head-to-head benchmark, and its measurements.

A session is an agent loop over ``/v1/chat/completions``: a system preamble that starts
with the session's id (so no two sessions share a cached prefix), a task, then per turn
the model's answer (``max_tokens`` tokens, greedy) and a tool result (fixed shell
output, 4-5 lines, sent as a user message ``Tool result (turn N): ...``) appended for
the next turn, after a *tool wait* (the client sleeps, as an agent does while its tool
runs). The last answer ends the session. Every turn resends the whole conversation,
as OpenAI-compatible agent frameworks do, with ``X-Flowlift-Session`` (ignored by
vLLM).

:func:`plan` draws, from a seed, each session's number of turns, tool waits and
arrival offset; every side gets the same plan. :func:`run_sessions` runs a plan
against one server; :func:`summarize` reduces the per-turn records.

No engine, no server here: only HTTP clients (httpx).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.agent_session import PREAMBLE, TASK, tool_result
from bench.harness import pct

MIXED_TURNS = [6, 6, 6, 6, 6, 6, 8, 8, 10, 10, 12, 15, 20, 25, 30, 35]
"""16 sessions of 6 to 35 turns, mostly short (agent traffic is): 219 turns; a plan of
more sessions repeats it."""


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """One session: its id, arrival offset (s from the run's start), and the tool wait
    after each turn but the last (s)."""

    sid: str
    arrival_s: float
    tool_waits_s: tuple[float, ...]

    @property
    def turns(self) -> int:
        return len(self.tool_waits_s) + 1


def plan(sessions: int, *, seed: int = 0, arrival_gap_s: float = 0.2,
         tool_s: tuple[float, float] = (0.2, 3.0), turns: list[int] | None = None,
         tag: str = "s") -> list[SessionPlan]:
    """``sessions`` sessions: lengths from ``turns`` (default :data:`MIXED_TURNS`,
    repeated), shuffled by ``seed``, arriving ``arrival_gap_s`` apart, with tool waits
    drawn uniformly from ``tool_s`` (seconds)."""
    pool = list(turns or MIXED_TURNS)
    lengths = [pool[i % len(pool)] for i in range(sessions)]
    rng = random.Random(seed)
    rng.shuffle(lengths)
    return [SessionPlan(f"{tag}{seed}-{i:02d}", i * arrival_gap_s,
                        tuple(round(rng.uniform(*tool_s), 3) for _ in range(n - 1)))
            for i, n in enumerate(lengths)]


def first_messages(sid: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"Session {sid}. {PREAMBLE}"},
            {"role": "user", "content": TASK}]


async def turn(client: httpx.AsyncClient, model: str, messages: list[dict[str, Any]],
               max_tokens: int, sid: str, stream: bool = False) -> dict[str, Any]:
    """One turn: the answer text, usage tokens, latency and TTFT (s; TTFT only when
    ``stream``).

    Raises:
        RuntimeError: the server answered an error (its status and body).
    """
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0}
    headers = {"X-Flowlift-Session": sid}
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    piece = choice["delta"].get("content") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
                usage = chunk.get("usage") or usage
    else:
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        out = r.json()
        text, usage = out["choices"][0]["message"].get("content") or "", out["usage"]
    latency = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError("no usage in the answer")
    details = usage.get("prompt_tokens_details") or {}
    return {"latency_s": latency, "ttft_s": ttft if ttft is not None else latency,
            "prompt_tokens": int(usage["prompt_tokens"]),
            "completion_tokens": int(usage["completion_tokens"]),
            "cached_tokens": int(details.get("cached_tokens") or 0), "text": text}


def advance(messages: list[dict[str, Any]], answer: str, n: int) -> list[dict[str, Any]]:
    """The conversation after turn ``n`` (0-based): its answer and its tool result."""
    return [*messages, {"role": "assistant", "content": answer},
            {"role": "user", "content": tool_result(n)}]


async def run_session(base: str, model: str, p: SessionPlan, max_tokens: int,
                      t0: float) -> dict[str, Any]:
    """One session of ``p`` from its arrival to its last answer; per-turn records."""
    await asyncio.sleep(max(0.0, p.arrival_s - (time.perf_counter() - t0)))
    start = time.perf_counter()
    messages = first_messages(p.sid)
    rows: list[dict[str, Any]] = []
    error = None
    async with httpx.AsyncClient(base_url=base, timeout=1800) as client:
        for n in range(p.turns):
            try:
                out = await turn(client, model, messages, max_tokens, p.sid)
            except (RuntimeError, httpx.HTTPError) as exc:
                error = f"turn {n + 1}: {exc}"
                break
            prev = rows[-1] if rows else None
            out["reusable_tokens"] = (prev["prompt_tokens"] + prev["completion_tokens"]
                                      if prev else 0)
            rows.append({k: v for k, v in out.items() if k != "text"})
            if n < p.turns - 1:
                await asyncio.sleep(p.tool_waits_s[n])
                messages = advance(messages, out["text"], n)
    end = time.perf_counter()
    return {"sid": p.sid, "turns": p.turns, "arrived_s": round(start - t0, 3),
            "ended_s": round(end - t0, 3), "session_s": round(end - start, 3),
            "tool_wait_s": round(sum(p.tool_waits_s), 3), "rows": rows, "error": error}


async def run_sessions(base: str, model: str, plans: list[SessionPlan],
                       max_tokens: int) -> list[dict[str, Any]]:
    """Every session of ``plans`` against ``base`` at its arrival offset."""
    t0 = time.perf_counter()
    return list(await asyncio.gather(*(run_session(base, model, p, max_tokens, t0)
                                       for p in plans)))


def token_totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Prompt, cached, uncached (prefilled) and re-prefilled tokens (those of the
    previous turn's prompt and answer that the cache did not serve) of some turns."""
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    again = sum(max(0, min(r["reusable_tokens"], r["prompt_tokens"]) - r["cached_tokens"])
                for r in rows)
    return {"prompt_tokens": prompt, "cached_tokens": cached,
            "prefilled_tokens": prompt - cached, "reprefilled_tokens": again}


def summarize(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean / p50 / p90 session time (s), makespan, turns/s and the token totals."""
    times = [s["session_s"] for s in sessions]
    makespan = max(s["ended_s"] for s in sessions) - min(s["arrived_s"] for s in sessions)
    rows = [r for s in sessions for r in s["rows"]]
    tokens = token_totals(rows)
    return {"sessions": len(sessions), "mean_s": round(statistics.mean(times), 2),
            "p50_s": round(statistics.median(times), 2), "p90_s": round(pct(times, 90), 2),
            "max_s": round(max(times), 2), "makespan_s": round(makespan, 2),
            "turns_done": len(rows),
            "turns_per_s": round(len(rows) / makespan, 3) if makespan else None,
            "mean_tool_wait_s": round(statistics.mean(s["tool_wait_s"] for s in sessions), 2),
            **tokens,
            "cached_share": round(tokens["cached_tokens"] / max(1, tokens["prompt_tokens"]), 3),
            "errors": [f"{s['sid']}: {s['error']}" for s in sessions if s["error"]]}
