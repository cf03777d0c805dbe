"""Program-level scheduling (issue 24 §2): least attained service over agent sessions
inside the class order, the starvation bound, the bounded program table, what counts
toward a program (session-tagged chat completions, agent-step turns), and keeping a
waiting session's KV. Pure slot logic on an injected clock; the last tests go through
the in-process proxy on the FakeEngine."""

from __future__ import annotations

import asyncio

import pytest

from flowlift import StepFailed, WorkflowFailed, step, tool, workflow
from flowlift.proxy.dispatch.slots.policy import SlotPolicy
from flowlift.proxy.dispatch.slots.programs import ProgramBook, ProgramConfig, las_level
from flowlift.proxy.dispatch.slots.scheduler import Priority, PrioritySlots
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, tool_calls_text


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def serve(slots: PrioritySlots, clock: Clock, program: str, seconds: float) -> None:
    """Give ``program`` ``seconds`` of attained service (one finished call)."""
    slots.programs.started(program)
    clock.now += seconds
    slots.programs.finished(program)


async def grant_order(slots: PrioritySlots, waiters: list[tuple[str, Priority]]
                      ) -> list[str]:
    """Hold the only slot, queue ``waiters`` (in that arrival order), release: the order
    they were served in."""
    holder = Priority.of("batch")
    await slots.acquire(holder)
    order: list[str] = []

    async def wait(name: str, p: Priority) -> None:
        await slots.acquire(p)
        order.append(name)
        slots.release(p)

    tasks = []
    for n, p in waiters:
        tasks.append(asyncio.create_task(wait(n, p)))
        await asyncio.sleep(0)
    slots.release(holder)
    await asyncio.gather(*tasks)
    return order


async def test_least_attained_program_goes_first_even_with_a_shorter_critical_path():
    clock = Clock()
    slots = PrioritySlots(capacity=1, policy=SlotPolicy(reserved_interactive=0), timer=clock)
    serve(slots, clock, "long-session", 20.0)
    serve(slots, clock, "mid-session", 3.0)
    order = await grant_order(slots, [
        ("long", Priority.of("interactive", 9_000, program="long-session")),
        ("mid", Priority.of("interactive", 5_000, program="mid-session")),
        ("new", Priority.of("interactive", 10, program="new-session"))])
    assert order == ["new", "mid", "long"]


async def test_without_program_scheduling_the_critical_path_order_stands():
    clock = Clock()
    slots = PrioritySlots(capacity=1,
                          policy=SlotPolicy(reserved_interactive=0,
                                            programs=ProgramConfig(enabled=False)),
                          timer=clock)
    serve(slots, clock, "long-session", 20.0)
    order = await grant_order(slots, [
        ("new", Priority.of("interactive", 10, program="new-session")),
        ("long", Priority.of("interactive", 9_000, program="long-session"))])
    assert order == ["long", "new"]
    assert slots.programs.attained_s("long-session") == 0.0  # nothing tracked


async def test_class_order_holds_over_attained_service():
    clock = Clock()
    slots = PrioritySlots(capacity=1, policy=SlotPolicy(reserved_interactive=0), timer=clock)
    serve(slots, clock, "busy", 500.0)
    order = await grant_order(slots, [
        ("batch-fresh", Priority.of("batch", 9_000, program="fresh")),
        ("interactive-busy", Priority.of("interactive", 0, program="busy"))])
    assert order == ["interactive-busy", "batch-fresh"]


async def test_inside_one_las_level_critical_path_and_slack_order():
    clock = Clock()
    slots = PrioritySlots(capacity=1,
                          policy=SlotPolicy(reserved_interactive=0,
                                            programs=ProgramConfig(quantum_s=10.0)),
                          timer=clock)
    serve(slots, clock, "a", 2.0)  # both below the quantum: level 0
    serve(slots, clock, "b", 6.0)
    order = await grant_order(slots, [
        ("a-short", Priority.of("interactive", 100, program="a")),
        ("b-long", Priority.of("interactive", 8_000, program="b")),
        ("b-long-tight", Priority.of("interactive", 8_000, slack_ms=5, program="b"))])
    assert order == ["b-long-tight", "b-long", "a-short"]


async def test_running_calls_count_toward_attained_service():
    clock = Clock()
    slots = PrioritySlots(capacity=2, policy=SlotPolicy(reserved_interactive=0), timer=clock)
    p = Priority.of("interactive", program="r")
    await slots.acquire(p)
    clock.now += 4.0
    assert slots.programs.attained_s("r") == pytest.approx(4.0)
    slots.release(p)
    clock.now += 100.0
    assert slots.programs.attained_s("r") == pytest.approx(4.0)


