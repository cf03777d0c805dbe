"""The second round of cuts on the drop-in path (issue 28 item 5): a forwarded stream's
ordinary events tested once, the upstream ``traceparent`` of a span that records nothing
written without OpenTelemetry's propagator. What each one must keep is asserted beside
what it no longer does."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from flowlift.proxy.dispatch.upstream import forward
from flowlift.proxy.telemetry import requests as request_tracing
from flowlift.proxy.telemetry.requests import RequestTrace
from flowlift.proxy.wire import sse_bytes
from flowlift.proxy.wire.sse_bytes import finished, has_error, without_usage
from tests.upstream_fake import FakeUpstream, chat_json, chunk, upstream_only_proxy

CHAT = {"model": "up", "messages": [{"role": "user", "content": "hello there"}]}
CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _event(doc: object) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
ORDINARY = [_event(chunk({"content": "a"})), _event(chunk({"role": "assistant"})),
            _event(chunk({"content": "b"})) + _event(chunk({"content": "c"})),
            b": keep-alive\n\n", b"data: {\"status\": \"in_progress\"}\r\n\r\n"]
SPECIAL = [b"data: [DONE]\n\n", _event(chunk({}, "stop", usage=USAGE)),
           _event({**chunk(), "choices": [], "usage": USAGE}),
           _event({"error": {"message": "overloaded"}}),
           b"event: error\ndata: {}\n\n",
           b"event: response.completed\ndata: {\"type\": \"response.completed\"}\n\n",
           _event(chunk({"content": "a"})) + b"data: [DONE]\n\n"]


class _Sink:
    def __init__(self) -> None:
        self.out: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.out.append(data)


def _refuse(*args):
    raise AssertionError("an ordinary write searched")


@pytest.mark.parametrize("events", ORDINARY)
async def test_an_ordinary_write_is_searched_for_nothing_more(events, monkeypatch):
    for name in ("finished", "has_error", "without_usage"):
        monkeypatch.setattr(forward, name, _refuse)
    sink = _Sink()
    passing = forward._Passing(sink, None, strip_usage=True)  # type: ignore[arg-type]
    await sink.write(passing.note(events))
    assert sink.out == [events] and not passing.done and not passing.errored


@pytest.mark.parametrize("events", SPECIAL)
async def test_a_write_with_usage_an_error_or_the_end_gets_every_check(events):
    sink = _Sink()
    passing = forward._Passing(sink, None, strip_usage=True)  # type: ignore[arg-type]
    await sink.write(passing.note(events))
    assert (passing.done, passing.errored) == (finished(events), has_error(events))
    assert sink.out == [without_usage(events)]
    assert passing.done or passing.errored or sink.out != [events]


def _without_usage_by_pattern(events: bytes) -> bytes:
    """``without_usage`` as it was: every event split out by a pattern."""
    if b'"usage"' not in events:
        return events
    return b"".join(sse_bytes._strip_event(m.group(1)) if b'"usage"' in m.group(0)
                    else m.group(0) for m in sse_bytes._EVENT.finditer(events))


def test_usage_is_left_out_of_a_long_write_as_the_pattern_left_it_out():
    import random
    pieces = [*ORDINARY, *SPECIAL, b"\n\n", b"data: not json \"usage\"\n\n",
              b"data: a\ndata: \"usage\"\n\n", _event({**chunk(), "usage": None})]
    rng = random.Random(28)
    for _ in range(3000):
        write = b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        write = (b"\n" if rng.random() < 0.1 else b"") + write + (
            b"data: cut" if rng.random() < 0.2 else b"")
        assert without_usage(write) == _without_usage_by_pattern(write), write


async def test_a_forwarded_streams_ordinary_events_are_tested_once(monkeypatch):
    """20 token events, the finish with the usage the client did not ask for, [DONE]:
    only the last two writes are searched for the end, an error or a usage; the client
    gets the events less the usage, the span the usage and the end."""
    searched: list[bytes] = []

    def counting(real):
        def wrapped(events):
            searched.append(events)
            return real(events)
        return wrapped
    for name in ("finished", "has_error", "without_usage"):
        monkeypatch.setattr(forward, name, counting(getattr(forward, name)))
    rt = RequestTrace(NonRecordingSpan(SpanContext(1, 2, False)), "chat")
    token = request_tracing._current.set(rt)
    try:
        sink = _Sink()
        passing = forward._Passing(sink, None, strip_usage=True)  # type: ignore[arg-type]
        tokens = [_event(chunk({"content": f" w{i}"})) for i in range(20)]
        last = [_event(chunk({}, "stop", usage=USAGE)), b"data: [DONE]\n\n"]
        for events in tokens + last:
            await sink.write(passing.note(events))
    finally:
        request_tracing._current.reset(token)
    assert set(searched) == set(last)  # each of the two by each of the three checks
    assert passing.done and not passing.errored and passing.events == 22
    assert sink.out[:20] == tokens and b'"usage"' not in sink.out[20]
    rt.end(200, False, None)
    assert rt.done and rt.upstream_counts is not None
    assert (rt.upstream_counts.prompt_tokens, rt.upstream_counts.completion_tokens) == (3, 2)
    assert rt.events == 22 and rt.outcome == "complete"


@pytest.fixture
def no_propagator(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("OpenTelemetry's propagator used for a span that records nothing")
    monkeypatch.setattr(TraceContextTextMapPropagator, "inject", refuse)


async def test_the_upstream_continues_the_callers_trace_without_the_propagator(
        aiohttp_client, aiohttp_server, no_propagator):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={
        "traceparent": CALLER, "tracestate": "vendor=abc,other=1"})
    assert resp.status == 200
    sent = fake.received[0].headers
    version, trace_id, span_id, flags = sent["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", "0af7651916cd43dd8448eb211c80319c", "01")
    assert len(span_id) == 16 and int(span_id, 16) and span_id != "b7ad6b7169203331"
    assert sent["tracestate"] == "vendor=abc,other=1"


async def test_without_a_caller_the_upstream_gets_a_new_sampled_trace(
        aiohttp_client, aiohttp_server, no_propagator):
    fake = FakeUpstream([FakeUpstream.json(chat_json()), FakeUpstream.json(chat_json())])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    parents = [r.headers["traceparent"].split("-") for r in fake.received]
    for version, trace_id, span_id, flags in parents:
        assert (version, flags, len(trace_id), len(span_id)) == ("00", "01", 32, 16)
        assert int(trace_id, 16) and int(span_id, 16)
    assert parents[0][1] != parents[1][1]  # a trace each
    assert all("tracestate" not in r.headers for r in fake.received)


def test_the_header_is_the_one_the_propagator_writes():
    span = NonRecordingSpan(SpanContext(
        0x0af7651916cd43dd8448eb211c80319c, 0x00f067aa0ba902b7, is_remote=False,
        trace_flags=TraceFlags(0), trace_state=TraceState([("k", "v"), ("z", "1")])))
    ours: dict[str, str] = {"traceparent": "stale", "tracestate": "stale", "x": "y"}
    RequestTrace(span, "chat").inject(ours)
    from opentelemetry import trace
    theirs: dict[str, str] = {"x": "y"}
    TraceContextTextMapPropagator().inject(theirs, context=trace.set_span_in_context(span))
    assert ours == theirs


async def test_a_recording_span_still_goes_upstream_through_opentelemetry(
        aiohttp_client, aiohttp_server):
    from flowlift.testing import capture_spans
    with capture_spans() as captured:
        fake = FakeUpstream([FakeUpstream.json(chat_json())])
        client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
        assert (await client.post("/v1/chat/completions", json=CHAT,
                                  headers={"traceparent": CALLER})).status == 200
        await asyncio.sleep(0)  # (the span ends right after the answer)
        span = captured.named("chat up")[0]
    sent = fake.received[0].headers["traceparent"].split("-")
    assert int(sent[2], 16) == span.context.span_id


def test_a_request_naming_no_workflow_is_read_for_none(monkeypatch):
    from multidict import CIMultiDict, CIMultiDictProxy

    from flowlift.proxy.workflows import inferred
    monkeypatch.setattr(inferred, "_pick", _refuse)
    plain_headers = CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"}))
    assert inferred.workflow_from(plain_headers, {"model": "m", "metadata": {}}) is None
    monkeypatch.undo()
    joined = CIMultiDictProxy(CIMultiDict({"x-flowlift-workflow": "wf-1"}))
    assert inferred.workflow_from(joined, {"model": "m"}) == ("wf-1", None)
    assert inferred.workflow_from(plain_headers, {"metadata": {
        "flowlift_workflow": "wf-2", "flowlift_step": "s"}}) == ("wf-2", "s")


async def test_a_route_that_predicts_nothing_estimates_no_demand(
        aiohttp_client, aiohttp_server, monkeypatch):
    monkeypatch.setattr(forward, "demand_of", _refuse)
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200


def _awaiting(coro: object) -> list:
    """The code of each coroutine (or generator) in ``coro``'s chain of awaits."""
    codes = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            codes.append(frame.f_code)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return codes


