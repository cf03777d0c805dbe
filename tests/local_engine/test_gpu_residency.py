"""Residency on a GPU, simulated: swaps by sleep/wake where host memory allows and by
unload otherwise; the unload off the event loop; a load after an unload waiting for the
GPU memory to come back; ``session_id`` handed to vLLM when its ``generate`` takes it.
No GPU: vLLM's ``AsyncLLM`` is the stand-in of tests/local_engine/test_vllm_engine_close.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from flowlift.errors import EngineError
from flowlift.local_engine import gpu_swap
from flowlift.local_engine.base import ChatMessage, GenerationRequest, SamplingOptions
from flowlift.local_engine.residency import ManagedModel, ResidencyManager
from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine
from tests.local_engine.test_vllm_engine_close import StandInAsyncLLM
from tests.proxy.test_residency_dispatch import LoadedOnly

GiB = 1 << 30


class Sleeper(LoadedOnly):
    """A model that can sleep: its GPU share leaves the ledger, its weights (``host_mb``)
    go to the host."""

    def __init__(self, name: str, ledger: dict[str, float], budget_mb: float,
                 host_mb: float) -> None:
        super().__init__(name, ledger, budget_mb)
        self.host_mb, self.calls = host_mb, []

    def sleep_host_mb(self) -> float:
        return self.host_mb

    async def sleep(self) -> None:
        self.calls.append("sleep")
        self.ledger.pop(self.name, None)
        self.started = False

    async def wake_up(self) -> None:
        self.calls.append("wake")
        await LoadedOnly.start(self)

    async def start(self) -> None:
        self.calls.append("start")
        await super().start()

    async def close(self) -> None:
        self.calls.append("close")
        await super().close()


def _pair(host_mb: float, host_free_mb: float) -> tuple[ResidencyManager, dict[str, Sleeper]]:
    ledger: dict[str, float] = {}
    engines = {n: Sleeper(n, ledger, 400.0, host_mb) for n in ("a", "b")}
    mgr = ResidencyManager({n: ManagedModel(e, 400.0) for n, e in engines.items()}, 400.0,
                           host_available_mb=lambda: host_free_mb)
    return mgr, engines


async def test_a_swap_sleeps_and_wakes_where_the_host_has_room():
    mgr, engines = _pair(host_mb=1000.0, host_free_mb=64_000.0)
    for model in ("a", "b", "a", "b"):
        await mgr.ensure(model)
    assert engines["a"].calls == ["start", "sleep", "wake", "sleep"]
    assert engines["b"].calls == ["start", "sleep", "wake"]
    assert mgr.events[1:3] == [("sleep", "a"), ("load", "b")]
    assert mgr.asleep == {"a"} and mgr.resident == ["b"]
    assert (mgr.sleeps["a"], mgr.unloads["a"], mgr.loads["a"]) == (2, 2, 2)
    await mgr.close()  # the sleeping model's process goes too
    assert engines["a"].calls[-1] == "close" and engines["b"].calls[-1] == "close"
    assert mgr.asleep == set()


@pytest.mark.parametrize(("host_mb", "host_free_mb"), [(1000.0, 3000.0), (0.0, 64_000.0)])
async def test_a_swap_unloads_without_room_on_the_host_or_without_sleep_mode(host_mb,
                                                                            host_free_mb):
    mgr, engines = _pair(host_mb, host_free_mb)
    for model in ("a", "b", "a"):
        await mgr.ensure(model)
    assert engines["a"].calls == ["start", "close", "start"]
    assert ("sleep", "a") not in mgr.events and not mgr.asleep
    await mgr.close()


def test_swap_mode():
    assert gpu_swap.swap_mode(True, 16_000, 32_000) == "sleep"
    assert gpu_swap.swap_mode(True, 16_000, 18_000) == "unload"  # reserve
    assert gpu_swap.swap_mode(False, 16_000, 500_000) == "unload"
    assert gpu_swap.swap_mode(True, 0, 500_000) == "unload"


def test_host_available_mb(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 32000000 kB\nMemAvailable:   2048000 kB\n")
    assert gpu_swap.host_available_mb(meminfo) == 2000.0
    assert gpu_swap.host_available_mb(tmp_path / "missing") == 0.0


class SlowShutdown(StandInAsyncLLM):
    """vLLM's shutdown blocks while the engine core exits (up to ~6 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.slept: list[int] = []
        self.woken = 0

    def shutdown(self) -> None:
        time.sleep(0.6)
        super().shutdown()

    async def sleep(self, level: int = 1) -> None:
        self.slept.append(level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.woken += 1
        return True


def _config(tmp_path: Path, **kw: Any) -> VLLMConfig:
    return VLLMConfig(model=str(tmp_path), served_model_name="m", **kw)


async def test_close_runs_vllms_shutdown_off_the_event_loop(tmp_path):
    import vllm.v1.engine.exceptions  # noqa: F401 - imported by a real start already

    engine = VLLMEngine(_config(tmp_path), build=lambda _c: SlowShutdown())
    await engine.start()
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.02)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    await engine.close()
    ticker.cancel()
    assert max(gaps) < 0.3, max(gaps)  # before: the loop stood still for the 0.6 s
    assert engine.running() is None


