"""OpenAI parity of the embedded engine's endpoints, on a FakeEngine: tool calling, n > 1,
logprobs, legacy completions, embeddings, ``on_output``, and the 400s for what the engine
cannot honour.

The handlers are mounted on a small app of their own (the proxy's error middleware, one
backend), so ``on_output`` can be observed and nothing else of the proxy is involved.
"""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace
from typing import Any

import jsonschema
import openai
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlift.errors import EngineError, RequestError
from flowlift.local_engine.base import Capabilities, GenerationRequest
from flowlift.local_engine.vllm_engine import token_logprobs
from flowlift.proxy.dispatch.backends import Backend
from flowlift.proxy.dispatch.slots.scheduler import PrioritySlots
from flowlift.proxy.http import openai_errors
from flowlift.proxy.openai.chat_completion import serving as embedded
from flowlift.proxy.wire.tool_calls import ToolPlan
from flowlift.proxy.wire.tool_output import ToolOutputDecoder
from flowlift.testing import FakeEngine, parse_sse

MODEL = "fake-model"
USER = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                   "required": ["tz"]}}}


class Harness:
    def __init__(self, engine: FakeEngine, client: Any) -> None:
        self.engine, self.client = engine, client
        self.outputs: list[tuple[str, dict[str, Any] | None]] = []

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        return await self.client.post(path, json={"model": MODEL, **body})

    async def ok(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self.post(path, body)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def events(self, path: str, body: dict[str, Any]) -> list[Any]:
        resp = await self.post(path, {**body, "stream": True})
        assert resp.status == 200, await resp.text()
        events = [d for _, d in parse_sse(await resp.text())]
        assert events[-1] == "[DONE]"
        return events[:-1]

    async def error(self, path: str, body: dict[str, Any], status: int = 400) -> dict[str, Any]:
        resp = await self.post(path, body)
        assert resp.status == status, await resp.text()
        return (await resp.json())["error"]

    def oai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=str(self.client.make_url("/v1")),
                                  api_key="unused", max_retries=0)

    @property
    def last(self) -> GenerationRequest:
        return self.engine.requests[-1]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine([MODEL])


@pytest.fixture
async def h(aiohttp_client, engine) -> Harness:
    backend = Backend("engine-0", engine, PrioritySlots(4), 4)
    app = web.Application(middlewares=[openai_errors])
    harness = Harness(engine, None)

    def route(handler):
        async def handle(request: web.Request) -> web.StreamResponse:
            data = await request.json()
            kwargs = {} if handler is embedded.embeddings else {
                "on_output": lambda text, usage: harness.outputs.append((text, usage))}
            return await handler(request, data, data.get("model"), backend, **kwargs)
        return handle

    app.router.add_post("/v1/chat/completions", route(embedded.chat_completions))
    app.router.add_post("/v1/completions", route(embedded.completions))
    app.router.add_post("/v1/embeddings", route(embedded.embeddings))
    harness.client = await aiohttp_client(app)
    return harness


def replying(engine: FakeEngine, *texts: str) -> None:
    """Make the engine answer with ``texts`` in turn (the last one repeats)."""
    queue = list(texts)
    engine.responder = lambda req: queue.pop(0) if len(queue) > 1 else queue[0]


def calls_json(*calls: tuple[str, dict[str, Any]]) -> str:
    return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})


def content_of(events: list[Any], index: int = 0) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in events
                   if c["choices"] and c["choices"][0]["index"] == index)


# -- tools -----------------------------------------------------------------------------

async def test_required_tool_call(h):
    body = await h.ok("/v1/chat/completions", {"messages": USER, "tools": [WEATHER, TIME],
                                               "tool_choice": "required"})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "x"}
    schema = h.last.constraint.json_schema
    assert "anyOf" not in schema and "maxItems" not in schema["properties"]["tool_calls"]
    system = h.last.messages[0]
    assert system.role == "system" and "get_weather" in system.content
    assert "Local time." in system.content and h.last.messages[1].role == "user"


