"""The Responses API served by the proxy (issue 25): the official ``openai`` client's
``responses.create`` / ``stream`` / ``retrieve`` / ``delete`` against the proxy on a
FakeEngine, ``previous_response_id`` (the proxy keeps the conversation; a turn sends only
its delta and its prefix is served from cache), function tools, ``text.format``, the
shapes against OpenAI's published description, tenants and errors."""

from __future__ import annotations

import json

import openai
import pytest

from flowlift.errors import EngineError
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.state import STATE
from flowlift.proxy.tenants import Tenant
from flowlift.testing import FakeEngine, default_responder, tool_calls_text
from tests.openapi_spec import validate, validate_event

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": False}


def last_text(request: GenerationRequest) -> str:
    return request.messages[-1].content if request.messages else ""


def scripted(request: GenerationRequest) -> str:
    """Calls get_weather when tools are offered and no tool result came back yet."""
    if request.constraint is not None and "tool_calls" in json.dumps(
            request.constraint.json_schema) and "sunny" not in last_text(request):
        return tool_calls_text(("get_weather", {"city": "Paris"}))
    if request.constraint is not None and "tool_calls" in json.dumps(
            request.constraint.json_schema):
        return json.dumps({"content": "It is sunny in Paris."})
    return default_responder(request)


@pytest.fixture
async def served(aiohttp_client):
    engine = FakeEngine(["fake-model"], responder=scripted)
    app = create_app({"fake-model": engine})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
    yield client, oa, engine
    await oa.close()


async def test_create_then_continue_with_previous_response_id_sends_only_the_delta(served):
    client, oa, engine = served
    first = await oa.responses.create(model="fake-model", input="hello there",
                                      instructions="Be brief.", metadata={"k": "v"})
    assert first.status == "completed" and first.output_text == "echo: hello there"
    assert first.metadata == {"k": "v"} and first.instructions == "Be brief."
    second = await oa.responses.create(model="fake-model", input="and again",
                                       instructions="Be brief.",  # (not carried over)
                                       previous_response_id=first.id)
    assert second.output_text == "echo: and again"
    sent = engine.requests[-1].messages  # the proxy prepended the stored conversation
    assert [(m.role, m.content) for m in sent] == [
        ("system", "Be brief."), ("user", "hello there"), ("assistant", "echo: hello there"),
        ("user", "and again")]
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    assert engine.requests[-1].session_id == first.id  # the conversation's engine session
    got = await oa.responses.retrieve(second.id)
    assert got.id == second.id and got.previous_response_id == first.id
    items = await (await client.get(f"/v1/responses/{second.id}/input_items")).json()
    validate(items, "ResponseItemList")
    assert [i["content"][0]["text"] for i in items["data"]] == ["and again"]
    validate(await (await client.get(f"/v1/responses/{second.id}")).json(), "Response")
    # every turn of the conversation is a step of one inferred workflow run
    wf = await (await client.get(f"/v1/workflows/{first.id}")).json()
    assert len(wf["graph"]["nodes"]) == 2


