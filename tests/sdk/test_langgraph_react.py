"""LangGraph's react agent through flowlift (issue 34, item 4): ``FlowliftChat`` supports
``bind_tools`` (a call with tools is a chat completion on the proxy, answered in the
model's tool-call format) and ``with_structured_output`` (a step with the schema as its
contract); ``create_react_agent`` with a ``ToolNode`` runs end to end."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool as lc_tool
from langgraph.prebuilt import ToolNode, create_react_agent
from pydantic import BaseModel

from flowlift import UserError
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.state import STATE
from flowlift.sdk.langchain import FlowliftChat
from flowlift.testing.native import QwenStyleFakeEngine

SEARCHED: list[str] = []


@lc_tool
def search(query: str) -> str:
    """Search the Python docs."""
    SEARCHED.append(query)
    return "csv: CSV File Reading and Writing"


def responder(engine: QwenStyleFakeEngine, seen: list[GenerationRequest]):
    def respond(request: GenerationRequest) -> str:
        seen.append(request)
        prompt = engine.prompt_text(request)
        if request.constraint is not None:  # a structured step
            return json.dumps({"module": "csv", "reason": "it reads CSV"})
        if "<tool_response>" in prompt:
            return "The csv module."
        return '<tool_call>\n{"name": "search", "arguments": {"query": "csv"}}\n</tool_call>'
    return respond


@pytest.fixture
async def proxy(aiohttp_client):
    engine = QwenStyleFakeEngine(["qwen"])
    seen: list[GenerationRequest] = []
    engine.responder = responder(engine, seen)
    app = create_app({"qwen": engine})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    SEARCHED.clear()
    return str(client.make_url("")).rstrip("/"), engine, seen


async def test_create_react_agent_with_a_tool_node_runs_through_flowlift(proxy):
    base_url, engine, seen = proxy
    llm = FlowliftChat(model="qwen", base_url=base_url)
    agent = create_react_agent(llm, ToolNode([search]))
    state = await agent.ainvoke({"messages": [("user", "Which module reads CSV files?")]})
    kinds = [type(m).__name__ for m in state["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    call_msg, result, answer = state["messages"][1:]
    assert isinstance(call_msg, AIMessage) and call_msg.tool_calls[0]["name"] == "search"
    assert call_msg.tool_calls[0]["args"] == {"query": "csv"}
    assert isinstance(result, ToolMessage) and "CSV File" in result.content
    assert answer.content == "The csv module."
    assert SEARCHED == ["csv"]
    assert all(r.tools for r in seen)  # each turn offered the tool, natively
    assert "<tool_response>\ncsv: CSV File Reading and Writing" in engine.prompt_text(seen[1])


class Answer(BaseModel):
    module: str
    reason: str


async def test_with_structured_output_is_a_step_with_the_schema_as_contract(proxy, monkeypatch):
    base_url, _engine, seen = proxy
    monkeypatch.setenv("FLOWLIFT_BASE_URL", base_url)
    out = await FlowliftChat(model="qwen").with_structured_output(Answer).ainvoke(
        "Which module reads CSV files?")
    assert out == Answer(module="csv", reason="it reads CSV")
    assert seen[-1].constraint is not None and seen[-1].constraint.json_schema


def test_bind_tools_options_and_unsupported_ones():
    llm = FlowliftChat(model="qwen")
    bound = llm.bind_tools([search], tool_choice="any")
    assert bound.kwargs["tool_choice"] == "required"  # type: ignore[attr-defined]
    assert bound.kwargs["tools"][0]["function"]["name"] == "search"  # type: ignore[attr-defined]
    named = llm.bind_tools([search], tool_choice="search")
    assert named.kwargs["tool_choice"] == {  # type: ignore[attr-defined]
        "type": "function", "function": {"name": "search"}}
    with pytest.raises(UserError):
        llm.with_structured_output(Answer, include_raw=True)


async def test_a_call_with_tools_and_no_model_takes_the_proxys_first(proxy):
    base_url, _, seen = proxy
    message = await FlowliftChat(base_url=base_url).bind_tools([search]).ainvoke("csv?")
    assert message.tool_calls[0]["name"] == "search"
    assert seen[-1].model == "qwen"
