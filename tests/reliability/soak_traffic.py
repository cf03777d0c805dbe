"""The soak's traffic: one *arrival* = one workflow run with an id never used before, a chat
beside it, and now and then the other routes; outcomes and latencies go to a
:class:`Tally` (one per window of ``soak_long.py``).

Workflow runs, by ``i % 10`` (:data:`MIX`), each followed over its SSE event stream
(``httpx_sse``) to ``run.finished``:

* ``run`` (5 in 10): a step on the embedded ``fake-model``, then one on ``up`` (the fake
  upstream) that reads it; must succeed; then ``GET /v1/workflows/{id}``.
* ``open`` (1): an open run (``"open": true``), ``/nodes`` appends a step, ``/close``;
  must succeed.
* ``cancel`` (2): two ``fake-model`` steps; ``DELETE /v1/workflows/{id}`` (what the SDK's
  ``wf.cancel()`` sends) 0-200 ms after the first event; must end ``cancelled`` (or
  ``succeeded`` when the cancel came after the end: ``"cancelled": false``).
* ``leave`` (2): the same two steps; the client reads the first event and closes the
  stream (leaves early), then follows ``/v1/workflows/{id}/events?after=1`` to the end:
  must succeed (a run outlives its client).

The chat (every arrival, session ``s-<i>`` and workflow ``w-<i>`` new): ``up`` or
``fake-model``, streamed or not (``i % 4``). Every fifth arrival also: a
``/v1/responses`` call, ``GET /v1/sessions/s-<i>``, another tenant asking for the run and
the workflow (must be 404) and an unknown key (must be 401). Three tenants in turn.

Anything else -- another status, a run that ends otherwise, an operation past
``op_timeout_s`` (a hang) -- is an error: counted and its first lines kept.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web
from httpx_sse import EventSource, ServerSentEvent, aconnect_sse

from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes

TENANT_KEYS = ("sk-soak-t0", "sk-soak-t1", "sk-soak-t2")
MIX = ("run", "cancel", "run", "leave", "run", "open", "run", "cancel", "run", "leave")
RESPONSE = {"id": "resp_soak", "object": "response", "status": "completed",
            "model": "up-model", "output": [{"type": "message", "role": "assistant",
                                             "content": [{"type": "output_text",
                                                          "text": "ok"}]}],
            "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}
TEXT = "write a few words about the sea, the sky and the long road home"


async def upstream_answer(request: web.Request) -> web.StreamResponse:
    """Whatever ``up`` is asked: a response object, a stream with usage, or a chat."""
    body = json.loads(await request.read())
    if request.path.endswith("/responses"):
        return await FakeUpstream.json(RESPONSE)(request)
    if body.get("stream") is True:
        return await FakeUpstream.stream(sse_bytes(
            chunk({"content": "ok"}), chunk({}, "stop"),
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}))(request)
    return await FakeUpstream.json(chat_json("ok"))(request)


@dataclass
class Tally:
    """One window's outcomes, counted by the operations that ended in it."""

    started: int = 0
    ended: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """``run.finished`` statuses seen by the client (``succeeded``, ``cancelled``...)."""
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)
    latency_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    lag_s: float = 0.0
    """The latest an arrival started after its scheduled time (the driver's own lag)."""

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.first_errors) < 20:
            self.first_errors.append(what[:400])

    def roll(self) -> dict[str, Any]:
        """This window's figures (latency: ``p50``/``p99``/``n`` per measure, ms); the
        next window counts from zero (the first errors are kept for the whole soak)."""
        out = {"started": self.started, "ended": dict(self.ended), "errors": self.errors,
               "lag_s": round(self.lag_s, 3),
               "latency_ms": {name: {"p50": statistics.median(v),
                                     "p99": statistics.quantiles(v, n=100)[98],
                                     "n": len(v)}
                              for name, v in self.latency_ms.items() if len(v) >= 2}}
        self.started = self.errors = 0
        self.lag_s = 0.0
        self.ended.clear()
        self.latency_ms.clear()
        return out

    def took(self, name: str, since: float) -> None:
        self.latency_ms[name].append((time.monotonic() - since) * 1000)


def _llm(node_id: str, model: str, *content: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "llm", "id": node_id, "model": model, "params": {"max_tokens": 16},
            "messages": [{"role": "user", "content": list(content)}]}


def graph(run_id: str, kind: str) -> dict[str, Any]:
    """The graph of a run of ``kind`` (see the module docstring)."""
    second = "up" if kind == "run" else "fake-model"
    nodes = [_llm("a", "fake-model", {"text": f"{TEXT} ({run_id})"}),
             _llm("b", second, {"text": "and then: "}, {"ref": "a"})]
    if kind == "open":
        return {"id": run_id, "open": True, "nodes": nodes[:1]}
    return {"id": run_id, "nodes": nodes}


class Expected(Exception):
    """The traffic met something it did not expect (its message says what)."""


async def opened(source: EventSource, tally: Tally,
                 since: float) -> AsyncIterator[ServerSentEvent]:
    """The run's events after its first one (read here: ``wf_first_event`` is the time
    from ``since`` to it); :class:`Expected` on another status than 200."""
    if source.response.status_code != 200:
        body = await source.response.aread()
        raise Expected(f"{source.response.status_code}: {body[:300]!r}")
    events = source.aiter_sse()
    try:
        await anext(events)
    except StopAsyncIteration:
        raise Expected("an event stream without events") from None
    tally.took("wf_first_event", since)
    return events


