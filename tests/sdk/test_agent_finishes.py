"""A loop that finishes (issue 34, item 2): the last allowed turn of an agent step is
asked for the answer with the tools off (``on_max_turns="answer"``), or the step fails
as before (``"raise"``); an answer that is only a fragment of JSON or markup is not the
step's output (the turn is tried once more, with the reason)."""

from __future__ import annotations

import json

import pytest

from flowlift import UserError, WorkflowFailed, step, tool, workflow
from flowlift.graph import LLMNode
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy.workflows.agent import ANSWER_NOW
from flowlift.testing import tool_calls_text
from flowlift.testing.native import QwenStyleFakeEngine


@tool
def search(query: str) -> str:
    """Search the docs."""
    return f"hits for {query}"


@step(tools=[search], max_turns=3)
def agent(question: str):
    return [{"role": "user", "content": question}]


@step(tools=[search], max_turns=2, on_max_turns="raise")
def strict_agent(question: str):
    return [{"role": "user", "content": question}]


def base_url(client) -> str:
    return str(client.make_url("")).rstrip("/")


def record(wf, step_id: str) -> dict:
    return next(r for r in wf.trace if r.get("step_id") == step_id)


def offered(request: GenerationRequest) -> bool:
    """The tools were offered (the constrained protocol's schema)."""
    return request.constraint is not None and "tool_calls" in json.dumps(
        request.constraint.json_schema)


def searching_until_tools_are_off(seen: list[GenerationRequest]):
    """A model that calls ``search`` whenever it may (constrained JSON)."""
    def respond(request: GenerationRequest) -> str:
        seen.append(request)
        if offered(request):
            return tool_calls_text(("search", {"query": f"q{len(seen)}"}))
        return "The csv module."
    return respond


async def test_the_last_turn_answers_with_the_tools_off(client, engine):
    seen: list[GenerationRequest] = []
    engine.responder = searching_until_tools_are_off(seen)
    async with workflow("agent", base_url=base_url(client)) as wf:
        out = agent("Which module reads CSV files?")
    assert out.value == "The csv module."
    assert len(seen) == 3
    last = seen[-1]
    assert not offered(last) and last.constraint is None
    assert last.messages[-1].content == ANSWER_NOW
    # the earlier calls and results reach an engine that takes no tools as text
    assert "hits for q1" in " ".join(m.content for m in last.messages)
    rec = record(wf, "agent_1")
    assert rec["max_turns_reached"] is True
    assert [a["outcome"] for a in rec["attempts"]] == ["tool_calls", "tool_calls", "ok"]


async def test_on_max_turns_raise_fails_as_before(client, engine):
    seen: list[GenerationRequest] = []
    engine.responder = searching_until_tools_are_off(seen)
    with pytest.raises(WorkflowFailed):
        async with workflow("agent", base_url=base_url(client)) as wf:
            out = strict_agent("q")
    assert all(offered(r) for r in seen) and len(seen) == 2
    assert "max_turns=2" in str(wf.failures.get("strict_agent_1"))
    del out


async def test_a_fragment_answer_is_tried_again_with_the_reason(client, engine):
    answers = [json.dumps({"content": "{"}), json.dumps({"content": "The csv module."})]
    seen: list[GenerationRequest] = []

    def respond(request):
        seen.append(request)
        return answers.pop(0)
    engine.responder = respond
    async with workflow("agent", base_url=base_url(client)) as wf:
        out = agent("q")
    assert out.value == "The csv module."
    retry = " ".join(m.content for m in seen[1].messages)
    assert "That was not an answer" in retry and "punctuation or markup" in retry
    assert [a["outcome"] for a in record(wf, "agent_1")["attempts"]] == ["fragment", "ok"]


async def test_two_fragments_fail_the_step(client, engine):
    engine.responder = lambda r: json.dumps({"content": ":["})
    with pytest.raises(WorkflowFailed):
        async with workflow("agent", base_url=base_url(client)) as wf:
            agent("q")
    assert "no answer" in str(wf.failures.get("agent_1"))


async def test_native_format_agent_answers_on_its_last_turn(aiohttp_client):
    from flowlift.proxy import create_app
    from flowlift.proxy.state import STATE

    engine = QwenStyleFakeEngine(["fake-model"])
    seen: list[GenerationRequest] = []

    def respond(request):
        seen.append(request)
        if request.tools:  # always a call, written as JSON as Qwen2.5-Coder does
            return '```json\n{"name": "search", "arguments": {"query": "csv"}}\n```'
        return "csv"
    engine.responder = respond
    app = create_app({"fake-model": engine})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    async with workflow("agent", base_url=base_url(client)):
        out = agent("q")
    assert out.value == "csv"
    assert [bool(r.tools) for r in seen] == [True, True, False]
    prompt = engine.prompt_text(seen[-1])
    assert "<tool_response>\nhits for csv\n</tool_response>" in prompt


def test_on_max_turns_on_the_wire_and_checked():
    msgs = [{"role": "user", "content": [{"text": "q"}]}]
    node = LLMNode(id="a", messages=msgs, tools=[{"name": "t"}], on_max_turns="raise")
    assert node.model_dump()["on_max_turns"] == "raise"
    assert "on_max_turns" not in LLMNode(id="b", messages=msgs).model_dump()
    assert LLMNode(id="c", messages=msgs, tools=[{"name": "t"}]).answers_at_max_turns
    assert not LLMNode(id="d", messages=msgs, tools=[{"name": "t"}],
                       tool_choice="required").answers_at_max_turns
    with pytest.raises(UserError):
        step(tools=[search], on_max_turns="maybe")


async def test_an_empty_answer_after_tool_results_is_tried_again(client, engine):
    answers = [tool_calls_text(("search", {"query": "csv"})), json.dumps({"content": ""}),
               json.dumps({"content": "The csv module."})]
    seen: list[GenerationRequest] = []

    def respond(request):
        seen.append(request)
        return answers.pop(0)
    engine.responder = respond
    async with workflow("agent", base_url=base_url(client)) as wf:
        out = agent("q")
    assert out.value == "The csv module."
    assert "the answer is empty" in seen[-1].messages[-1].content
    assert [a["outcome"] for a in record(wf, "agent_1")["attempts"]] == [
        "tool_calls", "fragment", "ok"]
