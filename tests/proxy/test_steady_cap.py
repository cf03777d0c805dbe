"""The steady batch cap (``flowlift serve --batch-cap N|auto``): batch slots bounded at
all times, decoding batch requests never preempted, only those still in prefill.

Pure choices are property tests; the slots run on fake requests and the fake engine (no
timing asserts: the order of events only).
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowlift.local_engine.step_log import StepLog
from flowlift.proxy.dispatch.slots.batch_cap import BatchPlan, DynamicCap, plan_beside_interactive
from flowlift.proxy.dispatch.slots.policy import SlotPolicy
from flowlift.proxy.dispatch.slots.preemption import Candidate, victims_beside_interactive
from flowlift.proxy.dispatch.slots.scheduler import Priority, PrioritySlots
from flowlift.testing import FakeEngine
from tests.proxy.test_batch_cap import candidates  # (batch requests: running, some in prefill)

BATCH = Priority.of("batch")
INTERACTIVE = Priority.of("interactive")



@given(cands=candidates, cap=st.integers(0, 16), tokens=st.integers(0, 2048))
def test_under_a_steady_cap_only_requests_in_prefill_are_chosen(cands, cap, tokens):
    stop = victims_beside_interactive(cands, BatchPlan(cap, tokens), stop_decoding=False)
    stopped = {c.key for c in stop}
    assert len(stopped) == len(stop), "no request twice"
    assert all(c.in_prefill for c in stop), "a decoding request is never preempted"
    decoding = sum(1 for c in cands if not c.in_prefill)
    kept = [c for c in cands if c.in_prefill and c.key not in stopped]
    assert len(kept) <= max(0, cap - decoding), "kept in prefill only beside all decoders"
    assert sum(c.prefill_tokens for c in kept) <= tokens


def test_requests_in_prefill_go_while_the_decoding_ones_stay():
    cands = [Candidate("a", BATCH, 100, 256), Candidate("b", BATCH, 10, 256),
             Candidate("c", BATCH, 0, 256, in_prefill=True, prefill_tokens=40),
             Candidate("d", BATCH, 0, 256, in_prefill=True, prefill_tokens=30)]
    # room for one more beside the two decoding, 40 tokens: the smaller prompt stays
    assert [c.key for c in victims_beside_interactive(
        cands, BatchPlan(3, 40), stop_decoding=False)] == ["c"]
    # a plan smaller than the decoders: both prefills go, no decoder does
    assert [c.key for c in victims_beside_interactive(
        cands, BatchPlan(1, 1000), stop_decoding=False)] == ["d", "c"]


async def test_a_steady_cap_bounds_batch_slots_with_no_interactive_work():
    slots = PrioritySlots(capacity=8, policy=SlotPolicy(reserved_interactive=1), steady=2)
    got = [asyncio.create_task(slots.acquire(BATCH)) for _ in range(4)]
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in got) == 2 and not slots.interactive_active()
    slots.release(BATCH)
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in got) == 3
    fcfs = PrioritySlots(capacity=8, policy=SlotPolicy(fcfs=True), steady=2)
    assert fcfs.steady_cap() == 8, "the baseline has no cap"


def _log(base: float, per_decode: float) -> StepLog:
    log = StepLog()
    for b in (1, 4, 8, 16):
        for _ in range(3):
            log.record(0, 0, b, base + per_decode * b)
    return log


@given(base=st.floats(1, 200), per_decode=st.floats(0.01, 20), slowdown=st.floats(1, 3),
       slots=st.integers(2, 64))
def test_auto_steady_cap_is_the_plan_beside_one_interactive_request(base, per_decode,
                                                                    slowdown, slots):
    cap = DynamicCap(_log(base, per_decode), slowdown, BatchPlan(1, 0))
    ps = PrioritySlots(capacity=slots + 1, policy=SlotPolicy(reserved_interactive=1), steady=cap)
    cap.plan(1, slots)  # fits the log
    model = cap.model
    assert model is not None
    want = plan_beside_interactive(model, 1, slots, slowdown).decode_cap
    assert ps.steady_cap() == max(1, want), "never 0: the batch still moves"


class _Running:
    """A registered batch request (a :class:`Preemptible` without an engine)."""

    def __init__(self, name: str, in_prefill: bool) -> None:
        self.name, self.in_prefill, self.stopped = name, in_prefill, False

    def candidate(self) -> Candidate:
        return Candidate(self.name, BATCH, 0 if self.in_prefill else 20, 256,
                         self.in_prefill, 300 if self.in_prefill else 0)

    def preempt(self) -> None:
        self.stopped = True


@pytest.mark.parametrize("dynamic", [False, True])
async def test_interactive_arrival_preempts_no_decoding_request_under_a_steady_cap(dynamic):
    plan = DynamicCap(StepLog(), 1.3, BatchPlan(1, 0)) if dynamic else None
    policy = SlotPolicy(reserved_interactive=1, preempt=True, linger_s=0.0,
                        batch_cap_when_interactive=None if dynamic else 1)
    slots = PrioritySlots(capacity=8, policy=policy, steady=4, dynamic=plan)
    running = [_Running(f"d{k}", in_prefill=False) for k in range(3)]
    running.append(_Running("p", in_prefill=True))
    for r in running:
        await slots.acquire(BATCH)
        slots.register(r)
    await slots.acquire(INTERACTIVE)
    stopped = [r.name for r in running if r.stopped]
    # without the steady cap, the cap of 1 stops two decoders (and the prefill, dynamic)
    assert stopped == (["p"] if dynamic else [])
    assert slots.preemptions == len(stopped)


async def test_without_a_steady_cap_the_same_arrival_preempts_decoders():
    slots = PrioritySlots(capacity=8,
                          policy=SlotPolicy(reserved_interactive=1, preempt=True, linger_s=0.0),
                          dynamic=DynamicCap(StepLog(), 1.3, BatchPlan(1, 0)))
    running = [_Running(f"d{k}", in_prefill=False) for k in range(3)]
    for r in running:
        await slots.acquire(BATCH)
        slots.register(r)
    await slots.acquire(INTERACTIVE)
    assert sum(r.stopped for r in running) == 2, "the contrast the steady cap removes"


# -- flags, the proxy ------------------------------------------------------------------

async def test_auto_steady_cap_reaches_the_slots_and_readyz(aiohttp_client):
    from flowlift.proxy import ProxyConfig, create_app
    from flowlift.proxy.state import STATE

    timed, log = FakeEngine(["fake-model"]), StepLog()
    timed.step_log = lambda: log  # type: ignore[method-assign]  # as the vLLM engine's
    app = create_app({"fake-model": timed}, ProxyConfig(
        scheduling="preempt", batch_cap="auto", interactive_slowdown=1.5))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    for b in (1, 8, 15):
        for _ in range(3):
            log.record(0, 0, b, 40.0 + 2.0 * b)
    slots = app[STATE].backends.backends[0].slots
    assert slots.dynamic is None, "the plan beside interactive work stays the fixed one"
    # beside one interactive request: 42 ms alone, 63 ms allowed -> 10 at 2 ms each
    assert slots.steady_cap() == 10
    plan = (await (await client.get("/readyz")).json())["batch_plans"]["engine-0"]
    assert plan["steady_cap"] == 10 and plan["model"]["per_decode_ms"] == 2.0


async def test_a_fixed_steady_cap_reaches_the_slots(aiohttp_client):
    from flowlift.proxy import ProxyConfig, create_app
    from flowlift.proxy.state import STATE

    app = create_app({"fake-model": FakeEngine(["fake-model"])}, ProxyConfig(batch_cap=3))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    assert app[STATE].backends.backends[0].slots.steady_cap() == 3
    plan = (await (await client.get("/readyz")).json())["batch_plans"]["engine-0"]
    assert plan["steady_cap"] == 3


def test_batch_cap_flags_reach_the_proxy_and_the_engine(engine_configs):
    from flowlift import cli

    args = cli.build_parser().parse_args(["serve", "--batch-cap", "auto"])
    assert cli.serve_flags(args)["batch_cap"] == "auto"
    cli._engines(args)
    assert engine_configs[-1].step_timings, "the auto cap needs the engine's step times"
    args = cli.build_parser().parse_args(["serve", "--batch-cap", "12"])
    assert cli.serve_flags(args)["batch_cap"] == 12
    cli._engines(args)
    assert not engine_configs[-1].step_timings


@pytest.mark.parametrize("value", ["0", "-3", "lots", "1.5"])
def test_nonsense_batch_caps_exit_2_with_a_readable_message(capsys, value):
    from flowlift import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--engine", "fake", "--batch-cap", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --batch-cap: must " in err, err

