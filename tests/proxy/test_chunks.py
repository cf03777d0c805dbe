"""The one reader of OpenAI answers (stream events and whole answers), odd shapes included."""

from __future__ import annotations

import pytest

from flowlift.local_engine.base import TokenLogprob, Usage
from flowlift.proxy.wire.chunks import Chunk, ChunkChoice, parse, parse_event


def test_a_chat_stream_chunk():
    chunk = parse_event('{"id": "c", "object": "chat.completion.chunk", "model": "m", '
                        '"choices": [{"index": 0, "delta": {"content": "Hi"}, '
                        '"finish_reason": null}]}')
    assert chunk == Chunk(choices=(ChunkChoice(0, "Hi"),), model="m")
    assert chunk.choice(0).text == "Hi" and chunk.choice(1) is None  # type: ignore[union-attr]


def test_the_usage_only_chunk_that_ends_an_include_usage_stream():
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 4}}
    chunk = parse({"choices": [], "usage": usage})
    assert chunk.choices == () and chunk.choice() is None
    assert chunk.usage == Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)
    assert chunk.usage_json == usage  # kept whole (total_tokens, details) for the records


def test_usage_with_missing_or_odd_counts_reads_them_as_zero():
    chunk = parse({"usage": {"completion_tokens": 2, "prompt_tokens": "7",
                             "prompt_tokens_details": None}})
    assert chunk.usage == Usage(prompt_tokens=0, completion_tokens=2, cached_tokens=0)
    assert parse({"usage": {}}).usage is None and parse({"usage": None}).usage is None
    assert parse({"usage": "lots"}).usage_json is None


@pytest.mark.parametrize(("error", "message"), [
    ({"message": "overloaded", "type": "server_error"}, "overloaded"),
    ({"type": "server_error"}, ""), (None, ""), ("plain text", "plain text")])
def test_an_in_band_error_event(error, message):
    chunk = parse({"error": error})
    assert chunk.error == message and chunk.choices == ()
    assert parse({"choices": []}).error is None


def test_choices_with_other_indexes_finish_reasons_and_logprobs():
    chunk = parse({"choices": [
        {"index": 1, "delta": {"content": "b"}, "finish_reason": "length"},
        {"index": 0, "delta": {"content": "a"}, "finish_reason": "stop", "logprobs": {
            "content": [{"token": "a", "logprob": -0.5,
                         "top_logprobs": [{"token": "a", "logprob": -0.5},
                                          {"token": "b", "logprob": -2}]}]}}]})
    assert [c.index for c in chunk.choices] == [1, 0]  # in the order sent
    assert chunk.choice(1) == ChunkChoice(1, "b", "length")
    assert chunk.choice(0) == ChunkChoice(0, "a", "stop", (
        TokenLogprob("a", -0.5, (("a", -0.5), ("b", -2.0))),))


def test_missing_fields_read_as_absent():
    chunk = parse({"choices": [{}, {"delta": None, "finish_reason": ""}]})
    assert chunk.choices == (ChunkChoice(0), ChunkChoice(0))  # no index: choice 0
    assert chunk.model is None and chunk.usage is None and chunk.error is None
    assert parse({}) == Chunk()


def test_choices_of_the_wrong_shape_are_left_out():
    chunk = parse({"model": 5, "choices": [
        "text", None, {"index": "1", "text": "x"}, {"index": True, "text": "y"},
        {"index": 2, "delta": {"content": ["not", "a", "string"]}, "text": 3}]})
    assert chunk.model is None and chunk.choices == (ChunkChoice(2, ""),)
    assert parse({"choices": {"index": 0}}).choices == ()


def test_logprob_entries_without_a_number_are_left_out():
    chunk = parse({"choices": [{"logprobs": {"content": [
        {"token": "a", "logprob": None}, "junk", {"logprob": -1},
        {"token": "c", "logprob": -3, "top_logprobs": [{"logprob": "x"}, {"token": "c"}]}]}}]})
    assert chunk.choice(0).logprobs == (  # type: ignore[union-attr]
        TokenLogprob("", -1.0), TokenLogprob("c", -3.0, (("c", 0.0),)))
    assert parse({"choices": [{"logprobs": None}]}).choice(0).logprobs == ()  # type: ignore[union-attr]


def test_whole_answers_chat_and_completion():
    message = {"role": "assistant", "content": "Hello", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    chat = parse({"object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": message, "finish_reason": "tool_calls"}]})
    assert chat.choice(0) == ChunkChoice(0, "Hello", "tool_calls", message=message)
    text = parse({"object": "text_completion", "choices": [
        {"index": 0, "text": "Once", "finish_reason": "length", "logprobs": None}]})
    assert text.choice(0) == ChunkChoice(0, "Once", "length")


@pytest.mark.parametrize("data", ["[DONE]", "", "{not json", '{"a": ', "[1, 2]", '"text"',
                                  "null", b"\xff\xfe"])
def test_an_event_that_is_not_a_json_object_is_none(data):
    assert parse_event(data) is None


def test_bytes_events_parse_too():
    chunk = parse_event('{"choices": [{"text": "é"}]}'.encode())
    assert chunk is not None and chunk.choice(0) == ChunkChoice(0, "é")
