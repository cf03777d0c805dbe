"""bench/peers' agent arm (issue 35, P7 c): each session's proxy tool waits the session's
drawn tool waits and returns the chat arms' tool results in turn order, and a session
run as one agent step on a fake engine takes its planned turns (N-1 forced calls, then
the answer), with each turn's tokens in the chat arms' row shape."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.agent_session import tool_result
from bench.peers import agent_arm, workload
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.proxy.tools.callables import CallableServer
from flowlift.testing import FakeEngine


class Sleeps:
    """An injected sleep: records each wait, and lets concurrent calls overlap."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        await asyncio.sleep(0)


async def test_the_nth_turn_waits_the_nth_drawn_wait_and_returns_the_nth_result():
    sleeps = Sleeps()
    tools = agent_arm.SessionTools({"a": [0.5, 1.25], "b": [0.3]}, sleep=sleeps)
    assert await tools.call("a") == tool_result(0)
    assert await tools.call("b") == tool_result(0)
    assert await tools.call("a") == tool_result(1)
    assert await tools.call("a") == tool_result(2)  # past the plan: no wait
    assert sleeps.waits == [0.5, 0.3, 1.25, 0.0]
    assert tools.log == [("a", 0), ("b", 0), ("a", 1), ("a", 2)]


async def test_calls_of_one_turn_share_its_index():
    sleeps = Sleeps()
    tools = agent_arm.SessionTools({"a": [0.5, 1.0]}, sleep=sleeps)
    both = await asyncio.gather(tools.call("a"), tools.call("a"))  # one turn, two calls
    assert both == [tool_result(0)] * 2
    assert await tools.call("a") == tool_result(1)  # the next turn
    assert sleeps.waits == [0.5, 0.5, 1.0]


def test_tool_names_are_identifiers_and_the_config_names_each_session(tmp_path):
    plans = workload.plan(3, seed=0, tag="p7x3-")
    names = [agent_arm.tool_name(p.sid) for p in plans]
    assert all(n.isidentifier() for n in names) and len(set(names)) == 3
    assert agent_arm.tool_name("7-a") == "s_7_a"
    text = agent_arm.config_text(plans)
    for n in names:
        assert f'"bench.peers.agent_arm:{n}"' in text
    agent_arm.write_plan(tmp_path / "plan.json", plans)
    with pytest.raises(ValueError, match="share a tool name"):
        agent_arm.write_plan(tmp_path / "x.json", [plans[0], plans[0]])


@pytest.fixture
def plan_file(tmp_path, monkeypatch):
    plans = [workload.SessionPlan("p7x2-0-00", 0.0, (0.01, 0.02, 0.01)),
             workload.SessionPlan("p7x2-0-01", 0.0, (0.02,))]
    path = tmp_path / "plan.json"
    agent_arm.write_plan(path, plans)
    monkeypatch.setenv(agent_arm.PLAN_ENV, str(path))
    yield plans
    agent_arm._session_tools.cache_clear()


async def test_the_proxy_loads_each_sessions_tool_from_the_plan_file(plan_file):
    name = agent_arm.tool_name(plan_file[0].sid)
    server = CallableServer("peers", [f"bench.peers.agent_arm:{name}"])
    listed = await server.tools()
    assert list(listed) == [name] and not listed[name].parameters.get("required")
    first = await server.call(name, {})
    assert first.error is None and first.value == tool_result(0)
    assert (await server.call(name, {})).value == tool_result(1)
    with pytest.raises(AttributeError, match="no session"):
        agent_arm.__getattr__("nobody")


async def test_a_session_as_one_agent_step_takes_its_planned_turns(aiohttp_client,
                                                                   plan_file):
    engine = FakeEngine(["fake-model"])
    seen: list[GenerationRequest] = []  # the fake's own answers: calls, then words
    original = engine.generate

    def recording(request: GenerationRequest, *a, **k):
        seen.append(request)
        return original(request, *a, **k)
    engine.generate = recording  # type: ignore[method-assign]
    cfg = parse_config({"tools": {"peers": {"callables": [
        f"bench.peers.agent_arm:{agent_arm.tool_name(p.sid)}" for p in plan_file]}}})
    app = create_app({"fake-model": engine}, file_config=cfg)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    base = str(client.make_url("")).rstrip("/")
    got = await agent_arm.run_sessions(base, "fake-model", plan_file, "arm", 40)
    first, second = got
    assert first["error"] is None and second["error"] is None, got
    assert first["sid"] == "arm-p7x2-0-00"
    assert (first["turns_taken"], first["tool_calls"]) == (4, 3)
    assert (second["turns_taken"], second["tool_calls"]) == (2, 1)
    assert [r["outcome"] for r in first["rows"]] == ["tool_calls"] * 3 + ["ok"]
    assert all(r["prompt_tokens"] > 0 for r in first["rows"])
    rows = first["rows"]
    assert rows[1]["reusable_tokens"] == rows[0]["prompt_tokens"] + rows[0]["completion_tokens"]
    last = [r for r in seen if "Session arm-p7x2-0-00" in r.messages[0].content][-1]
    text = "\n".join(m.content or "" for m in last.messages)
    at = [text.find(tool_result(n)) for n in range(3)]  # each turn's result, in order
    assert -1 not in at and at == sorted(at), at
    assert not last.tools  # the answer: asked with the tools off
    # one call a turn: the forced call array holds one (parallel_tool_calls=False)
    assert seen and not any(r.parallel_tool_calls for r in seen)
    counts = agent_arm.turn_counts(got)
    assert counts["turns_taken"] == counts["turns_planned"] == 6
    assert counts["tool_calls"] == counts["calls_planned"] == 4
    assert counts["sessions_off_plan"] == 0
    assert first["tool_wait_s"] == 0.04


def test_parallel_tool_calls_is_on_the_agent_node_and_off_the_wire_by_default():
    from flowlift import proxy_tool, step, workflow

    @step(tools=[proxy_tool("peers.a")], tool_choice="required", parallel_tool_calls=False)
    def one(q: str) -> str:
        return q

    @step(tools=[proxy_tool("peers.a")])
    def many(q: str) -> str:
        return q

    with workflow("w", submit=False) as wf:
        one("x")
        many("y")
    nodes = {n["name"]: n for n in wf.graph().model_dump(mode="json", by_alias=True)["nodes"]}
    assert nodes["one"]["parallel_tool_calls"] is False
    assert "parallel_tool_calls" not in nodes["many"]  # the default: not on the wire
