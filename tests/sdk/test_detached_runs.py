"""Detached runs (issue 17 section 3): a run that outlives its script -- never swept
for want of a listener, not parked after a restart; submitted with
``workflow(..., detach=True)``, followed later with ``flowlift.attach`` / ``aattach``,
its outputs written by ``flowlift result``."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel

import flowlift
from flowlift import WorkflowFailed, step, tool, workflow
from flowlift.cli import main
from flowlift.cli.runs import show_text
from flowlift.costs import CostTracker
from flowlift.errors import SemanticVariableError
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.store.events import EventLog
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.workflows.planning import plan
from flowlift.proxy.workflows.registry import RunRegistry
from flowlift.testing import FakeEngine

GONE = "http://127.0.0.1:9"  # nothing answers there


def _graph(detached: bool, *, tool_step: bool = False) -> Graph:
    nodes: list[dict] = [{"kind": "llm", "id": "a", "model": "m", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]
    if tool_step:
        nodes.append({"kind": "tool", "id": "t", "name": "lookup", "args": [{"ref": "a"}]})
    return Graph.model_validate({"detached": detached, "nodes": nodes})


@step(model="fake-model", max_tokens=20)
def write(topic):
    return f"Write about {topic}"


@tool
def lookup(text):
    return f"looked up {text}"


def test_detached_is_on_the_wire_only_when_true():
    assert _graph(True).to_wire()["detached"] is True
    assert "detached" not in _graph(False).to_wire()
    assert Graph.model_validate(_graph(True).to_wire()).detached


@pytest.mark.parametrize("detached", [True, False])
async def test_a_detached_run_outlives_the_sweep_a_normal_one_does_not(detached):
    store = RunStore(":memory:")
    engine = FakeEngine(["m"])
    registry = RunRegistry(store, detached_timeout_s=0.0)
    graph = _graph(detached, tool_step=True)  # the tool step waits: nobody runs it
    backends, costs = Backends({"m": engine}), CostTracker()
    run = await registry.start(graph, backends, costs, plan(graph, backends, costs))
    await asyncio.sleep(0.05)
    await registry.sweep()  # notes nobody listens
    await registry.sweep()  # past the (zero) timeout
    await asyncio.sleep(0.05)
    if not detached:
        await asyncio.wait([run.task])
        await registry.io.flush()  # (the store trails the run by its last writes)
        assert store.load(run.run_id).status == "cancelled"
        return
    assert not run.finished and run.trace.steps["t"].status == "waiting_tool"
    run.deliver_tool_result("t", "found")
    await asyncio.wait_for(asyncio.wait([run.task]), 5)
    await registry.io.flush()  # (the store trails the run by its last writes)
    assert store.load(run.run_id).status == "succeeded"
    assert run.outputs["t"] == "found"


@pytest.mark.parametrize("detached", [True, False])
async def test_a_resumed_detached_run_runs_on_without_its_client(detached):
    store = RunStore(":memory:")
    store.create("wf-old", _graph(detached).to_wire())
    engine = FakeEngine(["m"])
    registry = RunRegistry(store, detached_timeout_s=0.0)
    (run,) = await registry.resume_all(Backends({"m": engine}), CostTracker())
    await asyncio.sleep(0.05)  # (a task cancelled before it first runs records nothing)
    await registry.sweep()
    await registry.sweep()
    await asyncio.wait_for(asyncio.wait([run.task]), 5)
    await registry.io.flush()  # (the store trails the run by its last writes)
    assert store.load("wf-old").status == ("succeeded" if detached else "cancelled")
    assert bool(engine.requests) is detached


async def test_detach_returns_at_once_and_attach_reads_the_outputs(client):
    base = str(client.make_url("")).rstrip("/")
    async with workflow("detached", base_url=base, detach=True) as wf:
        a = write("rivers")
        b = write(a)
    assert wf.run_id and wf.status == "running" and not wf.outputs
    attached = await flowlift.aattach(wf.run_id, base_url=base)
    assert attached.status == "succeeded"
    assert set(attached.outputs) == {a.step_id, b.step_id}
    assert attached.value(b.step_id).startswith("echo: ")

    again = await asyncio.to_thread(flowlift.attach, wf.run_id, base_url=base)
    assert again.outputs == attached.outputs  # replayed from the start, run finished


async def test_sync_detach_returns_with_the_run_id(client):
    base = str(client.make_url("")).rstrip("/")

    def submit():
        with workflow("detached-sync", base_url=base, detach=True) as wf:
            poem = write("hills")
        return wf, poem

    wf, poem = await asyncio.to_thread(submit)
    assert wf.run_id and wf.status == "running"
    with pytest.raises(SemanticVariableError, match=r"detached .*flowlift\.attach\("):
        poem.value  # noqa: B018  # the block ended: the message points at attach
    attached = await flowlift.aattach(wf.run_id, base_url=base)
    assert len(attached.outputs) == 1


async def test_attached_run_that_fails_raises_and_its_tool_waits(client):
    base = str(client.make_url("")).rstrip("/")
    async with workflow("with-tool", base_url=base, detach=True) as wf:
        lookup(write("lakes"))
    follower = asyncio.ensure_future(flowlift.aattach(wf.run_id, base_url=base))
    await asyncio.sleep(0.3)
    assert not follower.done(), "the tool step should wait for a client with the function"
    shown = await client.get(f"/v1/workflows/{wf.run_id}")
    steps = [r for r in (await shown.json())["trace"] if r.get("type") == "step"]
    assert "waiting_tool" in {r["status"] for r in steps}
    assert "waiting for a client to run @tool steps: " in show_text(await shown.json())
    await client.delete(f"/v1/workflows/{wf.run_id}")
    with pytest.raises(WorkflowFailed):
        await asyncio.wait_for(follower, 5)


async def test_flowlift_result_writes_outputs_offline(tmp_path, capsys):
    db = tmp_path / "state.sqlite"
    store = RunStore(db)
    store.create("wf-done", _graph(True).to_wire())
    registry = RunRegistry(store)
    (run,) = await registry.resume_all(Backends({"m": FakeEngine(["m"])}), CostTracker())
    await asyncio.wait_for(asyncio.wait([run.task]), 5)
    out = tmp_path / "out.json"
    assert await asyncio.to_thread(main, ["result", "wf-done", "--base-url", GONE,
                                         "--state-db", str(db), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["status"] == "succeeded" and set(doc["outputs"]) == {"a"}
    assert doc["failures"] == {}
    assert await asyncio.to_thread(main, ["result", "wf-nope", "--base-url", GONE,
                                         "--state-db", str(db)]) == 1
    assert "wf-nope" in capsys.readouterr().err


class Topic(BaseModel):
    name: str
    words: int


calls: list[Topic] = []


@tool
def describe(topic: Topic, suffix: str) -> str:
    calls.append(topic)  # a Topic, not the dict on the wire: parsed by its annotation
    return f"{topic.name} in {topic.words} words{suffix}"


@step(model="fake-model", output=Topic, max_tokens=40)
def pick(seed):
    return f"Pick a topic near {seed}"


@pytest.mark.parametrize("asynchronous", [True, False])
async def test_attach_with_tools_runs_the_detached_runs_tool_steps_once(client, asynchronous):
    base = str(client.make_url("")).rstrip("/")
    calls.clear()
    async with workflow("attach-tools", base_url=base, detach=True) as wf:
        topic = pick("lakes")
        text = describe(topic, "!")
        write(text)
    await asyncio.sleep(0.2)  # the tool step waits: nobody with the function follows yet
    assert not calls
    if asynchronous:
        attached = await flowlift.aattach(wf.run_id, base_url=base, tools=[describe])
    else:
        attached = await asyncio.to_thread(flowlift.attach, wf.run_id, base_url=base,
                                           tools=[describe])
    assert attached.status == "succeeded"
    assert [type(c) for c in calls] == [Topic]
    assert attached.value(text.step_id) == f"{calls[0].name} in {calls[0].words} words!"
    # attached again once it finished: the replayed tool.wanted is not run a second time
    again = await flowlift.aattach(wf.run_id, base_url=base, tools=[describe])
    assert again.outputs == attached.outputs and len(calls) == 1


async def test_a_tool_whose_argument_does_not_parse_fails_its_step(client):
    base = str(client.make_url("")).rstrip("/")

    @tool(name="describe")
    def strict(topic: int, suffix: str) -> str:  # a Topic dict is no int
        return "never"
    async with workflow("attach-bad-arg", base_url=base, detach=True) as wf:
        describe(pick("hills"), "?")
    with pytest.raises(WorkflowFailed) as failed:
        await flowlift.aattach(wf.run_id, base_url=base, tools=[strict])
    (error,) = failed.value.failures.values()
    assert "ValidationError" in str(error)


slow_calls: list[str] = []


@tool(name="slow_describe")
def slow_describe(topic: Topic) -> str:
    slow_calls.append(topic.name)
    import time
    time.sleep(0.6)  # both attachers follow the run while the call is out
    return f"about {topic.name}"


async def test_two_attachers_at_once_run_a_tool_step_once(client):
    base = str(client.make_url("")).rstrip("/")
    slow_calls.clear()
    async with workflow("attach-twice", base_url=base, detach=True) as wf:
        text = slow_describe(pick("dunes"))
    one, two = await asyncio.gather(*(
        asyncio.to_thread(flowlift.attach, wf.run_id, base_url=base, tools=[slow_describe])
        for _ in range(2)))
    assert len(slow_calls) == 1, "the tool call is handed to one attacher only"
    assert one.value(text.step_id) == two.value(text.step_id) == f"about {slow_calls[0]}"


async def test_a_held_tool_call_goes_to_the_next_follower_when_its_holder_leaves():
    log = EventLog()
    log.emit("run.started", {"run_id": "r"})
    log.emit("tool.wanted", {"step_id": "t_1", "name": "t", "args": [], "kwargs": {}})
    first, second = log.follow(0, frozenset({"t"})), log.follow(0, frozenset({"t"}))
    watcher = log.follow(0, frozenset())
    assert [(await anext(first))[1] for _ in range(2)] == ["run.started", "tool.wanted"]
    assert (await anext(second))[1] == "run.started"
    pending = asyncio.ensure_future(anext(second))
    await asyncio.sleep(0.05)
    assert not pending.done(), "another follower holds the call"
    assert [(await anext(watcher))[1] for _ in range(2)] == ["run.started", "tool.wanted"]
    await first.aclose()  # its stream ended before the result: the call is offered again
    assert (await asyncio.wait_for(pending, 1))[2]["step_id"] == "t_1"
    log.emit("step.finished", {"step_id": "t_1", "value": "v"})
    again = log.follow(0, frozenset({"t"}))  # answered: replayed to anyone
    assert [(await anext(again))[1] for _ in range(3)] == [
        "run.started", "tool.wanted", "step.finished"]
    for follower in (second, watcher, again):
        await follower.aclose()
