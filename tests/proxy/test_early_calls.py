"""Tool calls complete while a turn streams (proxy/wire/early_calls.py, the embedded
engine's constrained JSON; ToolCallPieces.ready, an upstream's ``delta.tool_calls``)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from flowlift.proxy.wire.chunks import ToolCallPieces
from flowlift.proxy.wire.early_calls import EarlyCalls, call_key
from flowlift.testing import tool_calls_text

ARGS = st.dictionaries(st.text(min_size=1, max_size=8),
                       st.one_of(st.integers(), st.text(max_size=12), st.booleans(),
                                 st.lists(st.text(max_size=4), max_size=3)), max_size=4)


@given(st.lists(ARGS, min_size=1, max_size=4), st.integers(1, 9))
def test_each_call_comes_once_when_its_json_closes_whatever_the_split(calls, step):
    text = tool_calls_text(*((f"t{i}", a) for i, a in enumerate(calls)))
    early = EarlyCalls()
    got = []
    for i in range(0, len(text), step):
        got += early.feed(text[i:i + step])
    assert [c.name for c in got] == [f"t{i}" for i in range(len(calls))]
    assert [json.loads(c.arguments) for c in got] == calls


def test_a_call_is_ready_at_its_closing_brace_not_at_the_end():
    text = tool_calls_text(("a", {"q": "x}{\\"}), ("b", {}))
    cut = text.index('{"name": "b"')
    early = EarlyCalls()
    first = early.feed(text[:cut])
    assert [c.name for c in first] == ["a"] and json.loads(first[0].arguments) == {"q": "x}{\\"}
    assert [c.name for c in early.feed(text[cut:])] == ["b"]


def test_text_that_is_not_tool_call_json_yields_nothing():
    for text in ('{"content": "{\\"tool_calls\\": [{\\"name\\": \\"x\\"}]}"}',
                 "plain answer {", '{"tool_calls": [{"name": 3}]}', "]]]"):
        early = EarlyCalls()
        assert early.feed(text) == () and early.feed("more") == ()


def test_call_key_matches_the_same_arguments_in_any_order_and_spacing():
    assert call_key("f", '{"a": 1, "b": [2]}') == call_key("f", '{"b":[2],"a":1}')
    assert call_key("f", '{"a": 1}') != call_key("g", '{"a": 1}')
    assert call_key("f", "not json") is None


def test_upstream_pieces_report_a_call_once_the_next_one_starts():
    pieces = ToolCallPieces()
    pieces.add(({"index": 0, "id": "c0", "function": {"name": "a", "arguments": '{"x"'}},))
    assert pieces.ready() == ()
    pieces.add(({"index": 0, "function": {"arguments": ": 1}"}},))
    assert pieces.ready() == ()
    pieces.add(({"index": 1, "id": "c1", "function": {"name": "b", "arguments": "{}"}},))
    ready = pieces.ready()
    assert [(c.id, c.name, c.arguments) for c in ready] == [("c0", "a", '{"x": 1}')]
    assert pieces.ready() == ()  # each once
    assert [c.name for c in pieces.calls() or ()] == ["a", "b"]
