"""Framework traffic on the agent path (issue 34, item 4): an agent step's keep mark is
set under the program key its turns are scheduled by (a named tenant's run key), and a
Responses turn joins a program (its conversation) and keeps its KV while its function
calls are out."""

from __future__ import annotations

from typing import Any

import pytest

from flowlift import WorkflowFailed, step, tool, workflow
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.dispatch.programs import ProgramBook
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