async def finish(events: AsyncIterator[ServerSentEvent]) -> dict[str, Any]:
    """The data of ``run.finished``, read to it."""
    async for sse in events:
        if sse.event == "run.finished":
            data: dict[str, Any] = json.loads(sse.data)
            return data
    raise Expected("the event stream ended before run.finished")


async def status(client: httpx.AsyncClient, method: str, url: str, want: int,
                 **kwargs: Any) -> httpx.Response:
    resp = await client.request(method, url, **kwargs)
    if resp.status_code != want:
        raise Expected(f"{method} {url}: {resp.status_code}, wanted {want}: "
                       f"{resp.content[:300]!r}")
    return resp


async def workflow(client: httpx.AsyncClient, i: int, tally: Tally) -> None:
    """The run of arrival ``i`` (its kind from :data:`MIX`), followed to its end."""
    kind, run_id = MIX[i % len(MIX)], f"run-{i}"
    h = {"Authorization": f"Bearer {TENANT_KEYS[i % len(TENANT_KEYS)]}"}
    t0 = time.monotonic()
    async with aconnect_sse(client, "POST", "/v1/workflows", headers=h,
                            json=graph(run_id, kind)) as source:
        events = await opened(source, tally, t0)
        if kind == "leave":  # the client goes away after the first event ...
            end = None
        elif kind == "cancel":
            async def cancel() -> None:
                await asyncio.sleep((i // len(MIX) % 5) * 0.05)
                await status(client, "DELETE", f"/v1/workflows/{run_id}", 200, headers=h)
            _, end = await asyncio.gather(cancel(), finish(events))
        else:
            if kind == "open":
                await status(client, "POST", f"/v1/workflows/{run_id}/nodes", 200, headers=h,
                             json={"nodes": [_llm("c", "up", {"text": "more"},
                                                  {"ref": "a"})]})
                await status(client, "POST", f"/v1/workflows/{run_id}/close", 200, headers=h)
            end = await finish(events)
    if end is None:  # ... and comes back for the rest, from the second event on
        async with aconnect_sse(client, "GET", f"/v1/workflows/{run_id}/events",
                                params={"after": "1"}, headers=h) as source:
            if source.response.status_code != 200:
                raise Expected(f"following {run_id}: {source.response.status_code}")
            end = await finish(source.aiter_sse())
    tally.ended[end["status"]] += 1
    wanted = ("succeeded", "cancelled") if kind == "cancel" else ("succeeded",)
    if end["status"] not in wanted:
        raise Expected(f"{kind} run {run_id} ended {end['status']}: "
                       f"{json.dumps(end.get('failures'))[:300]}")
    if kind != "cancel":
        tally.took("wf_run", t0)
    if kind == "run":
        await status(client, "GET", f"/v1/workflows/{run_id}", 200, headers=h)


async def chat(client: httpx.AsyncClient, i: int, tally: Tally) -> None:
    """The chat of arrival ``i`` and, every fifth arrival, the other routes."""
    h = {"Authorization": f"Bearer {TENANT_KEYS[i % len(TENANT_KEYS)]}"}
    other = {"Authorization": f"Bearer {TENANT_KEYS[(i + 1) % len(TENANT_KEYS)]}"}
    model, stream = ("up", "fake-model")[i % 4 // 2], i % 2 == 1
    t0 = time.monotonic()
    resp = await status(client, "POST", "/v1/chat/completions", 200, headers={
        **h, "X-Flowlift-Session": f"s-{i}", "X-Flowlift-Workflow": f"w-{i}"}, json={
        "model": model, "stream": stream, "max_tokens": 16,
        "messages": [{"role": "user", "content": f"turn {i} of {model}"}]})
    if stream and not resp.content.rstrip().endswith(b"data: [DONE]"):
        raise Expected(f"chat stream {i} did not end with [DONE]: {resp.content[-200:]!r}")
    tally.took("chat", t0)
    if i % 5:
        return
    await status(client, "POST", "/v1/responses", 200, headers=h,
                 json={"model": "up", "input": f"responses {i}"})
    if model == "fake-model":  # (sessions count the embedded engine's turns)
        await status(client, "GET", f"/v1/sessions/s-{i}", 200, headers=h)
    await status(client, "GET", f"/v1/workflows/run-{i}", 404, headers=other)
    await status(client, "GET", f"/v1/workflows/w-{i}", 404, headers=other)
    await status(client, "GET", "/v1/models", 401,
                 headers={"Authorization": f"Bearer sk-guess-{i}"})


async def arrival(client: httpx.AsyncClient, i: int, tally: Tally, op_timeout_s: float) -> None:
    """Arrival ``i``: its workflow and its chat at once; errors and hangs go to ``tally``
    (never raised: the soak goes on and judges at the end)."""
    async def guarded(what: str, step: Any) -> None:
        try:
            async with asyncio.timeout(op_timeout_s):
                await step(client, i, tally)
        except TimeoutError:
            tally.error(f"{what} {i}: no end within {op_timeout_s:g} s (a hang)")
        except (Expected, httpx.HTTPError) as exc:
            tally.error(f"{what} {i}: {type(exc).__name__}: {exc}")
    tally.started += 1
    await asyncio.gather(guarded("workflow", workflow), guarded("chat", chat))