async def test_sleep_and_wake_call_vllms_sleep_level_1(tmp_path):
    stand_in = SlowShutdown()
    engine = VLLMEngine(_config(tmp_path, enable_sleep_mode=True, weights_mb=300.0),
                        build=lambda _c: stand_in)
    await engine.start()
    assert engine.sleep_host_mb() == 300.0
    await engine.sleep()
    assert stand_in.slept == [1] and engine.asleep
    await engine.wake_up()
    assert stand_in.woken == 1 and not engine.asleep
    plain = VLLMEngine(_config(tmp_path, weights_mb=300.0), build=lambda _c: stand_in)
    assert plain.sleep_host_mb() == 0.0
    await plain.start()
    with pytest.raises(EngineError, match="without sleep mode"):
        await plain.sleep()


class Gpu:
    """``(free, total)`` bytes over time: the memory an exited engine held comes back
    after ``late`` probes."""

    def __init__(self, late: int, free: int = 10 * GiB, back: int = 60 * GiB) -> None:
        self.late, self.free, self.back, self.probes = late, free, back, 0

    def __call__(self) -> tuple[int, int]:
        self.probes += 1
        return (self.back if self.probes > self.late else self.free), 80 * GiB


async def test_a_load_after_an_unload_waits_for_the_memory(tmp_path):
    built: list[float] = []
    gpu = Gpu(late=3)
    engine = VLLMEngine(_config(tmp_path, gpu_memory_utilization=0.5),
                        build=lambda _c: built.append(gpu.probes) or StandInAsyncLLM(),
                        gpu_memory=gpu)
    waited = await gpu_swap.wait_for_memory(0.5, Gpu(late=2), poll_s=0.01)
    assert waited > 0
    engine.memory_wait_s = 5.0
    await asyncio.wait_for(engine.start(), 10)
    assert built == [4]  # built once, after the memory came back


async def test_a_start_that_failed_short_of_memory_is_retried(tmp_path):
    attempts: list[int] = []
    gpu = Gpu(late=2)

    def build(_c: VLLMConfig) -> StandInAsyncLLM:
        attempts.append(gpu.probes)
        if len(attempts) == 1:
            raise EngineError("the vLLM engine failed to start: Engine core initialization "
                              "failed")
        return StandInAsyncLLM()

    engine = VLLMEngine(_config(tmp_path, gpu_memory_utilization=0.5), build=build,
                        gpu_memory=gpu, memory_wait_s=0.0)
    await engine.start()
    assert len(attempts) == 2


async def test_a_start_that_failed_with_memory_free_is_not_retried(tmp_path):
    attempts: list[int] = []

    def build(_c: VLLMConfig) -> StandInAsyncLLM:
        attempts.append(1)
        raise EngineError("the vLLM engine failed to start: bad checkpoint")

    engine = VLLMEngine(_config(tmp_path, gpu_memory_utilization=0.5), build=build,
                        gpu_memory=Gpu(late=0), memory_wait_s=0.0)
    with pytest.raises(EngineError, match="bad checkpoint"):
        await engine.start()
    assert attempts == [1]


class WithSessions(StandInAsyncLLM):
    """vLLM's ``generate`` as of 0.32: it takes ``session_id``."""

    def __init__(self) -> None:
        super().__init__()
        self.sessions: list[str | None] = []

    def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0,
                 session_id: str | None = None) -> Any:
        self.sessions.append(session_id)
        return super().generate(prompt, params, request_id, priority)


def _request(rid: str, session: str | None) -> GenerationRequest:
    return GenerationRequest(rid, "m", (ChatMessage("user", "hi there"),),
                             SamplingOptions(max_tokens=2), session_id=session)


@pytest.mark.parametrize("stand_in", [WithSessions, StandInAsyncLLM])
async def test_session_id_reaches_vllm_where_generate_takes_it(tmp_path, stand_in):
    llm = stand_in()
    engine = VLLMEngine(_config(tmp_path), build=lambda _c: llm)
    await engine.start()
    for rid, session in (("r1", "run-7"), ("r2", None)):
        stream = engine.generate(_request(rid, session))
        await anext(stream)
        await stream.aclose()
    if isinstance(llm, WithSessions):
        assert llm.sessions == ["run-7", None]
    await engine.close()