async def test_starvation_bound_a_long_program_goes_first_once_it_waited_max_wait():
    clock = Clock()
    slots = PrioritySlots(capacity=1,
                          policy=SlotPolicy(reserved_interactive=0,
                                            programs=ProgramConfig(max_wait_s=5.0)),
                          timer=clock)
    serve(slots, clock, "long", 50.0)
    order: list[str] = []
    waited: dict[str, float] = {}

    async def wait(name: str, program: str) -> None:
        p = Priority.of("interactive", program=program)
        since = clock.now
        await slots.acquire(p)
        waited[name] = clock.now - since
        order.append(name)

    holder = Priority.of("interactive", program="holder")
    await slots.acquire(holder)
    long_turn = asyncio.create_task(wait("long", "long"))
    await asyncio.sleep(0)
    current = holder
    # a newcomer arrives every 2 s and each holds the slot 2 s: without the bound, the
    # long program (far more attained service) would wait behind every one of them
    newcomers = []
    for i in range(5):
        newcomers.append(asyncio.create_task(wait(f"new-{i}", f"new-{i}")))
        await asyncio.sleep(0)
        clock.now += 2.0
        slots.release(current)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        current = Priority.of("interactive", program=order[-1])
    assert order.index("long") == 2, order  # after new-0 and new-1, before new-2
    assert waited["long"] <= 5.0 + 2.0  # the bound plus one slot's hold time
    assert slots.programs.aged == 1
    for task in [long_turn, *newcomers]:
        task.cancel()


async def test_no_aging_with_fcfs():
    slots = PrioritySlots(capacity=1, policy=SlotPolicy(fcfs=True))
    assert not slots.programs.enabled and slots.programs.level("x") == 0


def test_program_table_is_bounded_in_count_and_age():
    clock = Clock()
    book = ProgramBook(ProgramConfig(max_programs=4, ttl_s=60.0), timer=clock)
    for i in range(1_000):
        book.started(f"p{i}")
        clock.now += 0.5
        book.finished(f"p{i}")
    assert len(book) == 4
    assert book.known("p999") and not book.known("p0")
    clock.now += 61.0
    assert len(book) == 0
    assert book.level("p999") == 0  # forgotten: back to the least-served level
    assert book.snapshot()["programs"] == 0


def test_las_levels_double():
    assert [las_level(s, 1.0, 5) for s in (0.0, 0.99, 1.0, 1.9, 2.0, 4.0, 8.0, 1e9)] \
        == [0, 0, 1, 1, 2, 3, 4, 5]


def test_bad_program_settings_are_rejected():
    with pytest.raises(ValueError, match="max_wait_s"):
        ProgramConfig(max_wait_s=0)
    with pytest.raises(ValueError, match="keep_kv_usage"):
        ProgramConfig(keep_kv_usage=1.5)


# -- keeping a waiting session's KV -------------------------------------------------------

async def test_a_new_program_is_held_back_while_a_waiting_sessions_kv_is_kept():
    clock = Clock()
    kv = {"usage": 0.95}
    slots = PrioritySlots(capacity=4,
                          policy=SlotPolicy(reserved_interactive=0, programs=ProgramConfig(
                              keep_ttl_s=30.0, keep_kv_usage=0.8)),
                          timer=clock, kv_usage=lambda: kv["usage"])
    serve(slots, clock, "waiting", 1.0)
    serve(slots, clock, "served", 1.0)
    running = Priority.of("interactive", program="served")
    await slots.acquire(running)
    slots.programs.keep("waiting")  # its tool is out; its next turn will come
    fresh = asyncio.create_task(slots.acquire(Priority.of("interactive", program="fresh")))
    await asyncio.sleep(0.01)
    assert not fresh.done(), "a new session's prefill must not start on a full cache"
    assert slots.queued == 1 and slots.programs.held == 1
    # a session already served is not held back
    await asyncio.wait_for(slots.acquire(Priority.of("interactive", program="served")), 1)
    # the waiting session's next turn comes: the mark ends and the new session goes
    await asyncio.wait_for(slots.acquire(Priority.of("interactive", program="waiting")), 1)
    await asyncio.wait_for(fresh, 1)


async def test_nothing_is_held_back_when_the_cache_has_room():
    slots = PrioritySlots(capacity=4, policy=SlotPolicy(reserved_interactive=0),
                          kv_usage=lambda: 0.3)
    await slots.acquire(Priority.of("interactive", program="a"))
    slots.programs.keep("b")
    await asyncio.wait_for(slots.acquire(Priority.of("interactive", program="new")), 1)


async def test_the_keep_mark_expires_after_its_ttl():
    slots = PrioritySlots(capacity=4,
                          policy=SlotPolicy(reserved_interactive=0,
                                            programs=ProgramConfig(keep_ttl_s=0.1)),
                          kv_usage=lambda: 0.99)
    await slots.acquire(Priority.of("interactive", program="a"))
    slots.programs.keep("b")
    fresh = asyncio.create_task(slots.acquire(Priority.of("interactive", program="new")))
    await asyncio.sleep(0.02)
    assert not fresh.done()
    await asyncio.wait_for(fresh, 2)  # the TTL ran out: no session is waiting any more