async def test_auto_is_content_or_calls_and_both_parse(h):
    replying(h.engine, json.dumps({"content": "It is sunny."}),
             calls_json(("get_time", {"tz": "CET"})))
    body = await h.ok("/v1/chat/completions", {"messages": USER, "tools": [WEATHER, TIME]})
    schema_calls = h.last.constraint.json_schema
    assert len(schema_calls["anyOf"]) == 2
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny.",
                                             "refusal": None}
    assert body["choices"][0]["finish_reason"] == "stop"
    body = await h.ok("/v1/chat/completions", {"messages": USER, "tools": [WEATHER, TIME],
                                               "tool_choice": "auto"})
    fn = body["choices"][0]["message"]["tool_calls"][0]["function"]
    # the arguments' text is the model's own (as streamed), not re-encoded
    assert fn == {"name": "get_time", "arguments": '{"tz": "CET"}'}
    for value in ({"content": "hi"}, {"tool_calls": [{"name": "get_time",
                                                      "arguments": {"tz": "a"}}]}):
        jsonschema.validate(value, schema_calls)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "rm_rf", "arguments": {}}]},
                            schema_calls)


async def test_named_choice_and_no_parallel_calls(h):
    replying(h.engine, calls_json(("get_time", {"tz": "a"}), ("get_time", {"tz": "b"})))
    body = await h.ok("/v1/chat/completions", {
        "messages": USER, "tools": [WEATHER, TIME], "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"tz": "a"}]
    schema = h.last.constraint.json_schema["properties"]["tool_calls"]
    assert schema["maxItems"] == 1
    assert schema["items"]["properties"]["name"] == {"const": "get_time"}


async def test_tool_choice_none_ignores_tools(h):
    body = await h.ok("/v1/chat/completions", {"messages": USER, "tools": [WEATHER],
                                               "tool_choice": "none"})
    assert body["choices"][0]["message"]["content"] == "echo: weather in Paris?"
    assert h.last.constraint is None and len(h.last.messages) == 1


async def test_streamed_tool_calls(h):
    replying(h.engine, calls_json(("get_weather", {"city": "Paris"}),
                                  ("get_time", {"tz": "CET"})))
    events = await h.events("/v1/chat/completions", {"messages": USER, "tools": [WEATHER, TIME],
                                                     "tool_choice": "required"})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    entries = [c["choices"][0]["delta"]["tool_calls"][0] for c in events
               if "tool_calls" in c["choices"][0]["delta"]]
    deltas = [d for d in entries if "id" in d]  # each call's opening entry
    assert [d["index"] for d in deltas] == [0, 1]
    assert all(d["id"].startswith("call_") and d["type"] == "function" for d in deltas)
    assert [d["function"] for d in deltas] == [{"name": "get_weather", "arguments": ""},
                                               {"name": "get_time", "arguments": ""}]
    args = ["".join(e["function"]["arguments"] for e in entries if e["index"] == i)
            for i in (0, 1)]
    assert json.loads(args[0]) == {"city": "Paris"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    [(text, usage)] = h.outputs
    assert json.loads(text) == [{"id": d["id"], "type": "function", "function": {
        "name": d["function"]["name"], "arguments": a}} for d, a in zip(deltas, args,
                                                                        strict=True)]
    assert usage["completion_tokens"] > 0


async def test_auto_content_streams_as_it_is_decoded(h):
    text = 'Sunny, "warm" \\ 23°C ☀ 😀\nbye'
    replying(h.engine, json.dumps({"content": text}))
    h.engine.chunk_chars = 3
    events = await h.events("/v1/chat/completions", {"messages": USER, "tools": [WEATHER]})
    pieces = [c["choices"][0]["delta"].get("content") for c in events[1:-1]]
    assert len(pieces) > 5 and "".join(pieces) == text  # streamed in pieces, not at the end
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_official_client_tool_calls(h):
    oai = h.oai()
    out = await oai.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER],
                                            tool_choice="required")
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    stream = await oai.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER],
                                               tool_choice="required", stream=True)
    calls = [tc async for c in stream for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")


async def test_history_with_tool_calls_and_results(h):
    history = [
        {"role": "developer", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text",
                                                                "text": "10:00"}]}]
    replying(h.engine, json.dumps({"content": "Sunny at 10."}))
    body = await h.ok("/v1/chat/completions", {"messages": history, "tools": [WEATHER, TIME]})
    assert body["choices"][0]["message"]["content"] == "Sunny at 10."
    msgs = h.last.messages
    assert [m.role for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0].content.startswith("Be brief.\n\n") and "get_time" in msgs[0].content
    assert json.loads(msgs[2].content) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {"tz": "CET"}}]}
    assert "get_weather (call call_1):\nsunny" in msgs[3].content
    assert "get_time (call call_2):\n10:00" in msgs[3].content


