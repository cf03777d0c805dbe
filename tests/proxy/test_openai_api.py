"""The OpenAI-compatible endpoints on a FakeEngine, including the official client."""

from __future__ import annotations

import openai
import pytest

from flowlift.errors import EngineError
from flowlift.proxy import ProxyConfig
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


async def test_non_streaming_shape(client):
    resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "echo: hello there",
                                 "refusal": None}
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                             + body["usage"]["completion_tokens"])
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    assert "engine;dur=" in resp.headers["Server-Timing"]


async def test_streaming_with_usage_chunk(client):
    resp = await client.post("/v1/chat/completions", json={
        **CHAT, "stream": True, "stream_options": {"include_usage": True}})
    events = parse_sse(await resp.text())
    assert events[-1][1] == "[DONE]"
    chunks = [d for _, d in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "echo: hello there"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


async def test_response_format_json_schema_is_constrained(client, engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    resp = await client.post("/v1/chat/completions", json={
        **CHAT, "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": schema}}})
    assert (await resp.json())["choices"][0]["message"]["content"] == '{"a": 1}'
    assert engine.requests[-1].constraint.json_schema == schema


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "fake-model"}, "messages"),
    ({"model": "fake-model", "messages": []}, "messages"),
    ({"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role"),
    ({**CHAT, "temperature": 7}, "temperature"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
    ({**CHAT, "n": 129}, "n"),
    ({**CHAT, "audio": {"voice": "x"}}, "audio"),
    ({**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
])
async def test_malformed_chat_requests_name_the_field(client, body, param):
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    ok = await client.post("/v1/chat/completions", json=CHAT)
    assert ok.status == 200  # the proxy keeps serving


async def test_unknown_model_route_and_method_errors(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert r.status == 404 and (await r.json())["error"]["param"] == "model"
    r = await client.get("/v1/nope")
    assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    r = await client.get("/v1/chat/completions")
    assert r.status == 405


async def test_body_over_limit_is_413(aiohttp_client, make_app):
    app = make_app(ProxyConfig(max_body_bytes=1024))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = await client.post("/v1/chat/completions", json=big)
    assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"


async def test_models_and_readiness(client):
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["fake-model", "other-model"]
    assert (await client.get("/healthz")).status == 200
    assert (await (await client.get("/readyz")).json())["ready"] is True


async def test_not_ready_is_503_with_retry_after(aiohttp_client, make_app, engine):
    import asyncio

    gate = asyncio.Event()
    original = engine.start

    async def slow_start():
        await gate.wait()
        await original()

    engine.start = slow_start
    app = make_app()
    client = await aiohttp_client(app)
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status == 503 and r.headers["Retry-After"] == "5"
    assert (await client.get("/readyz")).status == 503
    gate.set()
    await app[STATE].ready.wait()
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200


async def test_engine_failure_before_output_is_an_http_error(aiohttp_client, make_app, engine):
    engine.fail_with = EngineError("engine crashed")
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    for stream in (True, False):  # nothing was sent yet: a status, even for a stream
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status == 503 and (await r.json())["error"]["code"] == "engine_error"


async def test_engine_failure_mid_stream_is_reported_in_band(aiohttp_client, make_app, engine):
    engine.fail_with, engine.fail_after_chunks = EngineError("engine crashed"), 2
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status == 200
    events = parse_sse(await r.text())
    assert events[-1][1]["error"]["message"] == "engine crashed"
    assert "[DONE]" not in [d for _, d in events]
    assert [d["choices"][0]["delta"].get("content") for _, d in events[1:-1]] == ["echo", ": he"]


async def test_official_openai_client(client):
    oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                             max_retries=0)
    out = await oai.chat.completions.create(model="fake-model", messages=CHAT["messages"])
    assert out.choices[0].message.content == "echo: hello there"
    stream = await oai.chat.completions.create(model="fake-model", messages=CHAT["messages"],
                                               stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "echo: hello there"
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model="fake-model", messages=[])
    with pytest.raises(openai.NotFoundError):
        await oai.chat.completions.create(model="nope", messages=CHAT["messages"])
    models = await oai.models.list()
    assert models.data[0].id == "fake-model"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_undecodable_compressed_body_is_400(client, encoding):
    resp = await client.post("/v1/chat/completions", data=b"not compressed",
                             headers={"Content-Encoding": encoding,
                                      "Content-Type": "application/json"})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == "body" and encoding in err["message"]


async def test_compressed_bodies_are_decoded(client):
    import gzip
    import json

    import brotli

    raw = json.dumps({**CHAT, "max_tokens": 20}).encode()
    for encoding, data in (("gzip", gzip.compress(raw)), ("br", brotli.compress(raw))):
        resp = await client.post("/v1/chat/completions", data=data,
                                 headers={"Content-Encoding": encoding,
                                          "Content-Type": "application/json"})
        assert resp.status == 200, encoding
