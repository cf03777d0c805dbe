"""The Responses API on an upstream that speaks chat completions only
(``responses_api = "chat"``): the proxy translates each turn into a chat completions
request (the upstream mocked with ``httpx.MockTransport``), keeps the conversation
itself, and translates the streamed answer back."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine
from tests.openapi_spec import upstream_chunks, validate, validate_event

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def config(responses_api: str) -> Any:
    return parse_config({
        "backends": {"up": {"kind": "openai", "base_url": "http://up.test/v1",
                            "responses_api": responses_api, "failures_to_cool": 1000}},
        "models": {"up-model": {"backends": ["up"], "max_attempts": 1}}})


@pytest.fixture
async def upstream(aiohttp_client):
    seen: list[tuple[str, dict[str, Any]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        data = json.loads(request.content)
        seen.append((request.url.path, data))
        events = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in upstream_chunks(data))
        return httpx.Response(200, content=events + b"data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    app = create_app({"fake-model": FakeEngine(["fake-model"])},
                     file_config=config("chat"), transport=httpx.MockTransport(answer))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client, seen


async def test_a_turn_becomes_a_chat_completion_and_the_answer_a_response(upstream):
    client, seen = upstream
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
    first = await oa.responses.create(model="up-model", input="hi", instructions="Be kind.",
                                      max_output_tokens=50, temperature=0.5)
    path, sent = seen[-1]
    assert path == "/v1/chat/completions"
    assert sent["messages"] == [{"role": "system", "content": "Be kind."},
                                {"role": "user", "content": "hi"}]
    assert (sent["max_completion_tokens"], sent["temperature"], sent["stream"]) == (
        50, 0.5, True)
    assert first.output_text == "upstream says hi" and first.usage.input_tokens == 3
    validate(await (await client.get(f"/v1/responses/{first.id}")).json(), "Response")
    second = await oa.responses.create(model="up-model", input="weather?", tools=[WEATHER],
                                       previous_response_id=first.id)
    _, sent = seen[-1]
    assert [m["content"] for m in sent["messages"]] == ["hi", "upstream says hi", "weather?"]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER["parameters"]}}]
    (call,) = second.output
    assert (call.type, call.name, call.call_id) == ("function_call", "get_weather",
                                                    "call_up0")
    third = await client.post("/v1/responses", json={
        "model": "up-model", "previous_response_id": second.id, "stream": True,
        "input": [{"type": "function_call_output", "call_id": "call_up0", "output": "rain"}]})
    assert third.headers["X-Flowlift-Backend"] == "up"
    events = [json.loads(line[6:]) for line in (await third.text()).splitlines()
              if line.startswith("data: ")]
    for event in events:
        validate_event(event)
    _, sent = seen[-1]
    assert sent["messages"][-2]["tool_calls"][0]["id"] == "call_up0"
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": "call_up0",
                                    "content": "rain"}
    assert events[-1]["type"] == "response.completed"


async def test_a_native_upstream_still_gets_the_request_as_sent(aiohttp_client):
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, json={"id": "resp_up", "object": "response"})

    app = create_app({"fake-model": FakeEngine(["fake-model"])},
                     file_config=config("native"), transport=httpx.MockTransport(answer))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    resp = await client.post("/v1/responses", json={"model": "up-model", "input": "hi"})
    assert (await resp.json())["id"] == "resp_up" and seen == ["/v1/responses"]


async def test_a_model_mixing_native_and_chat_upstreams_is_served_by_the_proxy(
        aiohttp_client):
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        data = json.loads(request.content)
        events = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in upstream_chunks(data))
        return httpx.Response(200, content=events + b"data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    backends = {name: {"kind": "openai", "base_url": f"http://{name}.test/v1",
                       "responses_api": kind} for name, kind in (("a", "native"),
                                                                 ("b", "chat"))}
    app = create_app({"fake-model": FakeEngine(["fake-model"])}, file_config=parse_config({
        "backends": backends, "models": {"up-model": {"backends": ["a"],
                                                      "fallbacks": ["b"]}}}),
        transport=httpx.MockTransport(answer))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    resp = await client.post("/v1/responses", json={"model": "up-model", "input": "hi"})
    assert (await resp.json())["output"][0]["content"][0]["text"] == "upstream says hi"
    assert seen == ["/v1/chat/completions"]  # the native one speaks chat completions too


async def test_the_turns_of_a_conversation_stay_on_one_replica(aiohttp_client):
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        data = json.loads(request.content)
        events = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in upstream_chunks(data))
        return httpx.Response(200, content=events + b"data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    replicas = {name: {"kind": "openai", "base_url": f"http://{name}.test/v1",
                       "responses_api": "chat"} for name in ("a", "b")}
    app = create_app({"fake-model": FakeEngine(["fake-model"])}, file_config=parse_config({
        "backends": replicas, "models": {"up-model": {"backends": ["a", "b"],
                                                      "routing": "least-loaded"}}}),
        transport=httpx.MockTransport(answer))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    homes = set()
    for _ in range(16):  # conversations: each lands on one replica, keyed by its id
        previous, hosts = None, set()
        for turn in range(3):
            resp = await client.post("/v1/responses", json={
                "model": "up-model", "input": f"turn {turn}",
                **({"previous_response_id": previous} if previous else {})})
            previous = (await resp.json())["id"]
            hosts.add(resp.headers["X-Flowlift-Backend"])
        assert len(hosts) == 1
        homes |= hosts
    assert homes == {"a", "b"}  # (by the conversation: not one replica for everything)