async def test_tool_parameters_with_defs_are_hoisted(h):
    tool = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"room": {"$ref": "#/$defs/Room"}},
        "required": ["room"],
        "$defs": {"Room": {"type": "object", "properties": {"n": {"type": "integer"}},
                           "required": ["n"]}}}}}
    body = await h.ok("/v1/chat/completions", {"messages": USER, "tools": [tool],
                                               "tool_choice": "required"})
    schema = h.last.constraint.json_schema
    assert set(schema["$defs"]) == {"book__Room"}
    args = json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert args == {"room": {"n": 1}}
    jsonschema.validate({"tool_calls": [{"name": "book", "arguments": args}]}, schema)


async def test_unparsable_tool_output_is_returned_as_content(h):
    replying(h.engine, '{"tool_calls": [{"name": "get_wea')
    body = await h.ok("/v1/chat/completions", {"messages": USER, "tools": [WEATHER],
                                               "tool_choice": "required"})
    choice = body["choices"][0]
    assert choice["message"]["content"] == '{"tool_calls": [{"name": "get_wea'
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


def test_calls_cut_off_by_max_tokens_keep_the_complete_ones():
    whole = calls_json(("get_time", {"tz": "a"}), ("get_time", {"tz": "b"}))
    for raw, parallel, expected in ((whole[:-2], True, 2), (whole[:-2], False, 1),
                                    (whole[:-12], True, 1)):
        decoder = ToolOutputDecoder(ToolPlan((), "required", parallel))
        assert decoder.feed(raw[:-20]) + decoder.feed(raw[-20:]) == ""
        answer = decoder.result("length")
        assert answer.finish_reason == "length" and answer.content is None
        assert [json.loads(c["function"]["arguments"]) for c in answer.tool_calls] == [
            {"tz": "a"}, {"tz": "b"}][:expected]
    decoder = ToolOutputDecoder(ToolPlan((), "required"))
    decoder.feed(whole[:30])
    assert decoder.result("length").content == whole[:30]


async def test_schema_rejected_by_engine_names_tools(h):
    h.engine.fail_with = RequestError("grammar rejected", param="response_format")
    err = await h.error("/v1/chat/completions", {"messages": USER, "tools": [WEATHER],
                                                 "stream": True})
    assert err["param"] == "tools"


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": "city"}}}]}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "logprobs": True}, "logprobs"),
    ({"messages": [*USER, {"role": "tool", "content": "x"}]}, "messages[1]"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"modalities": 3}, "modalities"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
])
async def test_what_the_engine_cannot_honour_is_a_400(h, body, param):
    err = await h.error("/v1/chat/completions", {"messages": USER, **body})
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert len(err["message"]) > 20
    assert h.outputs == []


async def test_unknown_and_harmless_fields_are_accepted(h):
    await h.ok("/v1/chat/completions", {
        "messages": USER, "user": "u1", "store": False, "metadata": {"a": "b"},
        "x_vendor_knob": 3, "modalities": ["text"], "functions": [], "n": 1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"42": -100}})
    s = h.last.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias) == (0.5, -0.5,
                                                                       ((42, -100.0),))


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.lists(st.integers(1, 12), max_size=20))
def test_content_decoder_matches_json_however_split(text, cuts):
    raw = json.dumps({"content": text}, ensure_ascii=bool(len(text) % 2))
    decoder = ToolOutputDecoder(ToolPlan((), "auto", content_schema={"type": "string"}))
    got, at = "", 0
    for cut in [*cuts, len(raw)]:
        got += decoder.feed(raw[at:at + cut])
        at += cut
    answer = decoder.result("stop")
    assert got + answer.unsent == text == answer.content


# -- n > 1 -----------------------------------------------------------------------------

