"""The replica choice's belief about each replica's prefix cache comes from what the
replica reports (``usage.prompt_tokens_details.cached_tokens``), not from what was sent
(issue 37 item 3): the TTFT model learns the tokens that really were uncached, a replica
that hits less than expected is believed to hold less, and one that lost its cache (a
restart) is believed to hold nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx

from flowlift.local_engine.base import ChatMessage, GenerationRequest, SamplingOptions
from flowlift.proxy.config import parse_config
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.routing.latency import (
    RESTART_MIN_TOKENS,
    CacheReport,
    Demand,
    Features,
    LatencyBook,
)
from flowlift.proxy.dispatch.upstream.attempts import Timing
from flowlift.proxy.dispatch.upstream.engine import UpstreamEngine
from flowlift.proxy.state import STATE
from tests.upstream_fake import FakeUpstream, chunk, sse_bytes, upstream_only_proxy

SESSION = Demand(prompt_tokens=2000, affinity="run-1")


def test_a_report_is_read_only_where_the_replica_gives_one():
    assert CacheReport.of({"prompt_tokens": 100, "prompt_tokens_details": {
        "cached_tokens": 64}}) == CacheReport(100, 64)
    assert CacheReport.of({"input_tokens": 10, "input_tokens_details": {
        "cached_tokens": 0}}) == CacheReport(10, 0)
    # vLLM without --enable-prompt-tokens-details: nothing is known of the cache
    assert CacheReport.of({"prompt_tokens": 100, "completion_tokens": 3}) is None
    assert CacheReport.of({"prompt_tokens": 0, "prompt_tokens_details": {
        "cached_tokens": 0}}) is None
    assert CacheReport.of(None) is None


def test_without_a_report_the_prompt_sent_is_believed_cached():
    book = LatencyBook()
    book.sent("r0", "run-1", 1000)
    assert book.features("r0", SESSION, 0).cached_tokens == 1000


def test_a_replica_that_hits_less_than_expected_is_believed_to_hold_less():
    book = LatencyBook()
    book.sent("r0", "run-1", 1000)
    # the next turn expected 1000 of its 2000 tokens cached; the replica served 250
    book.sent("r0", "run-1", 2000, expected_cached=1000, report=CacheReport(2000, 250))
    retention = book.replicas["r0"].retention
    assert 0.0 < retention < 1.0  # moved toward 0.25 of the expected hit
    assert book.features("r0", SESSION, 0).cached_tokens == round(2000 * retention)
    # a replica that serves what was expected keeps being believed
    book.sent("r1", "run-1", 1000)
    book.sent("r1", "run-1", 2000, expected_cached=1000, report=CacheReport(2000, 1000))
    assert book.replicas["r1"].retention == 1.0


def test_a_replica_that_lost_its_cache_is_believed_to_hold_nothing():
    book = LatencyBook()
    for key in ("run-1", "run-2"):
        book.sent("r0", key, 1000)
    # run-1's next turn expected 1000 cached tokens and got none: the replica restarted
    book.sent("r0", "run-1", 1200, expected_cached=1000, report=CacheReport(1200, 0))
    assert book.features("r0", Demand(1500, affinity="run-2"), 0).cached_tokens == 0
    # this answer's own prompt is in the fresh cache now
    assert book.features("r0", Demand(1500, affinity="run-1"), 0).cached_tokens == 1200
    assert book.replicas["r0"].retention == 1.0  # a restart says nothing of retention


def test_a_small_expected_hit_that_misses_is_no_restart():
    book = LatencyBook()
    book.sent("r0", "run-2", 1000)
    book.sent("r0", "run-1", 40, expected_cached=RESTART_MIN_TOKENS - 1,
              report=CacheReport(40, 0))
    assert book.features("r0", Demand(1500, affinity="run-2"), 0).cached_tokens == 1000


def test_the_ttft_model_learns_the_uncached_tokens_the_replica_reported():
    book = LatencyBook()
    believed = Features(in_flight=0, prompt_tokens=2000, cached_tokens=2000)
    timing = Timing(book, "m", SESSION, believed, started=0.0, first_at=0.5)
    timing.done("r0", 10, streamed=True, cache=CacheReport(4000, 1000))
    # x = (1, in flight, uncached thousands): learned at 1500 uncached tokens (3/4 of
    # the prompt, as reported), not at the 0 believed; y = the 0.5 s TTFT
    assert book.replicas["r0"].ttft.xty[2] == 1.5 * 0.5


def _sse(cached: int) -> httpx.Response:
    usage = {"prompt_tokens": 50, "completion_tokens": 1,
             "prompt_tokens_details": {"cached_tokens": cached}}
    events = [{"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": usage}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return httpx.Response(200, content=body + b"data: [DONE]\n\n",
                          headers={"content-type": "text/event-stream"})


async def test_a_steps_answer_reports_its_cache_to_the_replica_choice():
    answers = iter([0, 0])

    def handler(request: httpx.Request) -> httpx.Response:
        return _sse(next(answers))

    config: dict[str, Any] = {
        "backends": {f"r{i}": {"kind": "openai", "base_url": f"http://r{i}.invalid/v1"}
                     for i in range(2)},
        "models": {"m": {"backends": ["r0", "r1"]}}}
    backends = Backends({}, config=parse_config(config),
                        transport=httpx.MockTransport(handler))
    engine = UpstreamEngine(backends, backends.route("m"))
    long = "x" * 4000  # ~1000 estimated tokens: a sizeable expected hit
    try:
        for turn in range(2):
            request = GenerationRequest(
                request_id=f"run-1:s:{turn}", model="m", session_id="run-1",
                messages=(ChatMessage("user", long),),
                sampling=SamplingOptions(max_tokens=4))
            async for _ in engine.generate(request):
                pass
            if turn == 0:  # another session believed cached on the same replica
                [name] = list(backends.latency.replicas)
                backends.latency.sent(name, "run-2", 900)
        book = backends.latency
        # turn 2 expected turn 1's prompt cached there and the replica reported none:
        # it lost its cache (a restart), so run-2's prefix is no longer believed there
        assert dict(book.replicas[name].prefixes) == {"run-1": 1000}
        assert book.replicas[name].ttft.weight > 0
    finally:
        await backends.aclose()


async def test_a_forwarded_streams_usage_reports_its_cache(aiohttp_client, aiohttp_server):
    """Drop-in streams: the usage event the proxy passes on (or strips) is read for the
    replica choice too."""
    usage = {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001,
             "prompt_tokens_details": {"cached_tokens": 0}}
    stream = FakeUpstream.stream(sse_bytes(chunk({"role": "assistant", "content": "ok"}),
                                           chunk(finish="stop"),
                                           {**chunk(), "choices": [], "usage": usage}))
    fakes = [FakeUpstream([stream]) for _ in range(2)]
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, *fakes)
    book = client.app[STATE].backends.latency
    for turn in range(2):
        resp = await client.post("/v1/chat/completions", json={
            "model": "up", "stream": True,
            "messages": [{"role": "user", "content": "x" * 4000}]},
            headers={"X-Flowlift-Session": "run-1"})
        assert resp.status == 200
        await resp.read()
        if turn == 0:
            [name] = [n for n, r in book.replicas.items() if r.prefixes]
            book.sent(name, "run-2", 900)  # another session believed cached there
    # the second turn expected the first's prompt there, and the replica reported none
    assert "run-2" not in book.replicas[name].prefixes
