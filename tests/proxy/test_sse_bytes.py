"""Event boundaries and end markers of forwarded streams, as bytes."""

from __future__ import annotations

import pytest

from flowlift.proxy.wire.sse_bytes import complete_prefix, data_fields, finished


@pytest.mark.parametrize("buffer,expected", [
    (b"", 0), (b"data: {\"a\"", 0), (b"data: 1\n\n", 9), (b"data: 1\n\ndata: 2\n", 9),
    (b"data: 1\r\n\r\ndata: 2", 11), (b"data: 1\r\rx", 9), (b"x\n\nyy", 3),
    (b"data: 1\n\ndata: 2\r\n\r\n", 20)])
def test_complete_prefix_ends_at_the_last_blank_line(buffer, expected):
    assert complete_prefix(buffer) == expected


@pytest.mark.parametrize("events,done", [
    (b"data: [DONE]\n\n", True), (b"data: [DONE]\r\n\r\n", True),
    (b'data: {"choices":[{"finish_reason": "stop"}]}\n\n', False),  # n > 1, usage follow
    (b'data: {"choices":[{"finish_reason":null}]}\n\n', False),
    (b'data: {"text":"say [DONE] later"}\n\n', False),
    (b"event: response.completed\ndata: {}\n\n", True),
    (b"event: response.output_text.delta\ndata: {}\n\n", False)])
def test_end_markers(events, done):
    assert finished(events) is done


def test_data_fields_join_lines_and_keep_multibyte_text():
    events = "data: {\"t\": \"日本\"}\n\nevent: x\ndata: a\ndata: b\n\n: comment\n\n".encode()
    assert list(data_fields(events)) == ['{"t": "日本"}', "a\nb"]
