"""The proxy's own overhead per OpenAI request (issue 18 item 6): the
``x-flowlift-overhead-ms`` response header and the ``flowlift_proxy_overhead_seconds``
histogram report handling time minus the wait on the upstream or engine, so a slow
upstream or engine does not show up in them."""

from __future__ import annotations

import asyncio
import time

from prometheus_client.parser import text_string_to_metric_families

from flowlift.proxy import create_app
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes, upstream_only_proxy

HEADER = "x-flowlift-overhead-ms"
UPSTREAM_DELAY_S = 0.3
CHAT = {"model": "up", "messages": [{"role": "user", "content": "hi"}]}


def slow_json(delay_s: float):
    async def answer(request):
        await asyncio.sleep(delay_s)
        return await FakeUpstream.json(chat_json())(request)
    return answer


async def overhead_samples(client) -> dict[tuple[str, str], tuple[float, float]]:
    """(count, sum in seconds) of the overhead histogram by (operation, stream)."""
    resp = await client.get("/metrics")
    out: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(await resp.text()):
        if family.name != "flowlift_proxy_overhead_seconds":
            continue
        for s in family.samples:
            key = (s.labels.get("operation", ""), s.labels.get("stream", ""))
            if s.name.endswith("_count"):
                out.setdefault(key, [0.0, 0.0])[0] = s.value
            elif s.name.endswith("_sum"):
                out.setdefault(key, [0.0, 0.0])[1] = s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


async def test_a_slow_upstreams_wait_is_not_overhead(aiohttp_client, aiohttp_server):
    fake = FakeUpstream([slow_json(UPSTREAM_DELAY_S)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=CHAT)
    await resp.read()
    total_ms = (time.monotonic() - t0) * 1000
    assert resp.status == 200 and total_ms >= UPSTREAM_DELAY_S * 1000
    overhead_ms = float(resp.headers[HEADER])
    # the proxy's own work is a fraction of the upstream's 300 ms, never above the total
    assert 0 < overhead_ms < UPSTREAM_DELAY_S * 1000 / 2
    got = await overhead_samples(client)
    count, sum_s = got[("chat", "false")]
    assert count == 1
    assert abs(sum_s * 1000 - overhead_ms) < 0.01  # one figure: the header's


async def test_a_streams_header_counts_to_its_first_byte_its_histogram_to_its_end(
        aiohttp_client, aiohttp_server):
    pieces = sse_bytes(chunk({"role": "assistant", "content": "a"}), chunk({"content": "b"}),
                       chunk(finish="stop"))
    gap_s = 0.1
    fake = FakeUpstream([FakeUpstream.stream(pieces, first_delay_s=UPSTREAM_DELAY_S,
                                             gap_s=gap_s)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    body = await resp.read()
    total_s = time.monotonic() - t0
    assert resp.status == 200 and body.rstrip().endswith(b"[DONE]")
    waited_s = UPSTREAM_DELAY_S + gap_s * (len(pieces) - 1)
    assert total_s >= waited_s
    assert 0 < float(resp.headers[HEADER]) < UPSTREAM_DELAY_S * 1000 / 2
    count, sum_s = (await overhead_samples(client))[("chat", "true")]
    assert count == 1
    # the whole stream's overhead leaves out the first event's wait and the gaps
    assert 0 < sum_s < min(total_s - waited_s + 0.05, waited_s / 2)


async def test_an_engines_time_is_not_overhead(aiohttp_client):
    app = create_app({"fake-model": FakeEngine(["fake-model"], delay_s=0.05)})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json={
        **CHAT, "model": "fake-model", "max_tokens": 6})
    await resp.read()
    total_ms = (time.monotonic() - t0) * 1000
    assert resp.status == 200 and total_ms >= 100  # >= 2 chunks of 50 ms
    assert 0 < float(resp.headers[HEADER]) < total_ms / 2
    count, sum_s = (await overhead_samples(client))[("chat", "false")]
    assert count == 1 and sum_s * 1000 < total_ms / 2


async def test_errors_carry_the_header_and_other_paths_do_not(aiohttp_client, aiohttp_server):
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server,
                                       FakeUpstream([FakeUpstream.json(chat_json())]))
    resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert resp.status == 404 and float(resp.headers[HEADER]) >= 0
    assert HEADER not in (await client.get("/v1/models")).headers
    assert HEADER not in (await client.get("/healthz")).headers


def test_serve_runs_on_uvloop_unless_asked_not_to():
    import uvloop

    from flowlift.proxy.lifecycle import event_loop_factory, run

    assert event_loop_factory({}) is uvloop.new_event_loop
    assert event_loop_factory({"FLOWLIFT_EVENT_LOOP": "asyncio"}) is None

    async def loop_type() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_type()).startswith("uvloop")


def test_request_spans_are_built_only_where_they_are_exported(tmp_path):
    from flowlift.tracing.spans import exports, proxy_tracer_provider

    assert not exports(proxy_tracer_provider(None, env={}))
    provider = proxy_tracer_provider(tmp_path, env={})  # JSON lines there
    try:
        assert exports(provider)
    finally:
        provider.shutdown()
