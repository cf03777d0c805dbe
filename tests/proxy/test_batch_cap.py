"""The dynamic batch plan beside interactive work (flowlift.proxy.dispatch.slots.batch_cap).

The model fit, the plan, the linger and the choice of victims are pure functions of
measured numbers (property tests); the slots honour the plan on the fake engine (no
timing asserts: the order of events only).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlift.local_engine.base import (
    GenerationChunk,
    GenerationRequest,
    SamplingOptions,
    Usage,
)
from flowlift.local_engine.step_log import EngineStep, StepLog
from flowlift.proxy.dispatch.slots.batch_cap import (
    BatchPlan,
    DynamicCap,
    LingerModel,
    StepModel,
    fit_steps,
    linger_from,
    plan_beside_interactive,
)
from flowlift.proxy.dispatch.slots.policy import SlotPolicy
from flowlift.proxy.dispatch.slots.preemption import Candidate, victims_beside_interactive
from flowlift.proxy.dispatch.slots.resumable import ResumableGeneration
from flowlift.proxy.dispatch.slots.scheduler import Priority, PrioritySlots
from flowlift.testing import FakeEngine

BATCH = Priority.of("batch")
INTERACTIVE = Priority.of("interactive")


def _steps(base: float, per_decode: float, per_token: float,
           sizes: list[int], prefills: list[tuple[int, int]]) -> list[EngineStep]:
    out = [EngineStep(0.0, 0, 0, b, base + per_decode * b) for b in sizes for _ in range(3)]
    out += [EngineStep(0.0, 1, p, b, base + per_decode * b + per_token * p)
            for b, p in prefills]
    return out


# -- the model ------------------------------------------------------------------------

@given(base=st.floats(1, 200), per_decode=st.floats(0, 20), per_token=st.floats(0, 5),
       sizes=st.lists(st.integers(1, 64), min_size=2, max_size=8, unique=True),
       prefills=st.lists(st.tuples(st.integers(0, 16), st.integers(16, 2048)), max_size=6))
def test_fit_recovers_the_line_of_exact_step_times(base, per_decode, per_token, sizes,
                                                   prefills):
    model = fit_steps(_steps(base, per_decode, per_token, sizes, prefills))
    assert model is not None
    assert model.base_ms == pytest.approx(base, rel=1e-6, abs=1e-6)
    assert model.per_decode_ms == pytest.approx(per_decode, rel=1e-6, abs=1e-6)
    if prefills:
        assert model.per_prefill_token_ms == pytest.approx(per_token, rel=1e-6, abs=1e-6)
    else:
        assert model.per_prefill_token_ms is None


def test_fit_needs_two_batch_sizes_and_shrugs_off_one_slow_step():
    assert fit_steps(_steps(40, 1.5, 1, [8], [])) is None
    assert fit_steps([]) is None
    steps = [*_steps(40, 1.5, 1, [1, 8, 16], []), EngineStep(0.0, 0, 0, 8, 3000.0)]
    model = fit_steps(steps)
    assert model is not None and model.per_decode_ms == pytest.approx(1.5)


@given(points=st.lists(st.tuples(st.integers(1, 32), st.floats(0, 1000)), min_size=6))
def test_fitted_slope_and_intercept_are_never_negative(points):
    model = fit_steps([EngineStep(0.0, 0, 0, b, t) for b, t in points], min_per_size=1)
    if model is not None:
        assert model.base_ms >= 0 and model.per_decode_ms >= 0


# -- the plan -------------------------------------------------------------------------

models = st.builds(StepModel, base_ms=st.floats(1, 200), per_decode_ms=st.floats(0, 20),
                   per_prefill_token_ms=st.one_of(st.none(), st.floats(0, 5)))


@given(model=models, interactive=st.integers(0, 8), slots=st.integers(0, 64),
       slowdown=st.floats(1, 4))
def test_plan_keeps_interactive_steps_within_the_slowdown(model, interactive, slots,
                                                          slowdown):
    plan = plan_beside_interactive(model, interactive, slots, slowdown)
    i = max(interactive, 1)
    bound = slowdown * model.step_ms(i)
    assert 0 <= plan.decode_cap <= slots and plan.prefill_tokens >= 0
    assert model.step_ms(i + plan.decode_cap, plan.prefill_tokens) <= bound * (1 + 1e-9)
    if plan.decode_cap < slots:  # the largest: one more would break the bound
        assert model.step_ms(i + plan.decode_cap + 1) > bound * (1 - 1e-9)
    if model.per_prefill_token_ms is None:
        assert plan.prefill_tokens == 0


@given(model=models, slots=st.integers(0, 64), low=st.floats(1, 3), more=st.floats(0, 1))
def test_plan_grows_with_the_allowed_slowdown(model, slots, low, more):
    a = plan_beside_interactive(model, 1, slots, low)
    b = plan_beside_interactive(model, 1, slots, low + more)
    assert b.decode_cap >= a.decode_cap


@given(base=st.floats(1, 200), cheap=st.floats(0.01, 10), dearer=st.floats(0, 10),
       slots=st.integers(0, 64))
def test_plan_shrinks_as_decoding_gets_dearer(base, cheap, dearer, slots):
    a = plan_beside_interactive(StepModel(base, cheap), 1, slots, 1.3)
    b = plan_beside_interactive(StepModel(base, cheap + dearer), 1, slots, 1.3)
    assert b.decode_cap <= a.decode_cap


def test_plan_on_the_measured_cpu_keeps_batch_prefill_out():
    # quiet 2-core CPU, SmolLM2-135M: 38 ms + 1.55 ms per request, ~1 ms a prompt token
    plan = plan_beside_interactive(StepModel(38.2, 1.55, 1.0), 1, 15, 1.3)
    assert plan.decode_cap == 7 and plan.prefill_tokens < 16, "no prompt fits beside"
    assert plan_beside_interactive(StepModel(38.2, 0.0, 0.0), 1, 15, 1.3).decode_cap == 15
    with pytest.raises(ValueError):
        plan_beside_interactive(StepModel(38.2, 1.55), 1, 15, 0.9)


def test_dynamic_cap_falls_back_until_it_can_fit_then_follows_the_log():
    log = StepLog()
    cap = DynamicCap(log, 1.3, BatchPlan(8, 1024), refit_every=1)
    assert cap.plan(1, 15) == BatchPlan(8, 1024) and cap.model is None
    for step in _steps(38.2, 1.55, 1.0, [1, 8, 15], [(8, 256)]):
        log.record(step.prefill_requests, step.prefill_tokens, step.decode_requests,
                   step.elapsed_ms)
    assert cap.plan(1, 15).decode_cap == 7 and cap.plan(1, 15).prefill_tokens < 16
    assert cap.snapshot(15)["model"]["samples"] == 9


# -- the linger -----------------------------------------------------------------------

@given(seen=st.lists(st.one_of(st.none(), st.floats(0, 1)), max_size=80),
       max_s=st.floats(0, 2))
def test_linger_stays_within_zero_and_its_maximum(seen, max_s):
    assert 0 <= linger_from(seen, max_s) <= max_s


def test_linger_is_learned_from_the_next_calls_that_came():
    now = [0.0]
    linger = LingerModel(1.0, lambda: now[0], min_samples=4)
    assert linger.linger_s() == 1.0, "nothing seen yet: the maximum"
    for i in range(10):  # a server-side chain: the next step 5 ms after the first
        linger.released(f"run{i}")
        now[0] += 0.005
        linger.acquired(f"run{i}")
        linger.released(f"run{i}")  # its last step: nothing follows
        now[0] += 2.0
    assert linger.linger_s() == pytest.approx(0.025)
    assert linger_from([None] * 20 + [0.1], 1.0) == 0.0, "next calls too rare to wait"


# -- whom to preempt ------------------------------------------------------------------

candidates = st.lists(st.builds(
    Candidate, key=st.uuids(), priority=st.just(BATCH),
    generated_tokens=st.integers(0, 200), max_tokens=st.just(256),
    in_prefill=st.booleans(), prefill_tokens=st.integers(0, 600)), max_size=16)


@given(cands=candidates, cap=st.integers(0, 16), tokens=st.integers(0, 2048))
def test_what_stays_fits_the_plan(cands, cap, tokens):
    stop = victims_beside_interactive(cands, BatchPlan(cap, tokens))
    stopped = {c.key for c in stop}
    assert len(stopped) == len(stop), "no request twice"
    kept = [c for c in cands if c.key not in stopped]
    assert len(kept) <= cap
    assert sum(c.prefill_tokens for c in kept if c.in_prefill) <= tokens
    # requests in prefill go before any decoding one
    if any(not c.in_prefill for c in stop):
        assert all(c.key in stopped for c in cands
                   if c.in_prefill and c.prefill_tokens > tokens)


def test_prefilling_requests_go_first_then_the_least_advanced():
    cands = [Candidate("a", BATCH, 100, 256), Candidate("b", BATCH, 10, 256),
             Candidate("c", BATCH, 0, 256, in_prefill=True, prefill_tokens=450)]
    assert [c.key for c in victims_beside_interactive(cands, BatchPlan(2, 0))] == ["c"]
    assert [c.key for c in victims_beside_interactive(cands, BatchPlan(1, 0))] == ["c", "b"]
    assert [c.key for c in victims_beside_interactive(cands, BatchPlan(3, 500))] == []


# -- the slots honour the plan --------------------------------------------------------

def _cap(plan: BatchPlan) -> DynamicCap:
    cap = DynamicCap(StepLog(), 1.3, plan)  # no steps: the plan is the fallback
    return cap


async def test_no_batch_prefill_starts_beside_interactive_work_when_the_plan_has_none():
    slots = PrioritySlots(capacity=8, policy=SlotPolicy(reserved_interactive=1, linger_s=0.0),
                          dynamic=_cap(BatchPlan(4, 0)))
    a = slots.slot(BATCH, 100)
    await a.acquire()
    i = slots.slot(INTERACTIVE, 20)
    await i.acquire()
    b = asyncio.create_task(slots.acquire(BATCH, 100))
    await asyncio.sleep(0.01)
    assert not b.done(), "its prefill would slow the interactive steps"
    i.release()
    await asyncio.wait_for(b, 1)
    slots.release(BATCH, 100)
    a.release()


async def test_decode_cap_of_the_plan_bounds_batch_slots_beside_interactive_work():
    slots = PrioritySlots(capacity=8, policy=SlotPolicy(reserved_interactive=1, linger_s=0.0),
                          dynamic=_cap(BatchPlan(2, 1 << 20)))
    i = slots.slot(INTERACTIVE)
    await i.acquire()
    got = [asyncio.create_task(slots.acquire(BATCH)) for _ in range(4)]
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in got) == 2
    i.release()
    await asyncio.wait_for(asyncio.gather(*got), 1)
    assert slots.batch_in_use == 4
    for _ in got:
        slots.release(BATCH)


class _SlowPrefill(FakeEngine):
    """A fake engine whose first chunk comes after ``prefill_s`` (a long prompt); an
    abort during that wait ends the stream with ``abort`` and no token, as vLLM's."""

    def __init__(self, prefill_s: float, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.prefill_s = prefill_s
        self.prefilling: set[str] = set()
        self.cut_in_prefill: list[str] = []

    async def generate(self, request: GenerationRequest,
                       ) -> AsyncGenerator[GenerationChunk, None]:
        rid = request.request_id
        self.prefilling.add(rid)
        await asyncio.sleep(self.prefill_s)
        if rid not in self.prefilling:
            self.cut_in_prefill.append(rid)
            yield GenerationChunk("", "abort", Usage(1, 0, 0), token_ids=())
            return
        self.prefilling.discard(rid)
        async with contextlib.aclosing(super().generate(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def abort(self, request_id: str) -> None:
        self.prefilling.discard(request_id)
        await super().abort(request_id)


async def _read(run: ResumableGeneration) -> str:
    async with contextlib.aclosing(run.stream()) as chunks:
        return "".join([c.text async for c in chunks])


async def test_batch_requests_in_prefill_are_preempted_first_and_finish_unchanged():
    engine = _SlowPrefill(0.3, responder=lambda r: f"{r.prompt}: one two three four",
                          chunk_chars=4, delay_s=0.005)
    slots = PrioritySlots(capacity=8,
                          policy=SlotPolicy(reserved_interactive=1, linger_s=0.0, preempt=True),
                          dynamic=_cap(BatchPlan(4, 0)))

    def request(rid: str, prompt: str) -> GenerationRequest:
        return GenerationRequest(rid, "fake-model", prompt=prompt,
                                 sampling=SamplingOptions(max_tokens=None))

    runs = [ResumableGeneration(engine, slots, request(f"b{i}", f"doc {i}"), BATCH, 400)
            for i in range(2)]
    readers = [asyncio.create_task(_read(run)) for run in runs]
    await asyncio.sleep(0.05)  # both granted, both still in prefill
    assert slots.batch_in_use == 2 and slots.preemptions == 0
    await _read(ResumableGeneration(engine, slots, request("i", "quick"), INTERACTIVE))
    texts = await asyncio.gather(*readers)
    assert slots.preemptions == 2, "the plan allows no batch prefill beside it"
    assert texts == [f"doc {i}: one two three four" for i in range(2)]
    assert all(run.resumptions == 1 for run in runs)
    assert engine.cut_in_prefill == ["b0", "b1"]
    assert slots.in_use == 0 and engine.running() == 0


async def test_under_a_fixed_cap_requests_in_prefill_are_never_preempted():
    engine = _SlowPrefill(0.2, responder=lambda r: f"{r.prompt}: one two",
                          chunk_chars=4, delay_s=0.005)
    slots = PrioritySlots(capacity=8,
                          policy=SlotPolicy(reserved_interactive=1, linger_s=0.0, preempt=True,
                                            batch_cap_when_interactive=1))
    runs = [ResumableGeneration(engine, slots, GenerationRequest(
        f"b{i}", "fake-model", prompt=f"doc {i}"), BATCH, 400) for i in range(2)]
    readers = [asyncio.create_task(_read(run)) for run in runs]
    await asyncio.sleep(0.05)
    await _read(ResumableGeneration(engine, slots, GenerationRequest(
        "i", "fake-model", prompt="q"), INTERACTIVE))
    await asyncio.gather(*readers)
    assert slots.preemptions == 0


def test_dynamic_plan_rejects_a_speedup():
    with pytest.raises(ValueError):
        DynamicCap(StepLog(), 0.5, BatchPlan(1, 0))
    assert math.isinf(StepModel(1, 1).step_ms(1, 10))


@settings(max_examples=25)
@given(maxlen=st.integers(1, 8), n=st.integers(0, 20))
def test_step_log_keeps_the_last_steps(maxlen, n):
    log = StepLog(maxlen)
    seen: list[EngineStep] = []
    log.listeners.append(seen.append)
    for k in range(n):
        log.record(0, 0, k, float(k))
    assert [s.decode_requests for s in log] == list(range(max(0, n - maxlen), n))
    assert log.recorded == n == len(seen)


# -- flags, engine arguments, the proxy -------------------------------------------------

class _TimedFake(FakeEngine):
    """A fake engine that keeps a step log, as the vLLM engine does."""

    def __init__(self) -> None:
        super().__init__(["fake-model"])
        self.steps = StepLog()

    def step_log(self) -> StepLog | None:
        return self.steps


async def test_auto_cap_plans_from_the_engines_log_and_readyz_shows_it(aiohttp_client):
    from flowlift.proxy import ProxyConfig, create_app
    from flowlift.proxy.state import STATE

    timed, plain = _TimedFake(), FakeEngine(["other-model"])
    app = create_app({"fake-model": timed, "other-model": plain}, ProxyConfig(
        scheduling="preempt", batch_cap_when_interactive="auto", interactive_slowdown=1.5))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    for step in _steps(40.0, 2.0, 1.0, [1, 8, 15], [(8, 300)]):
        timed.steps.record(step.prefill_requests, step.prefill_tokens,
                           step.decode_requests, step.elapsed_ms)
    backends = app[STATE].backends.backends
    slots = {b.engine: b.slots for b in backends}
    assert slots[timed].dynamic is not None and slots[timed].linger is not None
    assert slots[plain].dynamic is None and slots[plain].linger is not None
    # beside one interactive request: 42 ms alone, 63 ms allowed -> 10 at 2 ms each
    assert slots[timed].batch_plan() == BatchPlan(10, 1)
    ready = await (await client.get("/readyz")).json()
    plan = ready["batch_plans"]["engine-0"]
    assert plan["model"]["per_decode_ms"] == 2.0 and plan["slowdown"] == 1.5
    assert plan["plan_beside_one"] == {"decode_cap": 10, "prefill_tokens": 1}
    assert plan["linger_s"] == 1.0, "no next call seen yet: the longest linger"


async def test_a_fixed_cap_keeps_the_fixed_plan(aiohttp_client):
    from flowlift.proxy import ProxyConfig, create_app
    from flowlift.proxy.state import STATE

    app = create_app({"fake-model": _TimedFake()}, ProxyConfig(batch_cap_when_interactive=3))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    slots = app[STATE].backends.backends[0].slots
    assert slots.dynamic is None and slots.batch_plan() == BatchPlan(3, 1024)
    assert "batch_plans" not in await (await client.get("/readyz")).json()


def test_serve_flags_reach_the_proxy_and_the_engine(engine_configs):
    from flowlift import cli
    from flowlift.local_engine.vllm_engine import VLLMConfig, engine_kwargs

    args = cli.build_parser().parse_args([
        "serve", "--batch-cap-when-interactive", "auto", "--interactive-slowdown", "1.5",
        "--max-step-tokens", "256"])
    flags = cli.serve_flags(args)
    assert (flags["batch_cap_when_interactive"], flags["interactive_slowdown"]) == ("auto", 1.5)
    cli._engines(args)
    assert engine_kwargs(engine_configs[-1])["max_num_batched_tokens"] == 256
    assert engine_configs[-1].step_timings, "the auto cap needs the engine's step times"
    cli._engines(cli.build_parser().parse_args(["serve", "--batch-cap-when-interactive", "4"]))
    assert not engine_configs[-1].step_timings, "no stats kept where nothing reads them"
    assert "max_num_batched_tokens" not in engine_kwargs(
        VLLMConfig(model="/m", served_model_name="m"))
    assert cli.build_parser().parse_args(
        ["serve", "--batch-cap-when-interactive", "4"]).batch_cap_when_interactive == 4


def test_a_step_smaller_than_the_batch_is_refused():
    from flowlift.errors import EngineError
    from flowlift.local_engine.vllm_engine import VLLMConfig, engine_kwargs

    with pytest.raises(EngineError, match="at least max_num_seqs"):
        engine_kwargs(VLLMConfig(model="/m", served_model_name="m", max_num_seqs=16,
                                 max_num_batched_tokens=8))


@pytest.mark.parametrize("args", [
    ("--batch-cap-when-interactive", "lots"), ("--batch-cap-when-interactive", "-1"),
    ("--interactive-slowdown", "0.5"), ("--interactive-slowdown", "nan"),
    ("--max-step-tokens", "0")])
def test_nonsense_values_exit_2_with_a_readable_message(capsys, args):
    from flowlift import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--engine", "fake", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {args[0]}: " in err and "must " in err, err


def test_the_vllm_stat_logger_records_each_real_iteration():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from flowlift.local_engine.step_log import vllm_stat_logger

    log = StepLog()
    logger = vllm_stat_logger(log)(None, 0)

    def details(dummy: bool) -> SimpleNamespace:
        return SimpleNamespace(num_ctx_requests=1, num_ctx_tokens=300,
                               num_generation_requests=7, elapsed_ms=321.5, is_dummy=dummy)

    logger.record(SimpleNamespace(iteration_details=details(False)), None)
    logger.record(SimpleNamespace(iteration_details=details(True)), None)
    logger.record(SimpleNamespace(iteration_details=None), None)
    logger.record(None, None)
    assert [(s.prefill_requests, s.prefill_tokens, s.decode_requests, s.elapsed_ms)
            for s in log] == [(1, 300, 7, 321.5)]


async def test_the_slots_linger_as_long_as_programs_were_seen_to_take():
    import time

    linger = LingerModel(10.0, time.monotonic, min_samples=4)
    slots = PrioritySlots(capacity=4, policy=SlotPolicy(reserved_interactive=1, linger_s=10.0),
                          linger=linger)
    for k in range(6):  # chains whose next step came at once, then ended
        first = Priority.of("interactive", program=f"run{k}")
        await slots.acquire(first)
        slots.release(first)
        await slots.acquire(first)
        slots.release(first)
    assert linger.linger_s() < 1.0
    await asyncio.sleep(linger.linger_s() + 0.05)
    assert not slots.interactive_active(), "not the fixed 10 s"
    waiting = asyncio.create_task(slots.acquire(BATCH, 100))
    await asyncio.wait_for(waiting, 1)
    slots.release(BATCH, 100)
