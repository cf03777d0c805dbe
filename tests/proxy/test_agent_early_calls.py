"""Proxy tool calls of an agent step and the turn that asked for them (issue 34 item 5),
against the real test MCP server over Streamable HTTP (tests/tools_mcp_server.py, each
call counted in its ``COUNT_FILE``): a call starts while the turn still streams only
for a tool annotated read-only or idempotent (or a server configured ``early =
"always"``); a turn cut off at ``max_tokens`` inside its second call is run again with
a larger budget (the first call's early start traced and not run twice) or fails with
the reason, never running the first call and dropping the second."""

from __future__ import annotations

import pytest

from flowlift import WorkflowFailed, proxy_tool, step, workflow
from flowlift.errors import EngineError
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, free_port, tool_calls_text
from tests.tools_mcp_server import serving_http

TWO_CALLS = tool_calls_text(("lookup", {"key": "a"}), ("add", {"a": 1, "b": 2}))


@pytest.fixture
def counted(tmp_path):
    port, count = free_port(), tmp_path / "count.txt"
    with serving_http(port, env={"COUNT_FILE": str(count)}):
        yield f"http://127.0.0.1:{port}/mcp", count


async def proxy(aiohttp_client, engine: FakeEngine, url: str, **server: object) -> str:
    app = create_app({"fake-model": engine},
                     file_config=parse_config({"tools": {"calc": {"url": url, **server}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return str(client.make_url("")).rstrip("/")


def scripted(*answers: str):
    queue = list(answers)

    def respond(request: GenerationRequest) -> str:
        return queue.pop(0) if len(queue) > 1 else queue[0]
    return respond


def agent_step(**params: object):
    """The agent step of these tests: the server's ``lookup`` and ``add``."""
    @step(tools=[proxy_tool("calc.lookup"), proxy_tool("calc.add")], max_turns=3,
          **params)  # type: ignore[call-overload]
    def agent(q):
        return q
    return agent


def record_of(wf, step_id: str) -> dict:
    return next(r for r in wf.trace if r.get("step_id") == step_id)


async def test_only_read_only_or_idempotent_tools_start_while_the_turn_streams(
        aiohttp_client, counted):
    url, count = counted
    padding = "p" * 300
    engine = FakeEngine(["fake-model"], delay_s=0.01, responder=scripted(
        tool_calls_text(("lookup", {"key": "a"}), ("add", {"a": 1, "b": 2}),
                        ("lookup", {"key": padding})), "done"))

    agent = agent_step(max_tokens=None)

    base = await proxy(aiohttp_client, engine, url)
    async with workflow("early", base_url=base) as wf:
        out = agent("go")
    assert out.value == "done"
    record = record_of(wf, "agent_1")
    turn1 = next(a for a in record["attempts"] if a["turn"] == 1)
    calls = {(c["name"], i): c for i, c in enumerate(record["tool_calls"])}
    lookup, add = calls["lookup", 0], calls["add", 1]
    assert lookup["wanted_ms"] < turn1["finished_ms"] - 200  # read-only: started early
    assert add["wanted_ms"] >= turn1["finished_ms"]  # not annotated: after the turn
    assert sorted(count.read_text().splitlines()) == ["1+2", "lookup a", f"lookup {padding}"]
    # `early = "always"` starts the unannotated tool early too
    engine.responder = scripted(tool_calls_text(("add", {"a": 1, "b": 2}),
                                                ("lookup", {"key": padding})), "done")
    base = await proxy(aiohttp_client, engine, url, early="always")
    async with workflow("early2", base_url=base) as wf:
        agent("go")
    record = record_of(wf, "agent_1")
    turn1 = next(a for a in record["attempts"] if a["turn"] == 1)
    assert record["tool_calls"][0]["wanted_ms"] < turn1["finished_ms"] - 200


async def test_a_turn_cut_inside_its_second_call_runs_again_with_a_larger_budget(
        aiohttp_client, counted):
    url, count = counted
    engine = FakeEngine(["fake-model"], responder=scripted(TWO_CALLS, TWO_CALLS, "1+2 is 3."))

    agent = agent_step(max_tokens=9)  # the cut falls inside the second call

    base = await proxy(aiohttp_client, engine, url)
    async with workflow("cut", base_url=base) as wf:
        out = agent("go")
    assert out.value == "1+2 is 3."
    budgets = [r.sampling.max_tokens for r in engine.requests]
    assert budgets == [9, 18, 9]  # the cut turn again, twice the budget; then the answer
    record = record_of(wf, "agent_1")
    outcomes = [(c["call_id"].rsplit(":", 1)[1], c["name"], c["outcome"])
                for c in record["tool_calls"]]
    assert outcomes == [("early_1", "lookup", "early_unused"), ("call_1", "lookup", "ok"),
                        ("call_2", "add", "ok")]
    cut = [a for a in record["attempts"] if a.get("outcome") == "cut_off"]
    assert len(cut) == 1 and "inside its tool calls" in cut[0]["error"]
    # the read-only call started early in the cut turn ran once: the retry took its result
    assert sorted(count.read_text().splitlines()) == ["1+2", "lookup a"]


async def test_a_turn_cut_inside_its_calls_with_no_room_left_fails_with_the_reason(
        aiohttp_client, counted):
    url, count = counted
    engine = FakeEngine(["fake-model"], responder=scripted(TWO_CALLS))

    agent = agent_step(max_tokens=9, max_tokens_ceiling=9)

    base = await proxy(aiohttp_client, engine, url)
    with pytest.raises(WorkflowFailed, match="cut off at max_tokens=9 inside its tool calls"):
        async with workflow("cut2", base_url=base):
            agent("go")
    assert len(engine.requests) == 1
    assert "1+2" not in (count.read_text() if count.exists() else "")  # add never ran


async def test_an_early_call_of_a_turn_that_fails_is_traced(aiohttp_client, counted):
    url, count = counted
    engine = FakeEngine(["fake-model"], responder=scripted(TWO_CALLS), delay_s=0.02,
                        fail_with=EngineError("the engine fell over"), fail_after_chunks=22)

    agent = agent_step()

    base = await proxy(aiohttp_client, engine, url)
    with pytest.raises(WorkflowFailed, match="fell over"):
        async with workflow("fails", base_url=base) as wf:
            agent("go")
    (call,) = record_of(wf, "agent_1")["tool_calls"]
    assert (call["name"], call["outcome"]) == ("lookup", "early_unused")
    assert "its generation failed" in call["error"]
    assert count.read_text().splitlines() == ["lookup a"]  # started once, early
