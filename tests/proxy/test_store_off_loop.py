"""Store calls off the event loop (issue 28 item 2): a stalled run store delays the runs
that wait on it, never ``/healthz`` and the other requests; events reach followers only
once written, in order, and a failed write holds back that event and the rest."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.state import STATE
from flowlift.proxy.store.events import EventLog
from flowlift.proxy.store.worker import StoreWorker
from flowlift.testing import FakeEngine, parse_sse

T = TypeVar("T")
STALL_S = 0.5


class OnTheLoop(StoreWorker):
    """The control: every store call runs at once on the caller's thread (the event
    loop), as before the worker."""

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # (the future carries it, as the worker's does)
            future.set_exception(exc)
        return future


def _stall(store: Any, calls: list[str]) -> None:
    """Every write and read of ``store`` takes STALL_S more (a database that hangs)."""
    for name in ("create", "exists", "append", "load", "prune", "tool_results", "requests"):
        real = getattr(store, name)

        def slow(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            time.sleep(STALL_S)
            return _real(*args, **kwargs)

        setattr(store, name, slow)


async def _probe_during_a_run(aiohttp_client: Any, tmp_path: Path,
                              worker: StoreWorker | None) -> tuple[list[float], list[str],
                                                                   list[Any]]:
    """``/healthz`` latencies (s) while one workflow runs on a stalled store, the store
    calls made, and the workflow's events."""
    app = create_app({"fake-model": FakeEngine(["fake-model"])},
                     ProxyConfig(state_path=tmp_path / "state.sqlite"))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    runs = app[STATE].runs
    if worker is not None:
        runs.io = worker
    calls: list[str] = []
    _stall(runs.store, calls)

    async def workflow() -> list[Any]:
        resp = await client.post("/v1/workflows", json={"nodes": [
            {"kind": "llm", "id": "a", "model": "fake-model", "params": {"max_tokens": 4},
             "messages": [{"role": "user", "content": [{"text": "hi"}]}]}]})
        return parse_sse(await resp.text())

    started = asyncio.ensure_future(workflow())
    latencies: list[float] = []
    deadline = time.monotonic() + 20.0  # (bounded, whatever happens)
    while not started.done() and time.monotonic() < deadline:
        t0 = time.perf_counter()
        assert (await client.get("/healthz")).status == 200
        latencies.append(time.perf_counter() - t0)
        await asyncio.sleep(0.02)
    return latencies, calls, await asyncio.wait_for(started, 20.0)


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def test_a_stalled_store_does_not_stall_healthz(aiohttp_client, tmp_path: Path) -> None:
    latencies, calls, events = await _probe_during_a_run(aiohttp_client, tmp_path, None)
    assert [name for name, _ in events][-1] == "run.finished"
    assert calls.count("append") >= 3 and "create" in calls  # (the stall was met)
    assert len(latencies) >= 20
    assert _p99(latencies) < 0.25, sorted(latencies)[-5:]


async def test_the_control_with_store_calls_on_the_loop_stalls_healthz(
        aiohttp_client, tmp_path: Path) -> None:
    """The same probe without the worker: the probe sees each stall (so the test above
    can fail)."""
    latencies, _, events = await _probe_during_a_run(aiohttp_client, tmp_path, OnTheLoop())
    assert [name for name, _ in events][-1] == "run.finished"
    assert _p99(latencies) >= 0.8 * STALL_S, sorted(latencies)[-5:]


def _pending_writes() -> tuple[EventLog, list[asyncio.Future[None]]]:
    """An event log whose sink's writes land when the test resolves their futures."""
    loop = asyncio.get_running_loop()
    writes: list[asyncio.Future[None]] = []

    def sink(seq: int, name: str, data: dict[str, Any]) -> asyncio.Future[None]:
        writes.append(loop.create_future())
        return writes[-1]

    return EventLog(sink), writes