async def test_n_choices_with_seeds(h):
    h.engine.responder = lambda req: f"seed {req.sampling.seed}"
    body = await h.ok("/v1/chat/completions", {"messages": USER, "n": 3, "seed": 7})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["seed 7", "seed 8", "seed 9"]
    assert len({r.request_id for r in h.engine.requests}) == 3
    usage = body["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == 4
    assert h.outputs == [("seed 7", usage)]
    await h.ok("/v1/chat/completions", {"messages": USER, "n": 2})
    assert [r.sampling.seed for r in h.engine.requests[-2:]] == [None, None]


async def test_n_choices_stream_interleaved(h):
    h.engine.responder = lambda req: f"choice with seed {req.sampling.seed} here"
    h.engine.delay_s = 0.002
    events = await h.events("/v1/chat/completions", {
        "messages": USER, "n": 2, "seed": 0, "stream_options": {"include_usage": True}})
    indexes = [c["choices"][0]["index"] for c in events if c["choices"]]
    assert indexes[:2] == [0, 1]
    switches = sum(a != b for a, b in itertools.pairwise(indexes))
    assert switches > 4  # interleaved, not one choice after the other
    assert content_of(events, 0) == "choice with seed 0 here"
    assert content_of(events, 1) == "choice with seed 1 here"
    finishes = [c["choices"][0]["finish_reason"] for c in events if c["choices"]]
    assert finishes.count("stop") == 2
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10


# -- logprobs --------------------------------------------------------------------------

async def test_chat_logprobs(h):
    body = await h.ok("/v1/chat/completions", {"messages": USER, "logprobs": True,
                                               "top_logprobs": 2})
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    for t in content:
        assert t["bytes"] == list(t["token"].encode()) and t["logprob"] < 0
        assert len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["token"] == t["token"]
        assert set(t["top_logprobs"][1]) == {"token", "logprob", "bytes"}
    plain = await h.ok("/v1/chat/completions", {"messages": USER, "logprobs": True})
    assert all(t["top_logprobs"] == [] for t in plain["choices"][0]["logprobs"]["content"])
    assert h.last.sampling.logprobs == 0
    none = await h.ok("/v1/chat/completions", {"messages": USER})
    assert none["choices"][0]["logprobs"] is None and h.last.sampling.logprobs is None


async def test_chat_logprobs_stream_and_official_client(h):
    events = await h.events("/v1/chat/completions", {"messages": USER, "logprobs": True,
                                                     "top_logprobs": 1})
    with_text = [c["choices"][0] for c in events if c["choices"][0]["delta"].get("content")]
    assert with_text and all(len(c["logprobs"]["content"]) == 1 for c in with_text)
    assert [c["logprobs"]["content"][0]["token"] for c in with_text] == [
        c["delta"]["content"] for c in with_text]
    out = await h.oai().chat.completions.create(model=MODEL, messages=USER, logprobs=True,
                                                top_logprobs=3)
    assert out.choices[0].logprobs.content[0].top_logprobs[2].logprob < 0


async def test_engine_without_logprobs_says_so(h):
    h.engine.capabilities = Capabilities(structured_outputs=True)
    err = await h.error("/v1/chat/completions", {"messages": USER, "logprobs": True})
    assert err["param"] == "logprobs"
    err = await h.error("/v1/completions", {"prompt": "x"})
    assert err["param"] == "model" and "chat/completions" in err["message"]


def test_vllm_logprobs_are_read_by_rank():
    lp = lambda logprob, rank, tok: SimpleNamespace(logprob=logprob, rank=rank,  # noqa: E731
                                                    decoded_token=tok)
    piece = SimpleNamespace(token_ids=[5, 7], logprobs=[
        {5: lp(-0.1, 1, "a"), 6: lp(-2.5, 2, "b")},
        {7: lp(-3.0, 4, " c"), 1: lp(-0.5, 1, " d"), 2: lp(-1.0, 2, " e")}])
    first, second = token_logprobs(piece, 2)
    assert (first.token, first.logprob, first.top) == ("a", -0.1, (("a", -0.1), ("b", -2.5)))
    assert (second.token, second.top) == (" c", ((" d", -0.5), (" e", -1.0)))
    assert token_logprobs(piece, 0)[0].top == ()


# -- legacy completions ----------------------------------------------------------------

async def test_completion_shape_and_raw_prompt(h):
    body = await h.ok("/v1/completions", {"prompt": "Once upon a time", "stop": ["\n"],
                                          "temperature": 0})
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "echo: Once upon a time",
                                "logprobs": None, "finish_reason": "stop"}]
    req = h.last
    assert req.prompt == "Once upon a time" and not req.messages
    assert (req.sampling.max_tokens, req.sampling.stop, req.sampling.temperature) == (
        16, ("\n",), 0.0)
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 5
    assert h.outputs == [("echo: Once upon a time", body["usage"])]


