"""Dispatch order: class, remaining critical path, slack; prefix-grouped dispatch."""

from __future__ import annotations

import asyncio

import pytest

from flowlift.compiler import CompileOptions, compile_graph
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.settings import DispatchSettings
from flowlift.proxy.dispatch.slots.policy import SlotPolicy
from flowlift.proxy.dispatch.slots.scheduler import Priority, PrioritySlots
from flowlift.proxy.workflows.runs import Run
from flowlift.testing import FakeEngine


async def test_interactive_never_waits_behind_batch():
    slots = PrioritySlots(capacity=3,
                          policy=SlotPolicy(reserved_interactive=1, batch_cap_when_interactive=2))
    batch = Priority.of("batch", remaining_ms=10_000)
    await slots.acquire(batch)
    await slots.acquire(batch)
    third = asyncio.create_task(slots.acquire(batch))
    await asyncio.sleep(0)
    assert not third.done(), "batch work may not take the reserved slot"
    await asyncio.wait_for(slots.acquire(Priority.of("interactive")), timeout=1)
    assert slots.in_use == 3
    slots.release(batch)
    await asyncio.wait_for(third, timeout=1)


async def _grant_order(slots: PrioritySlots, waiters: list[tuple[str, Priority]]) -> list[str]:
    """Hold the only slot, queue ``waiters``, release: the order they were served in."""
    holder = Priority.of("batch")
    await slots.acquire(holder)
    order: list[str] = []

    async def wait(name: str, p: Priority) -> None:
        await slots.acquire(p)
        order.append(name)
        slots.release(p)

    tasks = [asyncio.create_task(wait(n, p)) for n, p in waiters]
    await asyncio.sleep(0)
    slots.release(holder)
    await asyncio.gather(*tasks)
    return order


async def test_waiters_are_served_by_class_then_remaining_critical_path():
    slots = PrioritySlots(capacity=1, policy=SlotPolicy(reserved_interactive=0))
    order = await _grant_order(slots, [
        ("batch-short", Priority.of("batch", 100)),
        ("batch-long", Priority.of("batch", 9_000)),
        ("interactive-short", Priority.of("interactive", 5)),
        ("batch-long-tight", Priority.of("batch", 9_000, slack_ms=10))])
    assert order == ["interactive-short", "batch-long-tight", "batch-long", "batch-short"]


async def test_cancelled_waiter_leaks_no_slot():
    slots = PrioritySlots(capacity=1, policy=SlotPolicy(reserved_interactive=0))
    p = Priority.of("batch")
    await slots.acquire(p)
    waiter = asyncio.create_task(slots.acquire(p))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    slots.release(p)
    assert slots.in_use == 0 and slots.queued == 0
    await asyncio.wait_for(slots.acquire(p), timeout=1)


def test_engine_priority_keeps_the_same_order():
    keys = [Priority.of("interactive", 10), Priority.of("interactive", 5_000),
            Priority.of("batch", 1), Priority.of("batch", 80_000)]
    assert sorted(keys, key=lambda p: p.engine_priority()) == sorted(keys)


PREAMBLE = "You are a careful assistant that answers in one short sentence. " * 4


def _graph(n: int, extra: list | None = None, cls: str = "interactive") -> Graph:
    nodes = [{"kind": "llm", "id": f"s{i}", "messages": [
        {"role": "system", "content": [{"text": PREAMBLE}]},
        {"role": "user", "content": [{"text": f"question {i}"}]}]} for i in range(n)]
    return Graph.model_validate({"class": cls, "nodes": nodes + (extra or [])})


async def test_prefix_siblings_wait_for_the_first_prefill():
    engine = FakeEngine(["m"], delay_s=0.02)
    backends = Backends({"m": engine})
    graph = _graph(4)
    plan = compile_graph(graph, CompileOptions(default_model="m"))
    run = Run(graph, backends, plan)
    await run.start()
    steps = run.trace.steps
    leader = min(steps.values(), key=lambda s: s.started_ms)
    others = [s for s in steps.values() if s is not leader]
    assert all(s.started_ms >= leader.first_token_ms for s in others)
    assert all(s.cached_tokens > 0 for s in others)


