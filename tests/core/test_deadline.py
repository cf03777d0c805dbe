"""One deadline per run: queued too long fails with the step named (W4); the clock stops
while a client-run step is out."""

from __future__ import annotations

import asyncio

from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.settings import DispatchSettings
from flowlift.proxy.workflows.deadline import DeadlineClock
from flowlift.proxy.workflows.runs import Run
from flowlift.testing import FakeEngine


def llm(node_id, text, *refs):
    content = [{"text": text}, *({"ref": r} for r in refs)]
    return {"kind": "llm", "id": node_id, "messages": [{"role": "user", "content": content}]}


async def test_w4_queued_past_the_deadline_names_step_and_queue_time():
    engine = FakeEngine(["m"], delay_s=0.1)
    backends = Backends({"m": engine}, DispatchSettings(max_concurrency=1))
    graph = Graph.model_validate({"deadline_s": 0.3, "nodes": [
        llm("busy", "word " * 30), llm("waiting", "other words " * 3)]})
    run = Run(graph, backends)
    await run.start()
    queued = [e for e in run.failures.values() if "ms queued" in e and "running" not in e]
    running = [e for e in run.failures.values() if "ms running" in e]
    assert len(queued) == 1 and len(running) == 1
    assert "deadline of 0.3 s exceeded: step " in queued[0]
    assert run.trace.status == "failed"


async def test_deadline_clock_stops_while_a_tool_is_out():
    """Two tool steps out in the app 0.35 s each: 0.7 s, past the 0.5 s deadline, spent
    in the app (each within the deadline, its bound without a timeout_s: issue 38)."""
    engine = FakeEngine(["m"])
    backends = Backends({"m": engine})
    graph = Graph.model_validate({"deadline_s": 0.5, "nodes": [
        llm("a", "first"), {"kind": "tool", "id": "t", "name": "slow_tool",
                            "args": [{"ref": "a"}]},
        {"kind": "tool", "id": "u", "name": "slow_tool", "args": [{"ref": "t"}]},
        llm("b", "after", "u")]})
    run = Run(graph, backends)
    task = run.start()
    async for _, event, data in run.log.follow():
        if event == "tool.wanted":
            await asyncio.sleep(0.35)  # spent in the app
            run.deliver_tool_result(data["step_id"], "tool output")
    await task
    assert run.trace.status == "succeeded", run.failures
    assert run.outputs["b"] == "echo: aftertool output"


async def test_clock_arithmetic():
    clock = DeadlineClock(0.2)
    async with clock.paused():
        await asyncio.sleep(0.15)
        assert clock.left_s() > 0.19
    await asyncio.wait_for(clock.expired(), timeout=1)
    assert clock.left_s() == 0