async def test_completion_prompts_times_n_and_echo(h):
    h.engine.responder = lambda req: f"{req.prompt}/{req.sampling.seed}"
    body = await h.ok("/v1/completions", {"prompt": ["a b", "c"], "n": 2, "seed": 1,
                                          "echo": True, "max_tokens": 5})
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "a ba b/1"), (1, "a ba b/2"), (2, "cc/1"), (3, "cc/2")]
    assert body["usage"]["prompt_tokens"] == 3  # each prompt once
    assert body["usage"]["completion_tokens"] == 2 * 2 + 2


async def test_completion_max_tokens_and_length(h):
    body = await h.ok("/v1/completions", {"prompt": "one two three four", "max_tokens": 2})
    assert body["choices"][0] == {"index": 0, "text": "echo: one", "logprobs": None,
                                  "finish_reason": "length"}


async def test_completion_logprobs_legacy_shape(h):
    body = await h.ok("/v1/completions", {"prompt": "hi there", "logprobs": 2})
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    for tok, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert choice["text"][off:off + len(tok)] == tok
    assert all(len(top) == 2 and tok in top
               for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True))


async def test_completion_stream_with_usage_and_echo(h):
    events = await h.events("/v1/completions", {
        "prompt": "hi there", "echo": True, "stream_options": {"include_usage": True}})
    assert all(e["object"] == "text_completion" for e in events)
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert texts[0] == "hi there" and "".join(texts) == "hi thereecho: hi there"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert h.outputs == [("echo: hi there", events[-1]["usage"])]


async def test_completion_stream_logprobs_offsets(h):
    events = await h.events("/v1/completions", {"prompt": "a b c", "logprobs": 0})
    entries = [e["choices"][0] for e in events if e["choices"][0]["text"]]
    offsets = [e["logprobs"]["text_offset"][0] for e in entries]
    text = "".join(e["text"] for e in entries)
    assert [text[o:o + len(e["text"])] for o, e in zip(offsets, entries, strict=True)] == [
        e["text"] for e in entries]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "best_of": "many"}, "best_of"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
])
async def test_completion_errors(h, body, param):
    err = await h.error("/v1/completions", body)
    assert err["param"] == param


async def test_official_client_completions(h):
    oai = h.oai()
    out = await oai.completions.create(model=MODEL, prompt="Say hi", max_tokens=8,
                                       logprobs=1)
    assert out.choices[0].text == "echo: Say hi" and out.choices[0].logprobs.tokens
    stream = await oai.completions.create(model=MODEL, prompt="Say hi", stream=True,
                                          stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "echo: Say hi"
    assert chunks[-1].usage.completion_tokens == 3


# -- embeddings, failures, on_output ---------------------------------------------------

async def test_embeddings_are_refused_clearly(h):
    err = await h.error("/v1/embeddings", {"input": "hello"})
    assert err["param"] == "model" and err["code"] == "model_not_supported"
    assert "upstream" in err["message"] and "embeddings" in err["message"]
    with pytest.raises(openai.BadRequestError):
        await h.oai().embeddings.create(model=MODEL, input="hello")


async def test_failures_do_not_call_on_output(h):
    h.engine.fail_with = EngineError("boom")
    await h.error("/v1/chat/completions", {"messages": USER}, status=503)
    await h.error("/v1/completions", {"prompt": "x", "stream": True}, status=503)
    h.engine.fail_after_chunks = 1
    resp = await h.post("/v1/completions", {"prompt": "x y z", "stream": True})
    events = [d for _, d in parse_sse(await resp.text())]
    assert events[-1]["error"]["message"] == "boom" and "[DONE]" not in events
    assert h.outputs == []


async def test_on_output_once_per_answer(h):
    await h.ok("/v1/chat/completions", {"messages": USER})
    await h.events("/v1/chat/completions", {"messages": USER, "n": 2})
    await h.ok("/v1/chat/completions", {"messages": USER, "tools": [WEATHER],
                                        "tool_choice": "required"})
    texts = [t for t, _ in h.outputs]
    assert texts[:2] == ["echo: weather in Paris?"] * 2
    assert json.loads(texts[2])[0]["function"]["name"] == "get_weather"
    assert all(u["total_tokens"] > 0 for _, u in h.outputs) and len(h.outputs) == 3
