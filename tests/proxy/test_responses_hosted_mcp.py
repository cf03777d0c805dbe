"""Hosted MCP tools in the Responses API (issue 34 item 3): ``tools: [{"type": "mcp",
...}]`` by ``server_url`` (a configured server's, over Streamable HTTP: the real test
server tests/tools_mcp_server.py) or by the label of a ``[tools.*]`` server; the proxy
runs the loop, the response holds ``mcp_list_tools`` and ``mcp_call`` items and the
stream emits their events in the spec's order; the Agents SDK's ``HostedMCPTool``;
tenants, URLs the config does not allow, ``require_approval``. FakeEngine plays the
model from a script."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from agents import Agent, HostedMCPTool, OpenAIResponsesModel, Runner, set_tracing_disabled
from agents.items import MCPListToolsItem, ToolCallItem
from openai import AsyncOpenAI

from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.proxy.tenants import Tenant
from flowlift.testing import FakeEngine, free_port, tool_calls_text
from flowlift.testing.native import QwenStyleFakeEngine
from tests.openapi_spec import validate, validate_event
from tests.tools_mcp_server import serving_http


@pytest.fixture(scope="module")
def mcp_url():
    port = free_port()
    with serving_http(port):
        yield f"http://127.0.0.1:{port}/mcp"


def adder(request: GenerationRequest) -> str:
    """Calls ``add`` until a result came back, then answers from it."""
    last = request.messages[-1]
    if last.role == "user" and "40+2" in last.content:
        return tool_calls_text(("add", {"a": 40, "b": 2}))
    if last.role == "tool" or "42" in last.content:
        return json.dumps({"content": "40 + 2 is 42."}) if request.constraint else "40 + 2 is 42."
    return "no tools needed"


async def proxy(aiohttp_client, tools: dict[str, Any], tenants: tuple[Tenant, ...] = (),
                engine: Any = None):
    engine = engine or FakeEngine(["fake-model"], responder=adder)
    app = create_app({"fake-model": engine}, ProxyConfig(tenants=tenants),
                     file_config=parse_config({"tools": tools}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client, engine


def mcp_tool(**fields: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "calc", "require_approval": "never", **fields}


async def test_a_hosted_mcp_turn_lists_calls_and_answers(aiohttp_client, mcp_url):
    client, engine = await proxy(aiohttp_client, {"calc": {"url": mcp_url}})
    body = {"model": "fake-model", "input": "What is 40+2?",
            "tools": [mcp_tool(server_url=mcp_url, allowed_tools=["add", "big"])]}
    resp = await client.post("/v1/responses", json=body)
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    validate(out, "Response")
    kinds = [o["type"] for o in out["output"]]
    assert kinds == ["mcp_list_tools", "mcp_call", "message"]
    listing, call, answer = out["output"]
    assert sorted(t["name"] for t in listing["tools"]) == ["add", "big"]  # allowed_tools
    assert listing["server_label"] == "calc" and listing["tools"][0]["input_schema"]
    assert (call["name"], json.loads(call["arguments"]), call["output"], call["status"]) == (
        "add", {"a": 40, "b": 2}, "42", "completed")
    assert answer["content"][0]["text"] == "40 + 2 is 42."
    assert len(engine.requests) == 2  # the proxy ran the loop: call, then the answer
    assert out["usage"]["output_tokens"] > 0 and "headers" not in out["tools"][0]
    # the next turn continues the conversation, the call and its result in it
    nxt = await client.post("/v1/responses", json={
        "model": "fake-model", "previous_response_id": out["id"], "input": "thanks"})
    assert nxt.status == 200, await nxt.text()
    prompt = "\n".join(m.content for m in engine.requests[-1].messages)
    assert "42" in prompt and "thanks" in prompt


async def test_the_stream_emits_the_mcp_events_in_the_spec_s_order(aiohttp_client, mcp_url):
    client, _ = await proxy(aiohttp_client, {"calc": {"url": mcp_url}})
    resp = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "What is 40+2?", "stream": True,
        "tools": [mcp_tool()]})  # by its label: the configured server
    events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
              if line.startswith("data: ")]
    for event in events:
        validate_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    want = ["response.created", "response.in_progress",
            "response.output_item.added", "response.mcp_list_tools.in_progress",
            "response.mcp_list_tools.completed", "response.output_item.done",
            "response.output_item.added", "response.mcp_call_arguments.delta",
            "response.mcp_call_arguments.done", "response.mcp_call.in_progress",
            "response.mcp_call.completed", "response.output_item.done",
            "response.output_item.added", "response.content_part.added",
            "response.output_text.delta"]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed[:len(want)] == want, squeezed
    assert squeezed[-4:] == ["response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    call = final["output"][1]
    ids = {e.get("item_id") for e in events if e["type"].startswith("response.mcp_call")}
    assert ids == {call["id"]} and call["output"] == "42"


async def test_urls_servers_and_approvals_the_proxy_does_not_allow_are_refused(
        aiohttp_client, mcp_url):
    acme = Tenant("acme", frozenset({"sk-acme"}), tools=frozenset({"other"}))
    client, engine = await proxy(aiohttp_client, {"calc": {"url": mcp_url}}, (acme,))
    headers = {"Authorization": "Bearer sk-acme"}
    cases = [
        (mcp_tool(server_url="http://169.254.169.254/mcp"), 403, "tools[0].server_url"),
        (mcp_tool(), 403, "tools[0]"),  # the tenant's key does not reach `calc`
        (mcp_tool(server_label="nope"), 400, "tools[0].server_label"),
        ({**mcp_tool(), "require_approval": "always"}, 400, "tools[0].require_approval"),
        ({k: v for k, v in mcp_tool().items() if k != "require_approval"}, 400,
         "tools[0].require_approval"),  # its default is "always"
        (mcp_tool(connector_id="connector_gmail"), 400, "tools[0].connector_id")]
    for tool, status, param in cases:
        resp = await client.post("/v1/responses", headers=headers, json={
            "model": "fake-model", "input": "What is 40+2?", "tools": [tool]})
        body = await resp.json()
        validate(body, "ErrorResponse")
        assert resp.status == status and body["error"]["param"] == param, body
    assert engine.requests == []


async def test_the_agents_sdk_hosted_mcp_tool_runs_against_the_proxy(aiohttp_client,
                                                                      mcp_url):
    client, engine = await proxy(aiohttp_client, {"calc": {"url": mcp_url}})
    set_tracing_disabled(True)
    oa = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
    agent: Agent[Any] = Agent(
        name="Calc", instructions="Use the calculator.",
        model=OpenAIResponsesModel(model="fake-model", openai_client=oa),
        tools=[HostedMCPTool(tool_config={"type": "mcp", "server_label": "calc",
                                          "server_url": mcp_url,
                                          "require_approval": "never"})])
    result = await Runner.run(agent, "What is 40+2?")
    await oa.close()
    assert result.final_output == "40 + 2 is 42."
    assert any(isinstance(i, MCPListToolsItem) for i in result.new_items)
    (call,) = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    assert call.raw_item.type == "mcp_call" and call.raw_item.output == "42"
    assert len(result.raw_responses) == 1 and len(engine.requests) == 2


async def test_a_model_that_keeps_calling_is_asked_for_the_answer_at_max_tool_calls(
        aiohttp_client, mcp_url):
    client, engine = await proxy(aiohttp_client, {"calc": {"url": mcp_url}})
    engine.responder = lambda r: (tool_calls_text(("add", {"a": 1, "b": 1}))
                                  if r.constraint is not None else "I give up: 2.")
    resp = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "count", "max_tool_calls": 2,
        "tools": [mcp_tool()]})
    out = await resp.json()
    validate(out, "Response")
    assert [o["type"] for o in out["output"]] == [
        "mcp_list_tools", "mcp_call", "mcp_call", "message"]
    assert out["output"][-1]["content"][0]["text"] == "I give up: 2."
    assert len(engine.requests) == 3 and engine.requests[-1].constraint is None  # tools off


async def test_a_turn_cut_inside_its_calls_runs_none_and_the_conversation_goes_on(
        aiohttp_client, mcp_url):
    client, engine = await proxy(aiohttp_client, {"calc": {"url": mcp_url}})
    engine.responder = lambda r: (tool_calls_text(("add", {"a": 1, "b": 1}),
                                                  ("add", {"a": 2, "b": 2}))
                                  if r.messages[-1].content == "sums" else "fine")
    resp = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "sums", "max_output_tokens": 9,
        "tools": [mcp_tool()]})  # cut inside the second call
    out = await resp.json()
    validate(out, "Response")
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    (call,) = [o for o in out["output"] if o["type"] == "mcp_call"]
    assert call["status"] == "failed" and call["output"] is None
    assert call["error"]["content"].startswith("not run")  # the first was not run alone
    assert len(engine.requests) == 1
    nxt = await client.post("/v1/responses", json={
        "model": "fake-model", "previous_response_id": out["id"], "input": "go on",
        "tools": [mcp_tool()]})
    assert nxt.status == 200, await nxt.text()  # no call of the proxy's left unanswered


async def test_the_loop_runs_on_a_chat_upstream_and_adds_up_its_usage(aiohttp_client,
                                                                       mcp_url):
    sent: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        data = json.loads(request.content)
        sent.append(data)
        head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        if data["messages"][-1]["role"] == "tool":
            delta: dict[str, Any] = {"content": f"It is {data['messages'][-1]['content']}."}
            finish = "stop"
        else:
            delta = {"tool_calls": [{"index": 0, "id": "call_u", "type": "function",
                                     "function": {"name": "add",
                                                  "arguments": '{"a": 40, "b": 2}'}}]}
            finish = "tool_calls"
        docs = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                {**head, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4,
                                                  "total_tokens": 14}}]
        body = b"".join(f"data: {json.dumps(d)}\n\n".encode() for d in docs)
        return httpx.Response(200, content=body + b"data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    app = create_app({"fake-model": FakeEngine(["fake-model"])}, file_config=parse_config({
        "backends": {"up": {"kind": "openai", "base_url": "http://up.test/v1",
                            "responses_api": "chat"}},
        "models": {"up-model": {"backends": ["up"]}},
        "tools": {"calc": {"url": mcp_url}}}), transport=httpx.MockTransport(answer))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    resp = await client.post("/v1/responses", json={
        "model": "up-model", "input": "40+2?", "stream": True, "tools": [mcp_tool()]})
    events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
              if line.startswith("data: ")]
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert [o["type"] for o in final["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    assert final["output"][-1]["content"][0]["text"] == "It is 42."
    assert final["usage"]["input_tokens"] == 20 and final["usage"]["output_tokens"] == 8
    assert sent[0]["tools"][0]["function"]["name"] == "add"
    assert sent[1]["messages"][-2]["tool_calls"][0]["id"] == "call_u"  # the call, replayed


@pytest.mark.parametrize("written", [
    '{{"name": "add", "arguments": {"a": 40, "b": 2}}}',
    '```json\n{"name": "add", // the sum\n "arguments": {"a": 40, "b": 2}, "id": None}\n```'])
async def test_the_loop_takes_a_native_call_shaped_answer_that_is_not_json_as_the_call(
        aiohttp_client, mcp_url, written):
    """The native format (a Qwen-style template): the 1.5B's leak forms (doubled braces,
    a // comment and a Python None) are the hosted call, not the turn's answer."""
    engine = QwenStyleFakeEngine(["fake-model"])
    engine.responder = lambda r: "40 + 2 is 42." if r.messages[-1].role == "tool" \
        else written
    client, _ = await proxy(aiohttp_client, {"calc": {"url": mcp_url}}, engine=engine)
    resp = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "What is 40+2?",
        "tools": [mcp_tool(server_url=mcp_url, allowed_tools=["add"])]})
    out = await resp.json()
    assert resp.status == 200, out
    assert [o["type"] for o in out["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    assert out["output"][1]["output"] == "42"
    assert out["output"][2]["content"][0]["text"] == "40 + 2 is 42."


def answers_badly_once(bad: str, then: str = "40 + 2 is 42."):
    """A Qwen-style fake that calls ``add``, then answers ``bad`` after the result, and
    ``then`` once told that was no answer."""
    engine = QwenStyleFakeEngine(["fake-model"])

    def respond(request: GenerationRequest) -> str:
        last = request.messages[-1]
        if last.role == "tool":
            return bad
        if last.role == "user" and last.content.startswith("That was not an answer"):
            return then
        return '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call>'
    engine.responder = respond
    return engine


@pytest.mark.parametrize("bad", ["", "<tool_response>\n42\n</tool_response>"])
async def test_no_answer_after_a_hosted_call_is_asked_again_once(aiohttp_client, mcp_url,
                                                                 bad):
    """Issue 34 item 2 on the hosted-MCP loop: an empty answer or an echoed
    ``<tool_response>`` after an ``mcp_call`` is not the response's message; the
    generation is asked again with the reason, and the second answer is the message."""
    engine = answers_badly_once(bad)
    client, _ = await proxy(aiohttp_client, {"calc": {"url": mcp_url}}, engine=engine)
    resp = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "What is 40+2?", "tools": [mcp_tool()]})
    out = await resp.json()
    assert resp.status == 200, out
    validate(out, "Response")
    assert [o["type"] for o in out["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    assert out["output"][2]["content"][0]["text"] == "40 + 2 is 42."
    assert len(engine.requests) == 3
    told = engine.requests[-1].messages[-1].content
    assert told.startswith("That was not an answer: the answer ") and "call one" in told
    assert engine.requests[-1].messages[-2].content == bad  # what it said, in the retry


async def test_the_retried_answer_streams_its_events_in_order(aiohttp_client, mcp_url):
    engine = answers_badly_once("<tool_response>\n42\n</tool_response>")
    client, _ = await proxy(aiohttp_client, {"calc": {"url": mcp_url}}, engine=engine)
    resp = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "What is 40+2?", "stream": True,
        "tools": [mcp_tool()]})
    text = await resp.text()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    for event in events:
        validate_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "tool_response" not in text  # the rejected answer was never sent
    kinds = [e["type"] for e in events]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed[6:] == [
        "response.output_item.added", "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done", "response.mcp_call.in_progress",
        "response.mcp_call.completed", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.completed"], squeezed
    final = events[-1]
    assert final["type"] == "response.completed"
    assert [o["type"] for o in final["response"]["output"]] == [
        "mcp_list_tools", "mcp_call", "message"]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == final["response"]["output"][2]["content"][0]["text"] == "40 + 2 is 42."


async def test_a_second_no_answer_fails_the_response(aiohttp_client, mcp_url):
    engine = answers_badly_once("", then="{")
    client, _ = await proxy(aiohttp_client, {"calc": {"url": mcp_url}}, engine=engine)
    body = {"model": "fake-model", "input": "What is 40+2?", "tools": [mcp_tool()]}
    resp = await client.post("/v1/responses", json=body)
    out = await resp.json()
    assert resp.status == 502 and out["error"]["code"] == "no_answer", out
    assert "the answer is empty" in out["error"]["message"] or "'{'" in out["error"]["message"]
    resp = await client.post("/v1/responses", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
              if line.startswith("data: ")]
    assert events[-1]["type"] == "response.failed"
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["mcp_list_tools",
                                                                     "mcp_call"]
