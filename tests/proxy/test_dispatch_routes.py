"""Routes that mix an upstream backend with the embedded engine: a workflow step (or a
drop-in request) that lands on the embedded engine is admitted through its priority
slots, whichever way the route got there, and its engine stream ends with the run."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse

CONFIG = {
    "backends": {"local": {"kind": "embedded"},
                 "up": {"kind": "openai", "base_url": "http://up.invalid/v1"}},
    "models": {"up-first": {"backends": ["up"], "fallbacks": ["local"]},
               "local-first": {"backends": ["local"], "fallbacks": ["up"]}}}


def _upstream_down(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, json={"error": {"message": "overloaded", "type": "server"}})


class Proxy:
    """A proxy with a FakeEngine and a MockTransport upstream; records, for every
    generation the engine starts, the embedded slots it found in use."""

    def __init__(self, *, delay_s: float = 0.0, capacity: int = 2,
                 upstream_up: bool = False) -> None:
        self.upstream_up = upstream_up
        self.seen: list[tuple[str, int, int]] = []  # (request id, in_use, batch_in_use)
        self.acquired: list[Priority] = []
        self.engine = FakeEngine(["fake-model"], delay_s=delay_s, responder=self._respond)
        self.upstream_requests: list[httpx.Request] = []
        self.app = create_app({"fake-model": self.engine},
                              ProxyConfig(max_concurrency=capacity),
                              file_config=parse_config(CONFIG),
                              transport=httpx.MockTransport(self._upstream))
        self.slots = self.app[STATE].backends.resolve("fake-model")[1].slots
        acquire = self.slots.acquire

        async def spy(priority: Priority, prefill_tokens: int = 0,
                      resumed: bool = False) -> Priority:
            self.acquired.append(priority)
            return await acquire(priority, prefill_tokens, resumed)
        self.slots.acquire = spy  # type: ignore[method-assign]

    def _respond(self, request: GenerationRequest) -> str:
        self.seen.append((request.request_id, self.slots.in_use, self.slots.batch_in_use))
        return "word " * 40

    def _upstream(self, request: httpx.Request) -> httpx.Response:
        self.upstream_requests.append(request)
        if not self.upstream_up:
            return _upstream_down(request)
        events = [{"choices": [{"index": 0, "delta": {"content": "from upstream"}}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        return httpx.Response(200, content=body + b"data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})


def _graph(model: str, n: int, workflow_class: str = "interactive") -> dict:
    return {"class": workflow_class, "nodes": [
        {"kind": "llm", "id": f"s{i}", "model": model,
         "messages": [{"role": "user", "content": [{"text": f"question number {i}"}]}]}
        for i in range(n)]}


@pytest.mark.parametrize("model", ["up-first", "local-first"])
async def test_a_workflow_step_on_a_mixed_route_is_admitted_through_the_embedded_slots(
        aiohttp_client, model):
    proxy = Proxy()
    client = await aiohttp_client(proxy.app)
    await proxy.app[STATE].ready.wait()
    events = parse_sse(await (await client.post("/v1/workflows",
                                                json=_graph(model, 3, "batch"))).text())
    assert events[-1][1]["status"] == "succeeded", events[-1]
    assert len(proxy.seen) == 3
    # every generation ran inside a granted embedded slot, and the batch class cap held:
    # capacity 2 with one slot reserved for interactive work leaves batch steps one
    assert all(in_use == 1 and batch == 1 for _, in_use, batch in proxy.seen), proxy.seen
    assert len(proxy.acquired) == 3 and not any(p.interactive for p in proxy.acquired)
    assert proxy.slots.in_use == 0 and proxy.slots.batch_in_use == 0
    if model == "up-first":  # the upstream was tried first, failed, and fell back
        assert proxy.upstream_requests
        trace = {r["step_id"]: r for r in events[-1][1]["trace"] if r.get("step_id")}
        assert all(len(trace[f"s{i}"]["attempts"]) == 1 for i in range(3))
    else:
        assert not proxy.upstream_requests


@pytest.mark.parametrize("model", ["up-first", "local-first"])
async def test_cancelling_a_run_on_a_mixed_route_closes_the_engine_stream_and_its_slot(
        aiohttp_client, model):
    proxy = Proxy(delay_s=0.05)
    client = await aiohttp_client(proxy.app)
    await proxy.app[STATE].ready.wait()
    graph = {**_graph(model, 1), "id": f"wf-cancel-{model}"}
    posted = asyncio.ensure_future(client.post("/v1/workflows", json=graph))
    for _ in range(200):
        if proxy.engine.running() == 1:
            break
        await asyncio.sleep(0.01)
    assert proxy.engine.running() == 1 and proxy.slots.in_use == 1
    assert (await client.delete(f"/v1/workflows/{graph['id']}")).status == 200
    events = parse_sse(await (await posted).text())
    assert events[-1][1]["status"] == "cancelled"
    # closed by the run's cancellation itself, not later by a garbage collector
    assert proxy.engine.aborted == [f"{graph['id']}:s0:1"]
    assert proxy.engine.running() == 0 and proxy.slots.in_use == 0
    assert proxy.slots.queued == 0


@pytest.mark.parametrize("model", ["up-first", "local-first"])
async def test_a_drop_in_request_on_a_mixed_route_takes_the_embedded_slots(aiohttp_client,
                                                                            model):
    proxy = Proxy()
    client = await aiohttp_client(proxy.app)
    await proxy.app[STATE].ready.wait()
    resp = await client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200, await resp.text()
    body = json.loads(await resp.text())
    assert body["choices"][0]["message"]["content"].startswith("word")
    assert len(proxy.seen) == 1 and proxy.seen[0][1] == 1
    assert len(proxy.acquired) == 1 and proxy.slots.in_use == 0


async def test_a_healthy_upstream_replica_takes_the_step_through_the_route_pool(
        aiohttp_client):
    proxy = Proxy(upstream_up=True)
    client = await aiohttp_client(proxy.app)
    state = proxy.app[STATE]
    await state.ready.wait()
    pool = state.backends.pool(state.backends.route("up-first"))
    assert pool is not None
    acquired: list[Priority] = []
    acquire = pool.slots.acquire

    async def spy(priority: Priority, prefill_tokens: int = 0,
                  resumed: bool = False) -> Priority:
        acquired.append(priority)
        return await acquire(priority, prefill_tokens, resumed)
    pool.slots.acquire = spy  # type: ignore[method-assign]
    events = parse_sse(await (await client.post("/v1/workflows",
                                                json=_graph("up-first", 2))).text())
    values = {d["step_id"]: d["value"] for e, d in events if e == "step.finished"}
    assert values == {"s0": "from upstream", "s1": "from upstream"}
    assert len(acquired) == 2 and not proxy.acquired and not proxy.seen
    assert pool.slots.in_use == 0 and state.backends.upstreams["up"].health.in_flight == 0


def test_an_upstream_call_is_counted_in_and_out_once_and_records_its_outcome():
    from flowlift.proxy.dispatch.upstream.health import Health

    health = Health(failures_to_cool=2, cooldown_s=10)
    call = health.call()
    assert health.in_flight == 1
    call.failed("down")
    call.close()
    call.close()
    assert health.in_flight == 0 and health.consecutive_failures == 1
    health.call().succeeded()
    assert health.consecutive_failures == 0 and health.in_flight == 1
