"""Tool calls streamed as OpenAI streams them (issue 34, item 1): a first
``delta.tool_calls`` entry per call (``index``, ``id``, ``type``, ``function.name``,
``arguments: ""``), then ``arguments`` fragments as the model writes them, in both
formats of the embedded engine (constrained JSON on :class:`FakeEngine`, the model's own
markup read by vLLM's ``hermes`` parser on :class:`QwenStyleFakeEngine`); the Responses
API's function-call events from the same pieces; the ``openai`` SDK's stream helpers
accumulate them into the non-streamed answer; a streamed call the answer does not hold
ends the stream with an error event."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import openai
import pytest

from flowlift.errors import EngineError
from flowlift.local_engine.base import GenerationRequest, ToolCall, ToolCallDelta
from flowlift.proxy import create_app
from flowlift.proxy.state import STATE
from flowlift.proxy.wire.call_deltas import CallScanner, CallStream
from flowlift.testing import FakeEngine
from flowlift.testing.native import QwenStyleFakeEngine
from tests.openapi_spec import LiveServers

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} the docs.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}} for name in ("search", "read")]
MESSAGES = [{"role": "user", "content": "Which module reads CSV files?"}]
LONG = "csv reader and writer, dialects, quoting rules"
TWO_CALLS = json.dumps({"tool_calls": [{"name": "search", "arguments": {"query": LONG}},
                                       {"name": "read", "arguments": {"query": "csv"}}]})
MARKUP = ('Let me look that up.\n<tool_call>\n{"name": "search", "arguments": '
          f'{{"query": "{LONG}"}}}}\n</tool_call>\n<tool_call>\n{{"name": "read", '
          '"arguments": {"query": "csv"}}\n</tool_call>')


def constrained(text: str) -> FakeEngine:
    return FakeEngine(["m"], responder=lambda r: text, chunk_chars=3)


def native(text: str) -> QwenStyleFakeEngine:
    return QwenStyleFakeEngine(["m"], responder=lambda r: text, chunk_chars=3)


@pytest.fixture
async def proxy(aiohttp_client):
    async def make(engine):
        app = create_app({"m": engine})
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        return client
    return make


def data_lines(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def chat(client, stream: bool, **extra):
    resp = await client.post("/v1/chat/completions", json={
        "model": "m", "messages": MESSAGES, "tools": TOOLS, "temperature": 0,
        "stream": stream, **extra})
    assert resp.status == 200, await resp.text()
    return data_lines(await resp.text()) if stream else await resp.json()


def accumulate(lines: list[str]) -> tuple[str, list[dict], list[dict]]:
    """What a client builds from a stream: the content, the calls by index, and every
    ``delta.tool_calls`` entry in order."""
    content, calls, entries = "", {}, []
    for line in lines:
        if line == "[DONE]":
            continue
        for choice in json.loads(line)["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for entry in delta.get("tool_calls") or ():
                entries.append(entry)
                call = calls.setdefault(entry["index"], {"function": {"arguments": ""}})
                for key in ("id", "type"):
                    call[key] = entry.get(key, call.get(key))
                fn = entry.get("function") or {}
                call["function"]["name"] = fn.get("name", call["function"].get("name"))
                call["function"]["arguments"] += fn.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)], entries


@pytest.mark.parametrize("engine, before", [(lambda: constrained(TWO_CALLS), ""),
                                            (lambda: native(MARKUP), "Let me look that up.\n")],
                         ids=["constrained", "native"])
async def test_calls_stream_as_an_opening_entry_then_argument_fragments(proxy, engine, before):
    client = await proxy(engine())
    lines = await chat(client, stream=True)
    assert lines[-1] == "[DONE]"
    content, calls, entries = accumulate(lines)
    assert content == before  # text before the calls still streams as content
    openings = [e for e in entries if "id" in e]
    assert [(e["index"], e["type"], e["function"]) for e in openings] == [
        (0, "function", {"name": "search", "arguments": ""}),
        (1, "function", {"name": "read", "arguments": ""})]
    assert len({e["id"] for e in openings}) == 2
    # each call opens before its fragments, all of call 0 before call 1 (parallel calls)
    assert [e["index"] for e in entries] == sorted(e["index"] for e in entries)
    for i in (0, 1):
        mine = [e for e in entries if e["index"] == i]
        assert "id" in mine[0] and all(set(e) == {"index", "function"} and
                                       set(e["function"]) == {"arguments"} for e in mine[1:])
    fragments = [e for e in entries if e["index"] == 0 and "id" not in e]
    assert len(fragments) > 3  # in pieces as they are generated, not whole at the end
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": LONG}
    assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "tool_calls"
    # the streamed calls add up to the non-streamed answer
    whole = (await chat(client, stream=False))["choices"][0]["message"]["tool_calls"]
    strip = [{**c, "id": None} for c in whole]
    assert [{**c, "id": None} for c in calls] == strip


async def test_fragments_come_before_the_answer_ends(proxy):
    """The first fragments are on the wire while the rest is still being generated:
    the chunk that carries a fragment precedes the chunks of later text."""
    client = await proxy(constrained(TWO_CALLS))
    lines = await chat(client, stream=True)
    kinds = []
    for line in lines[:-1]:
        (choice,) = json.loads(line)["choices"]
        kinds.append("finish" if choice["finish_reason"] else
                     "call" if choice["delta"].get("tool_calls") else "other")
    assert kinds.index("finish") == len(kinds) - 1
    assert kinds.count("call") > 6  # two openings and many fragments, each its own chunk


async def test_a_plain_answer_with_tools_loses_no_text(proxy):
    for engine in (constrained(json.dumps({"content": "The csv module."})),
                   native("The csv module {reads} files.")):
        lines = await chat(await proxy(engine), stream=True)
        content, calls, _ = accumulate(lines)
        assert calls == [] and lines[-1] == "[DONE]"
        assert content in ("The csv module.", "The csv module {reads} files.")


@pytest.mark.parametrize("engine, extra", [
    # constrained, cut off by max_tokens inside its second call
    (lambda: constrained(TWO_CALLS), {"max_tokens": 16}),
    # native markup whose JSON turns out not to parse after its name was streamed
    (lambda: native('<tool_call>\n{"name": "search", "arguments": {"query": "csv" '
                    'oops}}\n</tool_call>'), {})], ids=["cut-off", "unparsable"])
async def test_a_streamed_call_the_answer_does_not_hold_ends_with_an_error_event(
        proxy, engine, extra):
    client = await proxy(engine())
    lines = await chat(client, stream=True, **extra)
    assert "[DONE]" not in lines
    error = json.loads(lines[-1])["error"]
    assert error["code"] == "invalid_tool_call" and error["type"] == "server_error"
    assert ("'read'" if extra else "'search'") in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if extra:  # not streamed, the whole calls before the cut are the answer, as before
        (choice,) = (await chat(client, stream=False, **extra))["choices"]
        assert choice["finish_reason"] == "length"
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["search"]


def test_scanner_reads_any_split_of_the_answer_the_same():
    doc = ('{"tool_calls": [{"name": "search", "arguments": {"query": "c\\"s}v \\u00e9", '
           '"n": [1, 2.5e3, {"x": null}]}}, {"arguments": {"path": "é"}, "name": "read"}]}')
    rng = random.Random(7)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(doc)), rng.randint(0, 40)))
        parts = [doc[a:b] for a, b in zip([0, *cuts], [*cuts, len(doc)], strict=True)]
        scanner, stream = CallScanner(), CallStream()
        for part in parts:
            stream.feed(scanner.feed(part))
        calls = stream.calls
        assert [c["function"]["name"] for c in calls] == ["search", "read"]
        assert calls[0]["function"]["arguments"] == \
            '{"query": "c\\"s}v \\u00e9", "n": [1, 2.5e3, {"x": null}]}'  # as written
        assert calls[1]["function"]["arguments"] == '{"path": "é"}'
        final = scanner.settle([ToolCall("x0", "search", json.dumps(
            json.loads(calls[0]["function"]["arguments"]))), ToolCall("x1", "read", "{}")])
        assert final[0] == ToolCall(calls[0]["id"], "search", calls[0]["function"]["arguments"])
        assert final[1] == ToolCall("x1", "read", "{}")  # not the streamed call: as it is


def test_scanner_makes_no_calls_of_other_json():
    for doc in ('{"content": "{\\"tool_calls\\": [{\\"name\\": \\"x\\"}]}"}', '["a"]',
                'not json', '{"tool_calls": "no"}'):
        scanner = CallScanner()
        assert [scanner.feed(ch) for ch in doc] == [()] * len(doc)


def test_call_stream_completes_and_checks_the_calls():
    stream = CallStream()
    stream.feed([ToolCallDelta(0, "", "call_a", "search"), ToolCallDelta(0, '{"q": ')])
    rest = stream.finish([ToolCall("other", "search", '{"q": 1}'),
                          ToolCall("call_b", "read", "{}")])
    assert rest == [{"index": 0, "function": {"arguments": "1}"}},
                    {"index": 1, "id": "call_b", "type": "function",
                     "function": {"name": "read", "arguments": ""}},
                    {"index": 1, "function": {"arguments": "{}"}}]
    assert [(c["id"], c["function"]["arguments"]) for c in stream.calls] == [
        ("call_a", '{"q": 1}'), ("call_b", "{}")]
    for final in ([], [ToolCall("x", "search", '{"r": 1}')], [ToolCall("x", "read", '{"q": 1}')]):
        stream = CallStream()
        stream.feed([ToolCallDelta(0, '', "call_a", "search"), ToolCallDelta(0, '{"q"')])
        with pytest.raises(EngineError) as err:
            stream.finish(final)
        assert err.value.code == "invalid_tool_call"
    with pytest.raises(EngineError):  # a piece of a call that has no name yet
        CallStream().feed([ToolCallDelta(1, "{")])


# -- the Responses API ---------------------------------------------------------------------
def events_of(text: str) -> list[dict]:
    return [json.loads(line) for line in data_lines(text)]


async def test_responses_stream_function_call_arguments_as_deltas(proxy):
    client = await proxy(native(MARKUP))
    body = {"model": "m", "input": "Which module reads CSV files?",
            "tools": [{"type": "function", **t["function"]} for t in TOOLS]}
    resp = await client.post("/v1/responses", json={**body, "stream": True})
    events = events_of(await resp.text())
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    calls = [o for o in final["output"] if o["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["search", "read"]
    for call in calls:
        mine = [e for e in events if (e.get("item") or {}).get("id") == call["id"]
                or e.get("item_id") == call["id"]]
        kinds = [e["type"] for e in mine]
        deltas = [e["delta"] for e in mine if e["type"].endswith("arguments.delta")]
        assert kinds == ["response.output_item.added",
                         *["response.function_call_arguments.delta"] * len(deltas),
                         "response.function_call_arguments.done",
                         "response.output_item.done"]
        assert mine[0]["item"]["arguments"] == "" and mine[0]["item"]["name"] == call["name"]
        assert "".join(deltas) == mine[-2]["arguments"] == call["arguments"]
    assert len([e for e in events if e["type"].endswith("arguments.delta")]) > 3
    whole = await (await client.post("/v1/responses", json=body)).json()
    assert [(o["name"], o["arguments"]) for o in whole["output"] if o["type"] ==
            "function_call"] == [(c["name"], c["arguments"]) for c in calls]


async def test_responses_stream_ends_failed_on_a_call_it_cannot_complete(proxy):
    client = await proxy(constrained(TWO_CALLS))
    resp = await client.post("/v1/responses", json={
        "model": "m", "input": "q", "stream": True, "max_output_tokens": 6,
        "tools": [{"type": "function", **t["function"]} for t in TOOLS]})
    events = events_of(await resp.text())
    assert events[-1]["type"] == "response.failed"
    assert "was streamed" in events[-1]["response"]["error"]["message"]


# -- the openai SDK's own stream helpers -----------------------------------------------------
@pytest.fixture(scope="module")
def sdk() -> Iterator[openai.OpenAI]:
    def responder(request: GenerationRequest) -> str:
        return MARKUP if request.tools else TWO_CALLS

    engines = {"native": QwenStyleFakeEngine(["native"], responder=responder, chunk_chars=3),
               "constrained": FakeEngine(["constrained"], responder=responder,
                                         chunk_chars=3)}
    with LiveServers() as servers:
        url = servers.serve(lambda: create_app(engines))
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="sk-unused", max_retries=0,
                            timeout=10)


@pytest.mark.parametrize("model", ["native", "constrained"])
def test_the_sdk_stream_helpers_accumulate_the_non_streamed_calls(sdk, model):
    whole = sdk.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS)
    with sdk.chat.completions.stream(model=model, messages=MESSAGES, tools=TOOLS) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    expected = [(c.function.name, c.function.arguments)
                for c in whole.choices[0].message.tool_calls]
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == expected
    assert [(e.name, e.arguments) for e in done] == expected
    assert len({c.id for c in streamed}) == 2
    assert json.loads(streamed[0].function.arguments) == {"query": LONG}

    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    whole_r = sdk.responses.create(model=model, input="Which module reads CSV files?",
                                   tools=tools)
    with sdk.responses.stream(model=model, input="Which module reads CSV files?",
                              tools=tools) as rstream:
        deltas = [e for e in rstream if e.type == "response.function_call_arguments.delta"]
        final_r = rstream.get_final_response()
    pairs = [(o.name, o.arguments) for o in final_r.output if o.type == "function_call"]
    assert pairs == [(o.name, o.arguments) for o in whole_r.output
                     if o.type == "function_call"] == expected
    assert len(deltas) > 3


def test_native_pieces_of_any_split_add_up_to_the_parsed_calls():
    """vLLM's ``hermes`` parser fed the markup in random pieces: the pieces it streams
    add up to the calls it reads from the whole answer (ids and arguments' text)."""
    from flowlift.local_engine.base import ToolDef
    from flowlift.local_engine.native_tools import NativeToolReader
    from flowlift.testing.native import _Vocab

    tools = [ToolDef(t["function"]["name"], "", t["function"]["parameters"]) for t in TOOLS]
    rng = random.Random(11)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(MARKUP)), rng.randint(1, 50)))
        reader, stream, content = NativeToolReader("hermes", _Vocab(), tools), CallStream(), ""
        for a, b in zip([0, *cuts], [*cuts, len(MARKUP)], strict=True):
            text, _, pieces = reader.feed(MARKUP[a:b])
            content += text
            stream.feed(pieces)
        rest, calls = reader.finish()
        stream.finish(calls)
        assert content + rest == "Let me look that up.\n"
        assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
                for c in stream.calls] == [(c.id, c.name, c.arguments) for c in calls]
        assert json.loads(calls[0].arguments) == {"query": LONG}
