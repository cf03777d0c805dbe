"""The proxy's answers validate against OpenAI's published API description
(``tests/openapi_spec.py``), on the embedded path (``fake-model``, a FakeEngine) and the
upstream path (``up-model``, a fake upstream whose answers are spec-valid), and the
official client maps every error status to the right exception class."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import openai
import pytest

from flowlift.errors import EngineError
from flowlift.proxy import ProxyConfig
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse
from tests.openapi_spec import proxy_app, spec_upstream, validate
from tests.upstream_fake import FakeUpstream

MODELS = ["fake-model", "up-model"]
MESSAGES = [{"role": "user", "content": "hello there"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
VARIANTS = {
    "plain": {},
    "tools": {"tools": [WEATHER], "tool_choice": "required"},
    "n": {"n": 3},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
}


def test_the_validator_reads_the_spec_strictly():
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "usage": None, "choices": [{"index": 0, "delta": {"content": "hi"},
                                         "logprobs": None, "finish_reason": None}]}
    validate(chunk, "CreateChatCompletionStreamResponse")  # OpenAPI 3.0 `nullable` fields
    message = {"role": "assistant", "content": "hi", "refusal": None,
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": "{}"}}]}
    answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": message, "logprobs": None,
                           "finish_reason": "tool_calls"}]}
    validate(answer, "CreateChatCompletionResponse")  # a discriminated oneOf
    bad = [({"role": "assistant", "content": "hi"}, "'refusal' is a required property"),
           ({**message, "tool_calls": [{"type": "function", "function": {}}]},
            "tool_calls[0]"),
           ({**message, "role": "user"}, "$.choices[0].message.role")]
    for msg, why in bad:
        with pytest.raises(AssertionError, match=re.escape(why)):
            validate({**answer, "choices": [{**answer["choices"][0], "message": msg}]},
                     "CreateChatCompletionResponse")
    with pytest.raises(AssertionError, match=r"\$.choices\[0\].finish_reason"):
        validate({**chunk, "choices": [{**chunk["choices"][0], "finish_reason": "done"}]},
                 "CreateChatCompletionStreamResponse")


@pytest.fixture
async def proxy(aiohttp_client, aiohttp_server):
    """``await proxy(config=None, engine=None)``: a client of :func:`proxy_app`."""
    async def make(config: ProxyConfig | None = None, engine: FakeEngine | None = None):
        server = await aiohttp_server(FakeUpstream([spec_upstream]).app())
        app = proxy_app(str(server.make_url("/v1")), config, engine)
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        return client
    return make


def check_choices(variant: str, choices: list[dict[str, Any]]) -> None:
    """What each variant must produce beyond the shape (the message of each choice)."""
    assert [c["index"] for c in choices] == list(range(3 if variant == "n" else 1))
    msg = choices[0]["message"]
    if variant == "tools":
        call = msg["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and call["id"]
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
        assert choices[0]["finish_reason"] == "tool_calls"
    else:
        assert msg["content"] and "tool_calls" not in msg
    if variant == "logprobs":
        tokens = choices[0]["logprobs"]["content"]
        assert tokens and all(t["top_logprobs"] for t in tokens)
    else:
        assert choices[0]["logprobs"] is None


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_chat_completion_is_a_spec_response(proxy, model, variant):
    client = await proxy()
    resp = await client.post("/v1/chat/completions", json={
        "model": model, "messages": MESSAGES, **VARIANTS[variant]})
    body = await resp.json()
    assert resp.status == 200, body
    validate(body, "CreateChatCompletionResponse")
    check_choices(variant, body["choices"])


def stream_events(text: str) -> list[Any]:
    events = [d for _, d in parse_sse(text)]
    assert events[-1] == "[DONE]", events[-3:]
    return events[:-1]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_each_stream_chunk_is_a_spec_chunk(proxy, model, variant):
    client = await proxy()
    resp = await client.post("/v1/chat/completions", json={
        "model": model, "messages": MESSAGES, "stream": True,
        "stream_options": {"include_usage": True}, **VARIANTS[variant]})
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    chunks = stream_events(await resp.text())
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    # The chunks add up to the answer: per choice one finish, content or tool calls.
    finishes = {c["index"]: c["finish_reason"] for k in chunks for c in k["choices"]
                if c["finish_reason"]}
    assert sorted(finishes) == list(range(3 if variant == "n" else 1))
    deltas = [c["delta"] for k in chunks for c in k["choices"] if c["index"] == 0]
    calls = [t for d in deltas for t in d.get("tool_calls") or ()]
    if variant == "tools":
        assert finishes[0] == "tool_calls" and calls[0]["function"]["name"] == "get_weather"
    else:
        assert "".join(d.get("content") or "" for d in deltas) and not calls
    if variant == "logprobs" and model == "fake-model":
        tokens = [t for k in chunks for c in k["choices"] if c["logprobs"]
                  for t in c["logprobs"]["content"]]
        assert "".join(t["token"] for t in tokens) == "echo: hello there"


@pytest.mark.parametrize(("model", "extra"), [
    ("fake-model", {}), ("fake-model", {"n": 2}), ("fake-model", {"logprobs": 2}),
    ("up-model", {})])
async def test_completion_is_a_spec_response(proxy, model, extra):
    client = await proxy()
    resp = await client.post("/v1/completions", json={
        "model": model, "prompt": "Say hi", "max_tokens": 8, **extra})
    body = await resp.json()
    assert resp.status == 200, body
    validate(body, "CreateCompletionResponse")
    assert len(body["choices"]) == extra.get("n", 1) and body["choices"][0]["text"]
    if "logprobs" in extra:
        lp = body["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) > 0


@pytest.mark.parametrize("model", MODELS)
async def test_completion_stream_chunks_are_spec_shaped(proxy, model):
    client = await proxy()
    resp = await client.post("/v1/completions", json={
        "model": model, "prompt": "Say hi", "stream": True,
        "stream_options": {"include_usage": True}})
    assert resp.status == 200
    chunks = stream_events(await resp.text())
    for chunk in chunks:
        # The spec has no chunk schema for legacy completions; OpenAI streams them as
        # CreateCompletionResponse objects, with finish_reason and usage null until the
        # end, which the schema does not allow: those nulls are filled in here.
        validate({**chunk, "usage": chunk.get("usage") or chunks[-1]["usage"],
                  "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"}
                              for c in chunk["choices"]]}, "CreateCompletionResponse")
    assert "".join(c["text"] for k in chunks for c in k["choices"]).strip()
    assert [c["finish_reason"] for k in chunks for c in k["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


async def test_models_and_embeddings(proxy):
    client = await proxy()
    models = await (await client.get("/v1/models")).json()
    validate(models, "ListModelsResponse")
    assert {m["id"] for m in models["data"]} == {"fake-model", "up-model"}
    resp = await client.post("/v1/embeddings", json={"model": "up-model",
                                                     "input": ["a", "b"]})
    body = await resp.json()
    validate(body, "CreateEmbeddingResponse")
    assert [d["index"] for d in body["data"]] == [0, 1]
    resp = await client.post("/v1/embeddings", json={"model": "fake-model", "input": "a"})
    body = await resp.json()
    assert resp.status == 400 and body["error"]["code"] == "model_not_supported"
    validate(body, "ErrorResponse")


CHAT = {"model": "fake-model", "messages": MESSAGES}


@pytest.mark.parametrize(("status", "method", "path", "body"), [
    (400, "POST", "/v1/chat/completions", {"model": "fake-model"}),
    (400, "POST", "/v1/chat/completions", {**CHAT, "temperature": 9}),
    (400, "POST", "/v1/completions", {"model": "fake-model", "prompt": [1, 2]}),
    (400, "POST", "/v1/chat/completions", "not json"),
    (404, "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-nope"}),
    (404, "GET", "/v1/nope", None),
    (405, "GET", "/v1/chat/completions", None),
    (413, "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}),
    (401, "POST", "/v1/chat/completions", CHAT),
    (400, "POST", "/v1/chat/completions", {**CHAT, "model": "up-model", "user": "status-400"}),
    (429, "POST", "/v1/chat/completions", {**CHAT, "model": "up-model", "user": "status-429"}),
    # an upstream's 500 is the backend's fault: a 502 from the proxy, never a 500
    (502, "POST", "/v1/chat/completions", {**CHAT, "model": "up-model", "user": "status-500"}),
], ids=lambda v: v if isinstance(v, int | str) and len(str(v)) < 24 else "")
async def test_error_answers_are_spec_errors(proxy, status, method, path, body):
    config = ProxyConfig(max_body_bytes=2048, api_keys=frozenset({"sk-good"}) if
                         status == 401 else frozenset())
    client = await proxy(config)
    headers = {"Authorization": "Bearer sk-wrong"}
    data = body if isinstance(body, str) else None
    resp = await client.request(method, path, json=None if data else body, data=data,
                                headers=headers)
    doc = await resp.json()
    assert resp.status == status, doc
    validate(doc, "ErrorResponse")
    assert set(doc["error"]) >= {"message", "type", "param", "code"} and doc["error"]["message"]


@pytest.mark.parametrize(("exc", "case"), [
    (openai.BadRequestError, "bad"), (openai.AuthenticationError, "key"),
    (openai.NotFoundError, "model"), (openai.UnprocessableEntityError, "status-422"),
    (openai.RateLimitError, "status-429"), (openai.InternalServerError, "status-500"),
    (openai.InternalServerError, "engine"), (openai.NotFoundError, "status-404"),
])
async def test_statuses_map_to_the_openai_exception_classes(proxy, exc, case):
    engine = FakeEngine(["fake-model"], fail_with=EngineError("down") if case == "engine"
                        else None)
    client = await proxy(ProxyConfig(api_keys=frozenset({"sk-good"})), engine)
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), max_retries=0,
                            api_key="sk-wrong" if case == "key" else "sk-good")
    kwargs: dict[str, Any] = {"model": "fake-model", "messages": MESSAGES}
    if case == "bad":
        kwargs["messages"] = []
    elif case == "model":
        kwargs["model"] = "gpt-nope"
    elif case.startswith("status-"):
        kwargs |= {"model": "up-model", "user": case}
    with pytest.raises(exc) as info:
        await oa.chat.completions.create(**kwargs)
    assert isinstance(info.value.body, dict) and info.value.body["message"]
    assert type(info.value) is exc  # not merely a parent class


async def test_load_shedding_429_is_a_spec_error_the_client_maps(proxy):
    engine = FakeEngine(["fake-model"], delay_s=0.2)  # about 1 s an answer
    client = await proxy(ProxyConfig(max_concurrency=1, max_queue=1), engine)
    busy = []
    for _ in range(2):  # one in the engine, one queued
        busy.append(asyncio.create_task(client.post("/v1/chat/completions", json=CHAT)))
        await asyncio.sleep(0.1)
    shed = await client.post("/v1/chat/completions", json=CHAT)
    assert shed.status == 429 and int(shed.headers["Retry-After"]) >= 1
    validate(await shed.json(), "ErrorResponse")
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        await oa.chat.completions.create(**CHAT)
    assert [r.status for r in await asyncio.gather(*busy)] == [200, 200]
