"""Regression tests for cases N1 and N2 of ``shared/cases``: work ends with its client.
A client that leaves (before the first byte, mid-body, or by cancelling its run) closes
the upstream connection within ~200 ms and aborts the engine request once; nothing that
depended on it starts. (The other N cases: ``tests/proxy/test_cases_n.py``.)"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp import web

from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse
from tests.proxy.test_cases_n import MESSAGES, _step, stream_answer
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes


# -- N1: the client leaves, the upstream stops -------------------------------------------
class Holding:
    """An upstream that holds each ``hold`` request up to ``hold_s`` (after writing
    ``first``, when given) and notes when the proxy closed its connection; any other
    prompt is answered at once."""

    def __init__(self, hold_s: float = 10.0, first: bytes | None = None) -> None:
        self.hold_s, self.first = hold_s, first
        self.closed_at: list[float] = []

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if "hold" not in json.dumps(body.get("messages")):
            return await stream_answer("quick")(request) if body.get("stream") else \
                await FakeUpstream.json(chat_json("quick"))(request)
        resp = None
        if self.first is not None:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(self.first)
        t_end = time.monotonic() + self.hold_s
        try:
            while time.monotonic() < t_end:
                if request.transport is None or request.transport.is_closing():
                    break
                await asyncio.sleep(0.005)
            else:
                return resp or web.Response(status=204)
        except asyncio.CancelledError:  # aiohttp cancels a handler whose client left
            self.closed_at.append(time.monotonic())
            raise
        self.closed_at.append(time.monotonic())
        return resp or web.Response(status=204)


HOLD = [{"role": "user", "content": "hold"}]


async def _closed_soon(holding: Holding, left: float) -> None:
    """The upstream saw its connection closed within 0.3 s of the client leaving at
    ``left`` (waited for up to 1 s)."""
    for _ in range(100):
        if holding.closed_at:
            break
        await asyncio.sleep(0.01)
    assert holding.closed_at and holding.closed_at[0] - left < 0.3, holding.closed_at


async def _cancelling_proxy(aiohttp_client: Any, aiohttp_server: Any, holding: Holding) -> Any:
    fake = FakeUpstream([holding])
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    app = create_app({}, file_config=parse_config({
        "backends": {"r0": {"kind": "openai", "base_url": url}},
        "models": {"up": {"backends": ["r0"]}}}))
    # as `flowlift serve` runs it (proxy/lifecycle.py): a client that leaves cancels
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    await app[STATE].ready.wait()
    return client


@pytest.mark.parametrize("stream", [False, True])
async def test_N1_client_leaves_before_the_first_byte_upstream_stops(
        aiohttp_client, aiohttp_server, capsys, stream):
    holding = Holding()
    client = await _cancelling_proxy(aiohttp_client, aiohttp_server, holding)
    asking = asyncio.create_task(client.post("/v1/chat/completions", json={
        "model": "up", "messages": HOLD, "stream": stream}))
    await asyncio.sleep(1.0)
    asking.cancel()
    await _closed_soon(holding, time.monotonic())
    await asyncio.sleep(0.05)
    assert "request_cancelled_by_client" in capsys.readouterr().out
    after = await client.post("/v1/chat/completions", json={"model": "up",
                                                            "messages": MESSAGES})
    assert after.status == 200 and client.app[STATE].backends.upstreams[
        "r0"].health.in_flight == 0


async def test_N1_client_leaves_mid_body_upstream_stops(aiohttp_client, aiohttp_server,
                                                        capsys):
    holding = Holding(first=sse_bytes(chunk({"content": "partial"}), done=False)[0])
    client = await _cancelling_proxy(aiohttp_client, aiohttp_server, holding)
    resp = await client.post("/v1/chat/completions", json={"model": "up", "messages": HOLD,
                                                           "stream": True})
    assert b"partial" in await resp.content.readline()
    await asyncio.sleep(1.0)
    resp.close()
    await _closed_soon(holding, time.monotonic())
    await asyncio.sleep(0.05)
    assert "request_cancelled_by_client" in capsys.readouterr().out
    after = await client.post("/v1/chat/completions", json={"model": "up",
                                                            "messages": MESSAGES})
    assert after.status == 200


async def test_N1_cancelling_a_run_stops_its_in_flight_upstream_step(aiohttp_client,
                                                                     aiohttp_server):
    holding = Holding()
    client = await _cancelling_proxy(aiohttp_client, aiohttp_server, holding)
    graph = {"id": "wf-n1", "nodes": [_step("a", "hold")]}
    following = asyncio.create_task(client.post("/v1/workflows", json=graph))
    await asyncio.sleep(1.0)
    cancelled = await client.delete("/v1/workflows/wf-n1")
    left = time.monotonic()
    assert cancelled.status == 200
    for _ in range(100):
        if holding.closed_at:
            break
        await asyncio.sleep(0.01)
    assert holding.closed_at and holding.closed_at[0] - left < 0.3, holding.closed_at
    events = parse_sse(await (await following).text())
    assert events[-1][1]["status"] == "cancelled"


# -- N2: engine work ends with its client ----------------------------------------------
LONG = " ".join(f"w{i}" for i in range(2000))


async def _engine_proxy(aiohttp_client: Any) -> tuple[Any, FakeEngine]:
    engine = FakeEngine(["fake-model"], delay_s=0.01, chunk_chars=3,
                        responder=lambda request: LONG)
    app = create_app({"fake-model": engine})
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    await app[STATE].ready.wait()
    return client, engine


async def _settled(engine: FakeEngine) -> None:
    for _ in range(100):
        if engine.running() == 0 and engine.aborted:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)  # and nothing more comes


async def test_N2_a_client_leaving_mid_stream_aborts_the_engine_request_once(aiohttp_client):
    client, engine = await _engine_proxy(aiohttp_client)
    resp = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "stream": True, "messages": MESSAGES})
    got = b""
    while got.count(b"data:") < 20:
        got += await resp.content.readany()
    resp.close()
    await _settled(engine)
    assert engine.running() == 0 and len(engine.aborted) == 1
    assert engine.aborted == [engine.requests[0].request_id]


async def test_N2_a_client_leaving_a_whole_answer_aborts_the_engine_request_once(
        aiohttp_client):
    client, engine = await _engine_proxy(aiohttp_client)
    asking = asyncio.create_task(client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": MESSAGES}))
    await asyncio.sleep(0.25)  # ~20 chunks in
    asking.cancel()
    await _settled(engine)
    assert engine.running() == 0 and len(engine.aborted) == 1


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_N2_a_cancelled_or_late_run_aborts_its_step_once_and_starts_no_dependent(
        aiohttp_client, how):
    client, engine = await _engine_proxy(aiohttp_client)
    first = {"kind": "llm", "id": "a", "messages": [{"role": "user",
                                                     "content": [{"text": "long"}]}]}
    then = {"kind": "llm", "id": "b", "messages": [{"role": "user", "content": [
        {"text": "after "}, {"ref": "a", "path": []}]}]}
    graph = {"id": f"wf-n2-{how}", "nodes": [first, then]}
    if how == "deadline":
        graph["deadline_s"] = 0.25
    following = asyncio.create_task(client.post("/v1/workflows", json=graph))
    if how == "cancel":
        await asyncio.sleep(0.25)
        assert (await client.delete(f"/v1/workflows/wf-n2-{how}")).status == 200
    events = parse_sse(await (await following).text())
    await _settled(engine)
    assert engine.running() == 0 and len(engine.aborted) == 1
    assert [r.request_id for r in engine.requests] == [f"wf-n2-{how}:a:1"]  # b never started
    assert events[-1][1]["status"] in ("cancelled", "failed")
