"""The Responses API while its store is down (issue 38, item 13): a continuation,
``GET /v1/responses/{id}`` and its input items get 503 ``store_unavailable`` within a
few seconds, as the run routes do, and a stream that has started ends with a terminal
event within that bound. The outage is a store whose response calls block (what the
PostgreSQL store does while it retries a lost database inside each call)."""

from __future__ import annotations

import threading
import time

import pytest

from flowlift.proxy import create_app
from flowlift.proxy.openai.responses import store as responses_store
from flowlift.proxy.openai.responses.store import RESPONSES
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse

BOUND_S = 0.5  # the store's answer bound, shortened for the test (3 s in the proxy)


@pytest.fixture
async def outage(aiohttp_client, monkeypatch):
    """``(client, first response id, down)``: set ``down`` and the store's response
    calls hang until the test ends."""
    monkeypatch.setattr(responses_store, "ANSWER_WITHIN_S", BOUND_S)
    app = create_app({"fake-model": FakeEngine(["fake-model"])})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    first = await client.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
    assert first.status == 200
    down, over = threading.Event(), threading.Event()
    store = app[RESPONSES].runs
    for name in ("get_response", "put_response", "delete_response"):
        real = getattr(store, name)

        def hung(*args, _real=real, **kwargs):
            if down.is_set():
                over.wait(30)  # bounded: released when the test ends
            return _real(*args, **kwargs)

        monkeypatch.setattr(store, name, hung)
    yield client, (await first.json())["id"], down
    over.set()


async def _timed(call):
    t0 = time.monotonic()
    resp = await call
    return resp, time.monotonic() - t0


async def test_continuations_and_reads_get_503_store_unavailable_in_seconds(outage):
    client, rid, down = outage
    down.set()
    for call in (client.post("/v1/responses", json={"model": "fake-model", "input": "more",
                                                    "previous_response_id": rid}),
                 client.get(f"/v1/responses/{rid}"),
                 client.get(f"/v1/responses/{rid}/input_items"),
                 client.delete(f"/v1/responses/{rid}")):
        resp, took = await _timed(call)
        body = await resp.json()
        assert resp.status == 503 and body["error"]["code"] == "store_unavailable", body
        assert resp.headers["Retry-After"] and took < BOUND_S + 2


async def test_a_started_stream_ends_with_a_terminal_event_within_the_bound(outage):
    client, _, down = outage
    down.set()
    resp, took = await _timed(client.post("/v1/responses", json={
        "model": "fake-model", "input": "a new conversation", "stream": True}))
    events = [data for _, data in parse_sse(await resp.text())]
    assert resp.status == 200 and took < BOUND_S + 2
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["error"]["code"] == "store_unavailable"
    assert "response.output_text.delta" in {e["type"] for e in events}  # what was said


async def test_a_whole_answer_that_cannot_be_stored_is_a_503(outage):
    client, _, down = outage
    down.set()
    resp, took = await _timed(client.post("/v1/responses", json={
        "model": "fake-model", "input": "a new conversation"}))
    assert resp.status == 503 and took < BOUND_S + 2
    assert (await resp.json())["error"]["code"] == "store_unavailable"
