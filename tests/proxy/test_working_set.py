"""Working-set admission (issue 35 §2): a session outside the working set waits while
the KV of the sessions admitted before it would not fit the engine's cache. Pure
policy on an injected clock, a simulated engine with a KV-capacity model
(tests/kv_sim.py: a workload that thrashes first come, first served and does not with
the policy), and the slot queue holding and then granting a new session."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest

from flowlift.proxy.dispatch.slots.policy import SlotPolicy
from flowlift.proxy.dispatch.slots.scheduler import Priority, PrioritySlots
from flowlift.proxy.dispatch.slots.working_set import WorkingSet, WorkingSetConfig

sys.path.insert(0, str(Path(__file__).parent))
from kv_sim import Clock, SimSession, simulate


def mixed_sessions(n: int = 32, seed: int = 0) -> list[SimSession]:
    rng = random.Random(seed)
    turns = [6, 6, 6, 6, 6, 6, 8, 8, 10, 10, 12, 15, 20, 25, 30, 35] * (n // 16)
    rng.shuffle(turns)
    return [SimSession(i * 0.2, t, tool_s=rng.uniform(0.2, 3.0))
            for i, t in enumerate(turns)]


def run(capacity: int, policy: bool):
    clock = Clock()
    working = WorkingSet(timer=clock) if policy else None
    return simulate(mixed_sessions(), capacity=capacity, slots=16, decode_s=0.05,
                    per_token_s=0.0005, working=working, clock=clock)


def test_a_workload_that_thrashes_first_come_first_served_does_not_with_the_policy():
    fcfs, ws = run(12_000, False), run(12_000, True)
    assert fcfs.cached_share < 0.6  # returning sessions find their prefix evicted
    assert ws.cached_share > 0.85
    assert ws.held > 0
    assert ws.mean_s < 0.6 * fcfs.mean_s
    assert ws.p90_s <= fcfs.p90_s
    assert ws.makespan_s <= fcfs.makespan_s


def test_without_pressure_the_policy_changes_nothing():
    fcfs, ws = run(60_000, False), run(60_000, True)
    assert ws.held == 0
    assert ws == fcfs


def session(ws: WorkingSet, clock: Clock, program: str, tokens: int) -> None:
    """One finished call of ``program`` that leaves ``tokens`` of KV."""
    ws.arrived(program)
    ws.started(program)
    ws.observed(program, tokens)
    clock.now += 0.1
    ws.finished(program)


def test_the_oldest_sessions_fit_first_and_the_newest_wait():
    clock = Clock()
    ws = WorkingSet(WorkingSetConfig(target=1.0), timer=clock)
    for p, tokens in (("a", 400), ("b", 400), ("c", 400)):
        session(ws, clock, p, tokens)
    assert list(ws.members()) == ["a", "b", "c"]
    assert ws.admits("a", 1000) and ws.admits("b", 1000)
    assert not ws.admits("c", 1000)  # 400 + 400 + 400 > 1000: the newest waits
    assert not ws.admits("new", 1000)
    assert ws.admits("c", 1200) and not ws.admits("new", 1200)
    ws.ended("a")
    assert ws.admits("c", 1000)


def test_a_single_session_larger_than_the_cache_still_runs():
    clock = Clock()
    ws = WorkingSet(timer=clock)
    session(ws, clock, "big", 5000)
    assert ws.admits("big", 1000)
    ws.ended("big")
    assert ws.admits("new", 1000)  # an empty working set admits anything


def test_growth_counts_toward_the_next_call():
    clock = Clock()
    ws = WorkingSet(timer=clock)
    session(ws, clock, "a", 300)
    session(ws, clock, "a", 380)
    assert ws.members() == {"a": 460}  # 380 now, 80 more at its next turn


def test_a_session_away_past_the_horizon_leaves_and_comes_back_last():
    clock = Clock()
    ws = WorkingSet(WorkingSetConfig(target=1.0, min_horizon_s=1.0, max_horizon_s=2.0,
                                     default_gap_s=1.0, horizon_factor=2.0), timer=clock)
    session(ws, clock, "a", 600)
    session(ws, clock, "b", 300)
    assert ws.horizon_s() == 2.0
    assert ws.next_change_s() == pytest.approx(1.9)
    assert not ws.admits("new", 1000)
    clock.now += 2.0  # a and b are taken to be done
    assert ws.members() == {} and ws.next_change_s() is None
    assert ws.admits("new", 1000)
    session(ws, clock, "new", 500)
    ws.arrived("a")  # a comes back after it left: behind the new one
    assert list(ws.members()) == ["new", "a"]
    assert not ws.admits("a", 1000)


def test_a_waiting_call_keeps_its_session_in_the_working_set():
    clock = Clock()
    ws = WorkingSet(WorkingSetConfig(min_horizon_s=1.0, default_gap_s=0.5), timer=clock)
    session(ws, clock, "a", 300)
    ws.arrived("a")
    clock.now += 30
    assert "a" in ws.members()
    ws.left("a")
    assert "a" not in ws.members()


def test_tool_gaps_are_learned():
    clock = Clock()
    ws = WorkingSet(WorkingSetConfig(horizon_factor=2.0, min_horizon_s=0.5), timer=clock)
    for _ in range(5):
        session(ws, clock, "a", 300)
        clock.now += 1.5
    assert ws.horizon_s() == pytest.approx(3.0)


def test_the_first_footprint_replaces_the_estimate_and_teaches_it():
    clock = Clock()
    ws = WorkingSet(WorkingSetConfig(new_session_tokens=512), timer=clock)
    assert ws.estimate("x") == 512
    ws.arrived("x")
    ws.started("x")
    assert ws.members() == {"x": 512}
    ws.observed("x", 200)
    assert ws.members() == {"x": 200}
    assert ws.estimate("y") == 200


def test_off_or_without_a_capacity_everything_is_admitted():
    clock = Clock()
    ws = WorkingSet(WorkingSetConfig(enabled=False), timer=clock)
    session(ws, clock, "a", 5000)
    assert ws.admits("b", 10)
    on = WorkingSet(timer=clock)
    session(on, clock, "a", 5000)
    assert on.admits("b", None) and not on.admits("b", 1000)


async def test_the_slot_queue_holds_a_new_session_until_the_working_set_fits():
    clock = Clock()
    policy = SlotPolicy(reserved_interactive=0, working_set=WorkingSetConfig(
        target=1.0, min_horizon_s=0.2, max_horizon_s=0.2))
    slots = PrioritySlots(capacity=4, policy=policy, timer=clock, kv_capacity=lambda: 1000)
    old = Priority.of("interactive", program="old")
    await slots.acquire(old)
    slots.observed(old, 900)
    slots.release(old)
    new = asyncio.create_task(slots.acquire(Priority.of("interactive", program="new")))
    await asyncio.sleep(0.05)
    assert not new.done() and slots.working.held == 1
    again = await asyncio.wait_for(slots.acquire(old), 1)  # the old session goes on
    slots.release(again)
    await asyncio.sleep(0.05)
    assert not new.done()
    clock.now += 1.0  # old stays away past the horizon: taken to be done
    await asyncio.wait_for(new, 2)  # the hold's timer looked again
    assert list(slots.working.members()) == ["new"]


async def test_fcfs_turns_working_set_admission_off():
    slots = PrioritySlots(capacity=2, policy=SlotPolicy(fcfs=True), kv_capacity=lambda: 10)
    assert not slots.working.enabled


def test_needs_count_whole_blocks_and_one_more():
    clock = Clock()
    ws = WorkingSet(WorkingSetConfig(target=1.0), timer=clock)
    for p in ("a", "b"):
        session(ws, clock, p, 300)
    assert ws.members(128) == {"a": 512, "b": 512}  # 3 blocks of 300 tokens, plus one
    assert ws.admits("b", 1000) and not ws.admits("b", 1000, 128)
    assert ws.estimate("new", 128) == 512  # a first call like the ones seen


def test_the_server_turns_it_on_unless_told_not_to():
    from flowlift.proxy.config import ProxyConfig
    from flowlift.proxy.dispatch.settings import DispatchSettings

    assert DispatchSettings.from_config(ProxyConfig()).working_set.enabled
    off = DispatchSettings.from_config(ProxyConfig(working_set=False))
    assert not off.working_set.enabled
    assert not PrioritySlots(2).working.enabled
