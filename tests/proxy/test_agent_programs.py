"""Framework traffic on the agent path (issue 34, item 4): an agent step's keep mark is
set under the program key its turns are scheduled by (a named tenant's run key), and a
Responses turn joins a program (its conversation) and keeps its KV while its function
calls are out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from flowlift import WorkflowFailed, step, tool, workflow
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.dispatch.slots.programs import ProgramBook
from flowlift.proxy.state import STATE
from flowlift.proxy.tenants import Tenant
from flowlift.testing import FakeEngine, tool_calls_text

ACME = "sk-acme-agents"


@tool
def shell(command: str) -> str:
    """Run a shell command."""
    return "ok"


@step(tools=[shell], max_turns=3, tool_choice="required")
def agent(task: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": task}]


def book_of(client: Any) -> ProgramBook:
    return client.app[STATE].backends.backends[0].slots.programs


@pytest.fixture
async def tenant_client(aiohttp_client):
    engine = FakeEngine(["fake-model"])
    app = create_app({"fake-model": engine},
                     ProxyConfig(tenants=(Tenant("acme", frozenset({ACME})),)))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client, engine


async def test_a_named_tenants_agent_step_clears_its_keep_marks(tenant_client):
    client, engine = tenant_client
    engine.responder = lambda request: tool_calls_text(("shell", {"command": "ls"}))
    base = str(client.make_url("")).rstrip("/")
    with pytest.raises(WorkflowFailed):
        async with workflow("agents", base_url=base, api_key=ACME) as wf:
            agent("look around")
    book = book_of(client)
    assert f"acme/{wf.run_id}" in book._table  # the tenant's run key is the program
    assert book.marks == 2  # one per tool round that was out
    assert book.keeping() == 0  # each mark ended when the next turn came (not the TTL)


TOOLS = [{"type": "function", "name": "shell", "description": "Run a shell command.",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}]


async def test_responses_turns_join_their_conversations_program(client, engine):
    engine.responder = lambda request: (
        "done" if "Result of shell" in engine.prompt_text(request)
        else tool_calls_text(("shell", {"command": "ls"})))
    first = await (await client.post("/v1/responses", json={
        "model": "fake-model", "input": "look around", "tools": TOOLS})).json()
    call = next(o for o in first["output"] if o["type"] == "function_call")
    book = book_of(client)
    assert book.marks == 1 and book.keeping() == 1  # its call is out: KV kept
    conversation = first["id"]
    assert book._table[conversation].calls == 1
    second = await (await client.post("/v1/responses", json={
        "model": "fake-model", "previous_response_id": first["id"], "tools": TOOLS,
        "input": [{"type": "function_call_output", "call_id": call["call_id"],
                   "output": "ok"}]})).json()
    assert second["output"][-1]["content"][0]["text"] == "done"
    assert book._table[conversation].calls == 2  # the same program
    assert book.keeping() == 0  # the next turn came: the mark ended


CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                 if k != "type"}}]


async def test_a_session_tagged_chat_completion_prefills_its_next_turn(client, engine):
    engine.responder = lambda request: (
        "done" if "Result of shell" in engine.prompt_text(request)
        else tool_calls_text(("shell", {"command": "ls"})))
    messages = [{"role": "user", "content": "look around " * 40}]
    headers = {"X-Flowlift-Session": "s-ahead"}
    first = await (await client.post("/v1/chat/completions", headers=headers, json={
        "model": "fake-model", "messages": messages, "tools": CHAT_TOOLS})).json()
    call = first["choices"][0]["message"]["tool_calls"][0]
    for _ in range(100):
        if engine.prefilled:
            break
        await asyncio.sleep(0.01)
    (_, prefix), = engine.prefills  # the next turn, as far as it is known
    assert "look around" in prefix and '"shell"' in prefix
    second = await (await client.post("/v1/chat/completions", headers=headers, json={
        "model": "fake-model", "tools": CHAT_TOOLS, "messages": [
            *messages, first["choices"][0]["message"],
            {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]})).json()
    assert second["choices"][0]["message"]["content"] == "done"
    assert engine.prompt_text(engine.requests[-1]).startswith(prefix)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix.split()) - 1