async def test_followers_get_an_event_only_once_its_write_landed_in_order() -> None:
    log, writes = _pending_writes()
    seen: list[int] = []

    async def follow() -> None:
        async for seq, _, _ in log.follow():
            seen.append(seq)

    follower = asyncio.ensure_future(follow())
    for name in ("a", "b", "run.finished"):
        log.emit(name, {})
    await asyncio.sleep(0.01)
    assert seen == [] and log.durable_seq == 0  # nothing written yet
    writes[1].set_result(None)  # the second landed, the first not yet: still nothing
    await asyncio.sleep(0.01)
    assert seen == []
    writes[0].set_result(None)
    await asyncio.sleep(0.01)
    assert seen == [1, 2] and log.durable_seq == 2
    writes[2].set_result(None)
    await asyncio.wait_for(follower, 1.0)
    assert seen == [1, 2, 3]


async def test_a_failed_write_holds_back_its_event_and_every_later_one() -> None:
    log, writes = _pending_writes()
    for name in ("a", "b", "c"):
        log.emit(name, {})
    writes[0].set_result(None)
    writes[1].set_exception(OSError("disk gone"))
    writes[2].set_result(None)
    await asyncio.sleep(0.01)
    assert log.durable_seq == 1
    log.end()
    assert [seq async for seq, _, _ in log.follow()] == [1]


async def test_a_stalled_call_is_said_and_callers_with_a_bound_get_a_503() -> None:
    """A call that does not return (a database restarting, unreachable, out of
    connections): :meth:`StoreWorker.behind` says so after ``stall_s``; a call given
    ``within_s`` is answered StoreUnavailable then, and never runs once its caller has
    been answered."""
    import threading

    import pytest

    from flowlift.errors import StoreUnavailable

    worker = StoreWorker(stall_s=0.2)
    release, ran = threading.Event(), []
    stuck = worker.later(release.wait, 10.0)
    await asyncio.sleep(0.05)
    assert worker.behind() is None  # (not yet)
    await asyncio.sleep(0.25)
    assert "has not answered for" in (worker.behind() or "")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as refused:
        await worker.call(ran.append, "late", within_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 1.0
    assert refused.value.status == 503 and refused.value.code == "store_unavailable"
    release.set()
    await stuck
    await worker.flush()
    assert ran == [] and worker.behind() is None  # the late call never ran
    assert await worker.call(lambda: 7, within_s=1.0) == 7
    worker.close()


async def test_a_busy_store_that_keeps_finishing_calls_is_waited_on_not_refused() -> None:
    """A bounded call behind many quick calls (a burst of new runs on a busy machine)
    waits past ``within_s`` while the store keeps finishing calls; found by the 1,000-run
    burst of ``tests/reliability/test_load.py``, which got 503s from a store keeping up."""
    worker = StoreWorker()
    for _ in range(40):
        worker.submit(time.sleep, 0.01)  # 0.4 s of work ahead, each call finishing
    t0 = time.monotonic()
    assert await worker.call(lambda: "created", within_s=0.1) == "created"
    assert time.monotonic() - t0 > 0.3  # waited well past within_s, and got its answer
    worker.close()


async def test_a_busy_store_is_refused_past_its_patience() -> None:
    """Past MOVING_PATIENCE times ``within_s`` a moving store answers 503 too, and the
    call, not started, never runs."""
    import pytest

    from flowlift.errors import StoreUnavailable
    from flowlift.proxy.store.worker import MOVING_PATIENCE

    worker, ran = StoreWorker(), []
    for _ in range(200):
        worker.submit(time.sleep, 0.01)  # 2 s of work ahead
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="calls behind"):
        await worker.call(ran.append, "late", within_s=0.05)
    assert MOVING_PATIENCE * 0.05 <= time.monotonic() - t0 < 1.5
    await worker.flush()
    assert ran == []
    worker.close()


async def test_a_caller_that_goes_away_leaves_no_call_behind() -> None:
    """A client gone before its call started (its task cancelled): the call never runs."""
    import threading

    worker, ran = StoreWorker(), []
    gate = threading.Event()
    worker.submit(gate.wait, 5.0)
    waiting = asyncio.ensure_future(worker.call(ran.append, "create", within_s=3.0))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.sleep(0.01)
    gate.set()
    await worker.flush()
    assert ran == [] and worker.backlog == 0
    worker.close()