async def test_responses_and_stream_events_validate_against_the_spec(served):
    client, _, _ = served
    body = {"model": "fake-model", "input": "hi", "tools": [WEATHER]}
    plain = await (await client.post("/v1/responses", json=body)).json()
    validate(plain, "Response")
    resp = await client.post("/v1/responses", json={**body, "stream": True})
    text = await resp.text()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert names == [e["type"] for e in events]
    for event in events:
        validate_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert names[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert "response.function_call_arguments.delta" in names
    assert names[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert events[-1]["response"]["usage"]["output_tokens"] > 0


async def test_the_request_shapes_served_are_the_spec_s_and_each_is_answered(served):
    client, _, _ = served
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    bodies = [
        {"model": "fake-model", "input": "hi", "instructions": "Be brief.",
         "max_output_tokens": 16, "temperature": 0.5, "top_p": 0.9, "store": False,
         "metadata": {"k": "v"}},
        {"model": "fake-model", "input": [
            {"role": "system", "content": "sys"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
         "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
         "parallel_tool_calls": False},
        {"model": "fake-model", "input": "n?", "text": {"format": {
            "type": "json_schema", "name": "n", "schema": schema}}},
        {"model": "fake-model", "input": "x", "text": {"format": {"type": "json_object"}},
         "stream": True}]
    for body in bodies:
        validate(body, "CreateResponse")
        resp = await client.post("/v1/responses", json=body)
        assert resp.status == 200, await resp.text()


async def test_function_tools_round_trip_with_function_call_output(served):
    _, oa, engine = served
    first = await oa.responses.create(model="fake-model", input="weather?", tools=[WEATHER])
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = await oa.responses.create(
        model="fake-model", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == "It is sunny in Paris."
    rendered = [m.content for m in engine.requests[-1].messages]
    assert any("get_weather" in m for m in rendered) and "sunny" in rendered[-1]
    # the call sent again with its output (some clients do) is not in the prompt twice
    again = await oa.responses.create(
        model="fake-model", previous_response_id=first.id, tools=[WEATHER], input=[
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert again.output_text == "It is sunny in Paris."
    assert [m.content for m in engine.requests[-1].messages] == rendered


async def test_streaming_with_the_client_and_text_format_json_schema(served):
    _, oa, engine = served
    async with oa.responses.stream(model="fake-model", input="hi there") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == "echo: hi there"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    typed = await oa.responses.create(model="fake-model", input="a number", text={
        "format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}})
    assert engine.requests[-1].constraint.json_schema == schema  # constrained decoding
    assert isinstance(json.loads(typed.output_text)["n"], int)
    stream = await oa.responses.create(model="fake-model", input="x", stream=True,
                                       previous_response_id=typed.id)
    kinds = [e.type async for e in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


async def test_max_output_tokens_ends_incomplete_with_usage(served):
    client, _, _ = served
    resp = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "a long prompt to echo back", "max_output_tokens": 2,
        "stream": True})
    events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
              if line.startswith("data: ")]
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 2


async def test_unknown_expired_deleted_and_unstored_ids_are_404_naming_the_field(served):
    client, oa, _ = served
    with pytest.raises(openai.NotFoundError) as err:
        await oa.responses.create(model="fake-model", input="x",
                                  previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"
    assert "resp_nope" in err.value.body["message"]
    unstored = await oa.responses.create(model="fake-model", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        await oa.responses.retrieve(unstored.id)
    kept = await oa.responses.create(model="fake-model", input="x")
    await oa.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        await oa.responses.retrieve(kept.id)
    missing = await client.get("/v1/responses/resp_nope")
    assert missing.status == 404
    validate(await missing.json(), "ErrorResponse")
    bad = await client.post("/v1/responses", json={"model": "fake-model", "input": [
        {"type": "web_search_call", "id": "w"}]})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "input[0].type"
    tool = await client.post("/v1/responses", json={"model": "fake-model", "input": "x",
                                                   "tools": [{"type": "web_search"}]})
    assert (await tool.json())["error"]["param"] == "tools[0].type"
    for body, param in (
            ({}, "input"),
            ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                      "image_url": "x"}]}]},
             "input[0].content[0].type"),
            ({"input": "x", "text": {"format": {"type": "json_schema",
                                                "schema": {"type": "nope"}}}},
             "text.format.schema"),
            ({"input": "x", "max_output_tokens": 0}, "max_output_tokens")):
        resp = await client.post("/v1/responses", json={"model": "fake-model", **body})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == param, error
        assert "response_format" not in error["message"]  # named as the client sent it


async def test_a_response_of_one_tenant_is_invisible_to_another(aiohttp_client):
    config = ProxyConfig(tenants=(Tenant("a", frozenset({"key-a"})),
                                  Tenant("b", frozenset({"key-b"}))))
    app = create_app({"fake-model": FakeEngine(["fake-model"])}, config)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    url = str(client.make_url("/v1"))
    a = openai.AsyncOpenAI(base_url=url, api_key="key-a", max_retries=0)
    b = openai.AsyncOpenAI(base_url=url, api_key="key-b", max_retries=0)
    mine = await a.responses.create(model="fake-model", input="secret")
    assert (await a.responses.retrieve(mine.id)).id == mine.id
    with pytest.raises(openai.NotFoundError):
        await b.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        await b.responses.create(model="fake-model", input="x", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        await b.responses.delete(mine.id)


async def test_a_failure_mid_stream_ends_with_response_failed_and_is_not_stored(
        aiohttp_client):
    engine = FakeEngine(["fake-model"], fail_with=EngineError("engine fell over"),
                        fail_after_chunks=2)
    app = create_app({"fake-model": engine})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    resp = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "a prompt long enough to stream", "stream": True})
    events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
              if line.startswith("data: ")]
    last = events[-1]
    validate_event(last)
    assert last["type"] == "response.failed" and "usage" in last["response"]
    assert last["response"]["error"] == {"code": "server_error",
                                         "message": "engine fell over"}
    gone = await client.get(f"/v1/responses/{last['response']['id']}")
    assert gone.status == 404
    engine.fail_after_chunks = 0  # before the first token: an HTTP error, not a 200
    plain = await client.post("/v1/responses", json={"model": "fake-model", "input": "x"})
    assert plain.status == 503 and (await plain.json())["error"]["code"] == "engine_error"