async def test_identical_calls_reach_the_engine_once():
    engine = FakeEngine(["m"])
    backends = Backends({"m": engine})
    dup = {"kind": "llm", "id": "dup", "messages": [
        {"role": "system", "content": [{"text": PREAMBLE}]},
        {"role": "user", "content": [{"text": "question 0"}]}]}
    graph = _graph(1, [dup])
    run = Run(graph, backends, compile_graph(graph, CompileOptions(default_model="m")))
    await run.start()
    assert len(engine.requests) == 1
    assert run.outputs["dup"] == run.outputs["s0"]
    assert run.trace.step("dup").same_as == "s0"


async def test_critical_path_first_under_contention():
    engine = FakeEngine(["m"], delay_s=0.01)
    backends = Backends({"m": engine}, DispatchSettings(max_concurrency=1))
    chain = [{"kind": "llm", "id": f"c{i}", "messages": [{"role": "user", "content": [
        {"text": f"step {i} "}, *([{"ref": f"c{i - 1}"}] if i else [])]}]} for i in range(4)]
    leaves = [{"kind": "llm", "id": f"leaf{i}", "messages": [
        {"role": "user", "content": [{"text": f"independent leaf {i}"}]}]} for i in range(4)]
    graph = Graph.model_validate({"class": "batch", "nodes": leaves + chain})
    run = Run(graph, backends, compile_graph(graph, CompileOptions(default_model="m")))
    await run.start()
    first = min(run.trace.steps.values(), key=lambda s: s.started_ms)
    assert first.step_id == "c0", "the head of the longest chain goes first"


async def test_fcfs_baseline_ignores_priorities():
    order = await _grant_order(PrioritySlots(capacity=1, policy=SlotPolicy(fcfs=True)), [
        ("batch", Priority.of("batch", 1)),
        ("interactive", Priority.of("interactive", 9_000))])
    assert order == ["batch", "interactive"]


async def test_batch_admissions_are_capped_while_interactive_work_runs():
    slots = PrioritySlots(capacity=4,
                          policy=SlotPolicy(reserved_interactive=1, batch_cap_when_interactive=1,
                                            linger_s=0.05))
    inter, batch = Priority.of("interactive"), Priority.of("batch")
    await slots.acquire(inter)
    await slots.acquire(batch)
    second = asyncio.create_task(slots.acquire(batch))
    await asyncio.sleep(0.01)
    assert not second.done(), "batch may hold only 1 slot while interactive work runs"
    slots.release(inter)
    await asyncio.sleep(0.01)
    assert not second.done(), "the cap lingers briefly for the chain's next step"
    await asyncio.wait_for(second, timeout=1)
    assert slots.batch_in_use == 2


async def test_batch_prefill_budget_spreads_long_prompts():
    slots = PrioritySlots(capacity=8, policy=SlotPolicy(batch_prefill_budget=1000))
    batch = Priority.of("batch")
    first = slots.slot(batch, 800)
    await first.__aenter__()
    waiting = asyncio.create_task(slots.acquire(batch, 800))
    await asyncio.sleep(0.01)
    assert not waiting.done(), "two long prompts would exceed the prefill budget"
    await asyncio.wait_for(slots.acquire(Priority.of("interactive"), 5000), timeout=1)
    first.prefilled()  # its first token: the prompt left the budget
    await asyncio.wait_for(waiting, timeout=1)
    huge = asyncio.create_task(slots.acquire(batch, 5000))
    await asyncio.sleep(0.01)
    assert not huge.done()
    slots.prefilled(batch, 800)
    await asyncio.wait_for(huge, timeout=1)  # alone, a prompt over the budget still goes