async def test_a_request_waiting_on_its_upstream_holds_few_coroutines(
        aiohttp_client, aiohttp_server):
    """While an answer is awaited, the request's task holds one coroutine per step
    that must wrap the next (the middleware, the handler, forwarding, the attempts,
    the attempt): every resumption passes through each of them."""
    from aiohttp import web
    release = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.json_response(chat_json())
    fake = FakeUpstream([held])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    sent = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    chain: list[str] = []
    for _ in range(200):
        await asyncio.sleep(0.005)
        for task in asyncio.all_tasks():
            names = [code.co_qualname for code in _awaiting(task.get_coro())
                     if "/site-packages/" not in code.co_filename]
            if "_attempt" in names:
                chain = names
        if chain:
            break
    release.set()
    assert (await sent).status == 200
    assert chain == ["proxy_stack.<locals>.stack", "_dispatch", "forward", "open_answer",
                     "_Attempts.send", "_attempt"]


def test_a_stream_for_a_span_that_records_nothing_is_read_without_its_choices(monkeypatch):
    from flowlift.proxy.wire import chunks
    monkeypatch.setattr(chunks, "_choice", _refuse)
    rt = RequestTrace(NonRecordingSpan(SpanContext(1, 2, False)), "chat")
    rt.request("up", None, True)
    rt.sse(_event(chunk({"content": "a"}, model="served")))
    rt.sse(_event(chunk({}, "stop", usage=USAGE)) + b"data: [DONE]\n\n")
    rt.end(200, False, None)
    assert rt.upstream_counts is not None and rt.upstream_counts.completion_tokens == 2
    assert rt.response_model == "up-model" and rt.outcome == "complete" and not rt.finish
