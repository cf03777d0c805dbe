"""Drop-in tracing is fetched once, where the request is dispatched, and handed to the
sites that note the answer (issue 33, item 4): the forwarder, a forwarded stream, the
embedded engine's streams, the Responses API served here. Each traced request reads
the current trace exactly once, and its span still gets what those sites note."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from flowlift.proxy import create_app
from flowlift.proxy.state import STATE
from flowlift.proxy.telemetry import requests as request_tracing
from flowlift.testing import FakeEngine, capture_spans
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes, upstream_only_proxy

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


@pytest.fixture
def fetches(monkeypatch) -> list[int]:
    """One entry per call of :func:`request_tracing.current` (every site calls it through
    the module)."""
    calls: list[int] = []
    real = request_tracing.current

    def counting() -> Any:
        calls.append(1)
        return real()
    monkeypatch.setattr(request_tracing, "current", counting)
    return calls


async def _span(captured: Any, name: str, timeout_s: float = 3.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not captured.named(name):
        assert time.monotonic() < deadline, f"no span {name!r}"
        await asyncio.sleep(0.01)
    return captured.named(name)[-1]


async def test_a_local_drop_in_request_reads_its_trace_once(aiohttp_client, fetches):
    with capture_spans() as captured:
        engine = FakeEngine(["fake-model"])
        app = create_app({"fake-model": engine})
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        for body, path in (({**CHAT, "stream": True}, "/v1/chat/completions"),
                           (CHAT, "/v1/chat/completions"),
                           ({"model": "fake-model", "prompt": "a b c", "n": 2},
                            "/v1/completions")):
            fetches.clear()
            resp = await client.post(path, json=body)
            assert resp.status == 200, await resp.text()
            await resp.read()
            assert len(fetches) == 1, path
        span = await _span(captured, "text_completion fake-model")
        # the engine's streams noted the slot and the chunks on the trace handed down
        assert span.attributes["gen_ai.usage.output_tokens"] > 0
        assert {"flowlift.queue_ms", "flowlift.prefill_ms"} <= set(span.attributes)


async def test_the_responses_api_served_here_reads_its_trace_once(aiohttp_client, fetches):
    with capture_spans() as captured:
        app = create_app({"fake-model": FakeEngine(["fake-model"])})
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        resp = await client.post("/v1/responses", json={"model": "fake-model",
                                                        "input": "hello there"})
        assert resp.status == 200, await resp.text()
        assert len(fetches) == 1
        span = await _span(captured, "chat fake-model")  # the turn names its model
        assert "flowlift.prefill_ms" in span.attributes  # the engine's slot and chunks


async def test_a_forwarded_drop_in_request_reads_its_trace_once(
        aiohttp_client, aiohttp_server, fetches):
    pieces = sse_bytes(*[chunk({"content": f"w{i} "}) for i in range(3)], chunk({}, "stop"),
                       {**chunk(), "choices": [], "usage": USAGE})
    fake = FakeUpstream([FakeUpstream.stream(pieces), FakeUpstream.json(chat_json())])
    with capture_spans() as captured:
        client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
        fetches.clear()
        resp = await client.post("/v1/chat/completions",
                                 json={**CHAT, "model": "up", "stream": True})
        assert (await resp.text()).rstrip().endswith("data: [DONE]")
        assert len(fetches) == 1
        span = await _span(captured, "chat up")
        # the forwarded stream noted its events and usage on the trace handed down
        assert span.attributes["flowlift.stream.events"] == 6
        assert span.attributes["gen_ai.usage.output_tokens"] == 3
        fetches.clear()
        resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "up"})
        assert resp.status == 200 and len(fetches) == 1
    sent = fake.received[0].headers["traceparent"].split("-")
    assert int(sent[2], 16) == span.context.span_id  # the proxy's span is the parent
