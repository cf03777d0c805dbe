"""What the forwarding path's cuts (issue 28 item 5) must keep: end markers found only
at a line's start, the block around a byte, a stream's idle timer restarted by events
and expiring when they stop, the events a span reads kept bounded and read at the end,
the answer's choices read only where needed, a one-backend route, and the heap settled
for serving. No timing asserts beyond the timers' own (tens of milliseconds)."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
from opentelemetry.trace import NonRecordingSpan, SpanContext

from flowlift.proxy.dispatch.routing.routing import Route, pick
from flowlift.proxy.dispatch.upstream.forward import IdleTimer
from flowlift.proxy.lifecycle import GC_YOUNG_THRESHOLD, settle_heap
from flowlift.proxy.telemetry.requests import _HELD_MAX, RequestTrace
from flowlift.proxy.wire.chunks import parse
from flowlift.proxy.wire.sse_bytes import block_at, finished
from tests.upstream_fake import chat_json, chunk


@pytest.mark.parametrize("events,done", [
    (b"data: 1\n\ndata: [DONE]\n\n", True), (b"data: 1\rdata: [DONE]\r\r", True),
    (b"xdata: [DONE]\n\n", False), (b'data: {"t": "data: [DONE]"}\n\n', False),
    (b'data: [DONE]\n\ndata: {"t": "[DONE]"}\n\n', True),  # an earlier one counts
    (b"data:[DONE]", True), (b"xevent: response.completed\ndata: {}\n\n", False),
    (b"data: {}\n\nevent: response.failed\ndata: {}\n\n", True)])
def test_the_end_marker_is_a_whole_line(events, done):
    assert finished(events) is done


@pytest.mark.parametrize("events,at,block", [
    (b"data: a\n\ndata: b\n\ndata: c\n\n", 11, b"data: b"),
    (b"data: a\n\ndata: b", 12, b"data: b"),
    (b"data: a\r\n\r\nevent: x\r\ndata: b\r\n\r\n", 12, b"event: x\r\ndata: b"),
    (b"data: a\r\rdata: b\r\r", 2, b"data: a")])
def test_block_at_is_the_event_around_a_byte(events, at, block):
    start, end = block_at(events, at)
    assert events[start:end] == block


async def test_the_idle_timer_is_restarted_by_events_and_expires_without_them():
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as expiry:
            with IdleTimer(expiry, 0.1, started + 10) as idle:
                for _ in range(4):  # events every 60 ms keep it alive past 0.1 s
                    await asyncio.sleep(0.06)
                    idle.restart()
                await asyncio.sleep(5)  # then silence: it expires 0.1 s after the last
    assert 0.3 <= loop.time() - started < 2


async def test_the_idle_timer_expires_at_the_deadline_however_busy():
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as expiry:
            with IdleTimer(expiry, 1.0, started + 0.15) as idle:
                while True:
                    await asyncio.sleep(0.02)
                    idle.restart()
    assert loop.time() - started < 1


async def test_leaving_the_idle_timer_cancels_its_handle():
    async with asyncio.timeout(None) as expiry:
        with IdleTimer(expiry, 0.05, asyncio.get_running_loop().time() + 10) as idle:
            pass
    assert idle.handle.cancelled()
    await asyncio.sleep(0.1)  # nothing fires into the timeout that has ended


def _trace(recording: bool = False) -> RequestTrace:
    rt = RequestTrace(NonRecordingSpan(SpanContext(1, 2, is_remote=False)), "chat")
    rt.recording = recording
    return rt


def _events(*docs: object) -> bytes:
    return b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in docs)


def test_a_streams_events_for_the_span_are_held_bounded_and_read_at_the_end():
    rt = _trace()
    rt.request("m", None, True, {"messages": [{"role": "user", "content": "x" * 40}]})
    usage = {"prompt_tokens": 5, "completion_tokens": 1}
    rt.sse(_events(chunk({"content": "a"}, model="served")))  # the model, from the first
    for n in range(1, 3 * _HELD_MAX):  # an upstream that reports usage in every event
        rt.sse(_events(chunk({"content": "b"}, usage={**usage, "completion_tokens": n},
                             model="served")))
        assert len(rt._held) <= _HELD_MAX
    rt.sse(_events(chunk({}, "stop", usage={**usage, "completion_tokens": 99}, model="served")))
    rt.sse(b"data: [DONE]\n\n")
    assert rt.upstream_counts is None or rt.upstream_counts.completion_tokens < 99
    rt.end(200, False, None)
    assert rt.response_model == "served" and rt.done
    assert rt.usage_numbers() == (5, 99, 0, False)


def test_a_span_that_records_nothing_holds_no_finish_only_event():
    rt = _trace()
    rt.sse(_events(chunk({"content": "a"}), chunk({}, "stop")) + b"data: [DONE]\n\n")
    assert len(rt._held) == 1  # the first, for the model; the finish is the span's only


def test_a_recording_span_gets_the_finish_reasons_of_a_stream():
    rt = _trace(recording=True)
    rt.sse(_events(chunk({"content": "a"}), chunk({}, "length")) + b"data: [DONE]\n\n")
    rt.end(200, False, None)
    assert rt.finish == {0: "length"}


def test_the_prompt_estimate_comes_from_the_body_when_no_usage_came():
    rt = _trace()
    rt.request("m", None, False, {"messages": [{"role": "user", "content": "y" * 400}]})
    rt.upstream("b", {**chat_json("z" * 40), "usage": None})
    rt.end(200, False, None)
    prompt, completion, _, partial = rt.usage_numbers()
    assert partial and prompt is not None and prompt > 100 and completion == 10


def test_an_answers_choices_are_left_unread_when_not_asked():
    doc = chat_json("text")
    lean, whole = parse(doc, choices=False), parse(doc)
    assert lean.choices == () and whole.choices[0].text == "text"
    assert lean.usage == whole.usage and lean.model == whole.model == "up-model"


def test_one_backend_is_the_choice_tried_or_not_while_available():
    route = Route("m", ("only",))
    assert pick(route, available=lambda n: True, load=lambda n: 0, tried={"only"}) == "only"
    assert pick(route, available=lambda n: False, load=lambda n: 0) is None


def test_settling_the_heap_freezes_it_and_spaces_young_collections():
    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
