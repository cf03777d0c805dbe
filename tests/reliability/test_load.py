"""Load: 1,000 concurrent workflows on a FakeEngine and 500 concurrent chat streams through
the proxy to a fake upstream, on real sockets: zero errors, memory measured before and
after (a second identical burst must not grow it like the first did: a leak grows with
every burst). Over capacity the proxy sheds with 429/503 and ``Retry-After``, never a
crash, a 5xx of its own or a hang. Every burst is bounded in time."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections import Counter, deque
from typing import Any

import aiohttp
import pytest

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine
from tests.reliability.faults import config_for, rss_mib, serve
from tests.upstream_fake import FakeUpstream, chunk, sse_bytes

WORKFLOWS = 1000
STREAMS = 500


def two_step_graph(i: int) -> dict[str, Any]:
    """``a`` then ``b`` reading ``a``: a dependency, so each run waits on its own data."""
    return {"name": f"load-{i}", "nodes": [
        {"kind": "llm", "id": "a", "model": "fake-model", "params": {"max_tokens": 8}, "messages": [
            {"role": "user", "content": [{"text": f"workflow {i} first step please"}]}]},
        {"kind": "llm", "id": "b", "model": "fake-model", "params": {"max_tokens": 8}, "messages": [
            {"role": "user", "content": [{"text": "then "}, {"ref": "a"}]}]}]}


async def run_workflow(session: aiohttp.ClientSession, base: str, i: int) -> str:
    async with session.post(f"{base}/v1/workflows", json=two_step_graph(i)) as resp:
        if resp.status != 200:
            return f"http {resp.status}"
        final = None
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"trace"' in line:
                final = json.loads(line[6:])
        return final["status"] if final else "no final event"


async def run_stream(session: aiohttp.ClientSession, base: str, model: str) -> str:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return f"http {resp.status} retry-after={resp.headers.get('Retry-After')}"
        text = await resp.text()
        return "ok" if text.rstrip().endswith("data: [DONE]") and '"error"' not in text \
            else "broken stream"


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=120))


async def burst(coros: list[Any], timeout_s: float) -> tuple[Counter[str], float]:
    t0 = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*coros), timeout_s)
    return Counter(results), time.monotonic() - t0


@pytest.mark.timeout(240)
async def test_1000_concurrent_workflows_all_succeed_in_bounded_memory(aiohttp_server, capsys):
    """Three bursts of 1,000 concurrent two-step workflows: every run succeeds; RSS of
    this process (proxy and clients) before and after each burst."""
    engine = FakeEngine(["fake-model"], max_running=64)
    engine.requests = deque(maxlen=64)  # type: ignore[assignment]  # not what is measured
    app = create_app({"fake-model": engine}, ProxyConfig(max_concurrency=64))
    server = await aiohttp_server(app)
    await app[STATE].ready.wait()
    base = str(server.make_url("")).rstrip("/")
    figures = []
    async with session() as s:
        for round_ in range(3):
            gc.collect()
            before = rss_mib()
            counts, took = await burst([run_workflow(s, base, i + round_ * WORKFLOWS)
                                        for i in range(WORKFLOWS)], 180)
            gc.collect()
            figures.append((before, rss_mib(), took))
            assert counts == {"succeeded": WORKFLOWS}, counts
    state = app[STATE]
    assert not state.runs.active
    assert len(state.runs.finished) <= 1024 and engine.running() == 0
    with capsys.disabled():
        print("\n1000 concurrent workflows, 3 bursts: " + "; ".join(
            f"{t:.1f} s, RSS {b:.0f} -> {a:.0f} MiB" for b, a, t in figures))
    # The first two bursts fill the table of finished runs (1,024 kept); after that only
    # the store grows, ~3 MiB per 1,000 runs until its bound (10,000 runs)
    (b0, a0, _), _, (b2, a2, _) = figures
    assert a2 - b2 <= 0.25 * (a0 - b0) + 10, figures


@pytest.mark.timeout(240)
async def test_500_concurrent_chat_streams_through_the_proxy(aiohttp_server, capsys):
    events = [chunk({"content": f"w{i} "}) for i in range(6)] + [chunk({}, "stop")]
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(*events), gap_s=0.01)])
    fake.received = deque(maxlen=64)  # type: ignore[assignment]
    engine = FakeEngine(["fake-model"], delay_s=0.005)
    engine.requests = deque(maxlen=64)  # type: ignore[assignment]
    (url,) = await serve(aiohttp_server, [fake.app()])
    app = create_app({"fake-model": engine},
                     ProxyConfig(max_concurrency=64, max_queue=STREAMS),
                     file_config=parse_config(config_for({"up": {"backends": ["b0"]}},
                                                         {"b0": url},
                                                         max_connections=STREAMS)))
    server = await aiohttp_server(app)
    await app[STATE].ready.wait()
    base = str(server.make_url("")).rstrip("/")
    figures = []
    async with session() as s:
        for model in ("up", "up", "fake-model"):
            gc.collect()
            before = rss_mib()
            counts, took = await burst([run_stream(s, base, model) for _ in range(STREAMS)],
                                       120)
            gc.collect()
            figures.append((model, before, rss_mib(), took))
            assert counts == {"ok": STREAMS}, (model, counts)
    assert app[STATE].backends.upstreams["b0"].health.in_flight == 0
    with capsys.disabled():
        print("\n500 streams: " + "; ".join(f"{m} {t:.1f} s RSS {b:.0f} -> {a:.0f} MiB"
                                            for m, b, a, t in figures))
    (_, b0, a0, _), (_, b1, a1, _), _ = figures
    assert a1 - b1 <= max(0.5 * (a0 - b0), 0) + 25, figures


@pytest.mark.timeout(120)
async def test_over_capacity_sheds_with_retry_after_never_a_crash_or_a_hang(aiohttp_server):
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "a"}),
                                                       chunk({}, "stop")), first_delay_s=0.3)])
    (url,) = await serve(aiohttp_server, [fake.app()])
    app = create_app({"fake-model": FakeEngine(["fake-model"], delay_s=0.02)},
                     ProxyConfig(max_concurrency=4, max_queue=16),
                     file_config=parse_config(config_for({"up": {"backends": ["b0"]}},
                                                         {"b0": url}, max_connections=16)))
    server = await aiohttp_server(app)
    await app[STATE].ready.wait()
    base = str(server.make_url("")).rstrip("/")
    async with session() as s:
        for model, admitted in (("up", 16), ("fake-model", 4 + 16)):
            counts, _ = await burst([run_stream(s, base, model) for _ in range(STREAMS)],
                                    60)
            assert counts["ok"] >= admitted, (model, counts)
            shed = {k: v for k, v in counts.items() if k != "ok"}
            assert set(shed) == {"http 429 retry-after=1"}, (model, counts)
        # and once the burst is over, full service again
        counts, _ = await burst([run_stream(s, base, "up") for _ in range(16)], 30)
        assert counts == {"ok": 16}
    assert app[STATE].backends.upstreams["b0"].health.in_flight == 0


@pytest.mark.timeout(120)
async def test_workflows_past_max_runs_get_429_with_retry_after_and_the_rest_finish(
        aiohttp_server):
    """Found by this suite: nothing bounded the runs a proxy took at once (every POST
    /v1/workflows was admitted and queued). ``--max-runs`` now sheds the excess."""
    engine = FakeEngine(["fake-model"], delay_s=0.01, max_running=8)
    app = create_app({"fake-model": engine}, ProxyConfig(max_concurrency=8, max_runs=50))
    server = await aiohttp_server(app)
    await app[STATE].ready.wait()
    base = str(server.make_url("")).rstrip("/")
    async with session() as s:
        counts, _ = await burst([run_workflow(s, base, i) for i in range(300)], 90)
        assert counts["succeeded"] >= 50 and counts["succeeded"] + counts["http 429"] == 300
        async with s.post(f"{base}/v1/workflows", json=two_step_graph(0)) as resp:
            assert resp.status == 200  # capacity is back once the burst is done
            await resp.read()
        slow = [asyncio.create_task(run_workflow(s, base, i)) for i in range(50)]
        while len(app[STATE].runs.active) < 50:
            await asyncio.sleep(0.01)
        async with s.post(f"{base}/v1/workflows", json=two_step_graph(1)) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            err = (await resp.json())["error"]
            assert err["code"] == "rate_limit_exceeded" and "--max-runs" in err["message"]
        assert Counter(await asyncio.gather(*slow)) == {"succeeded": 50}