# -- what counts toward a program, through the proxy ---------------------------------------

def book_of(client) -> ProgramBook:  # type: ignore[no-untyped-def]
    return client.app[STATE].backends.backends[0].slots.programs


async def test_session_tagged_chat_completions_count_toward_their_session(client):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}
    for _ in range(3):
        r = await client.post("/v1/chat/completions", json=body,
                              headers={"X-Flowlift-Session": "agent-7"})
        assert r.status == 200
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x",
                                                    "max_tokens": 2},
                          headers={"X-Flowlift-Session": "agent-7"})
    assert r.status == 200
    r = await client.post("/v1/chat/completions", json=body)  # no session: no program
    assert r.status == 200
    book = book_of(client)
    assert book._table["agent-7"].calls == 4
    assert len(book) == 1
    assert book.marks == 0  # no answer called a tool


async def test_a_session_answer_that_calls_a_tool_keeps_its_kv(client, engine):
    engine.responder = lambda request: tool_calls_text(("shell", {"command": "ls"}))
    tools = [{"type": "function", "function": {
        "name": "shell", "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}}, "required": ["command"]}}}]
    r = await client.post("/v1/chat/completions", headers={"X-Flowlift-Session": "s-9"},
                          json={"model": "fake-model", "tools": tools, "max_tokens": 40,
                                "messages": [{"role": "user", "content": "go"}]})
    assert (await r.json())["choices"][0]["message"]["tool_calls"]
    book = book_of(client)
    assert book.marks == 1 and book.keeping() == 1


SHELL_CALLS: list[str] = []


@tool
def shell(command: str) -> str:
    """Run a shell command."""
    SHELL_CALLS.append(command)
    return "ok"


@step(tools=[shell], max_turns=3, tool_choice="required")
def agent(task: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": task}]


async def test_every_turn_of_an_agent_step_counts_toward_its_run(client, engine: FakeEngine):
    engine.responder = lambda request: tool_calls_text(("shell", {"command": "ls"}))
    base = str(client.make_url("")).rstrip("/")
    with pytest.raises(WorkflowFailed):
        async with workflow("agents", base_url=base) as wf:
            out = agent("look around")
    with pytest.raises(StepFailed, match="after 3 turns"):
        _ = out.value
    book = book_of(client)
    assert book._table[wf.run_id].calls == 3  # three turns, one program
    assert SHELL_CALLS == ["ls", "ls"]  # the last turn's call is not run
    assert book.marks == 2  # marked while each of its two tool rounds was out
    assert book.keeping() == 0  # each mark ended when the next turn came


async def test_the_program_table_is_exported_as_metrics(client):
    r = await client.post("/v1/chat/completions", headers={"X-Flowlift-Session": "s-1"},
                          json={"model": "fake-model", "max_tokens": 2,
                                "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200
    text = await (await client.get("/metrics")).text()
    assert 'flowlift_programs{backend="engine-0"} 1.0' in text
    assert 'flowlift_program_aged_grants_total{backend="engine-0"} 0.0' in text
    ready = await (await client.get("/readyz")).json()
    assert ready["programs"]["engine-0"]["programs"] == 1


async def test_a_held_request_waits_at_most_keep_ttl_however_many_sessions_wait():
    slots = PrioritySlots(capacity=4,
                          policy=SlotPolicy(reserved_interactive=0,
                                            programs=ProgramConfig(keep_ttl_s=0.2)),
                          kv_usage=lambda: 0.99)
    await slots.acquire(Priority.of("interactive", program="a"))
    slots.programs.keep("b")
    fresh = asyncio.create_task(slots.acquire(Priority.of("interactive", program="new")))
    for _ in range(6):  # other sessions' tools keep going out: a mark is always live
        await asyncio.sleep(0.05)
        slots.programs.keep("c")
    assert fresh.done(), "held past keep_ttl_s from its arrival"


async def test_the_arrival_queue_stays_bounded_behind_a_long_waiter():
    slots = PrioritySlots(capacity=2,
                          policy=SlotPolicy(reserved_interactive=1, batch_cap_when_interactive=1))
    await slots.acquire(Priority.of("batch", program="b0"))
    starved = asyncio.create_task(slots.acquire(Priority.of("batch", program="b1")))
    await asyncio.sleep(0)
    for i in range(500):  # interactive turns come and go; the batch one keeps waiting
        p = Priority.of("interactive", program=f"i{i}")
        await slots.acquire(p)
        slots.release(p)
    assert not starved.done()
    assert len(slots._arrivals) < 100
    starved.cancel()
