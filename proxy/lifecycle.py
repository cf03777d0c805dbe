"""The proxy's life: readiness, and a graceful drain on SIGTERM.

* ``/healthz`` -- the process is alive and its event loop answers (liveness).
* ``/readyz`` -- 200 only while the engines are loaded, the run store answers (not
  stalled, failing or far behind: ``RunRegistry.unavailable``), every ``[tools.*]``
  server starts and lists its tools (``ToolServers.problems``: the server and why) and
  the proxy is not draining; otherwise 503 with ``reason`` (readiness: a Kubernetes
  Service stops sending traffic to a pod that is not ready).
* :func:`serve` -- listen until SIGTERM (or SIGINT), then drain:

  1. stop accepting new work: ``/readyz`` turns 503, and a request that would start
     work (a workflow, a chat/completion/embedding/response) gets 503 with
     ``Retry-After`` (OpenAI error shape, code ``shutting_down``; the gate is
     :func:`flowlift.proxy.middleware.readiness_gate`, reading the app's :class:`Drain`).
     The listener stays open, so what is already under way can finish: a run's
     ``@tool`` results are still taken and its event stream can still be followed.
  2. wait up to ``grace_s`` for in-flight requests and running workflow runs to end;
  3. suspend the runs still going (their event log is already on disk: the run's
     state), so a proxy started on the same ``--state-db`` resumes them and the SDK
     reconnects; a step that was generating when it was suspended runs again there;
  4. close the listener, the engines and the store; flush the logs; exit 0.

  A second signal cuts the grace period short (step 3 at once).

:func:`run` runs :func:`serve` on uvloop's event loop (libuv; MagicStack/uvloop) when it
is installed -- it is a dependency where it builds (not on Windows) -- and on asyncio's
own otherwise, or when ``FLOWLIFT_EVENT_LOOP=asyncio`` asks for it.

The drain follows Kubernetes' pod termination contract (SIGTERM, then SIGKILL after
``terminationGracePeriodSeconds``): set that above ``grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from flowlift.errors import StoreUnavailable
from flowlift.proxy.half_close import ProxyRunner
from flowlift.proxy.state import STATE, ProxyState
from flowlift.proxy.workflows.registry import RunRegistry
from flowlift.proxy.workflows.runs import Run
from flowlift.tracing import get_logger

log = get_logger("flowlift.lifecycle")


@dataclass(slots=True)
class Drain:
    """Shutdown state of one proxy: requests in flight, and since when it drains.

    Attributes:
        draining_since: ``time.monotonic()`` when the drain began, or None.
        in_flight: requests being served (probes not counted).
        suspended: ids of the runs checkpointed because the grace period ran out.
        finished: runs that ended during the drain.
    """

    draining_since: float | None = None
    in_flight: int = 0
    suspended: list[str] = field(default_factory=list)
    finished: int = 0

    @property
    def draining(self) -> bool:
        return self.draining_since is not None


DRAIN: web.AppKey[Drain] = web.AppKey("flowlift.drain", Drain)


async def not_ready_reason(state: ProxyState, drain: Drain) -> str | None:
    """Why the proxy should get no traffic now, or None when it is ready."""
    if drain.draining:
        return "draining: the proxy is shutting down"
    if state.load_error:
        return f"the engine failed to load: {state.load_error}"
    if not state.ready.is_set():
        return "the engine is still loading"
    unavailable = state.runs.unavailable()  # (no I/O: a stalled or failing store)
    if unavailable:
        return unavailable
    try:  # (off the loop, and never waiting behind a stalled call for long)
        problem = await state.runs.io.call(state.runs.store.problem, within_s=2.0)
    except StoreUnavailable as exc:
        return exc.message
    if problem:
        return f"the run store is not usable: {problem}"
    return state.tools.problems()  # a [tools.*] server that cannot start, named


def _busy(runs: RunRegistry) -> list[Run]:
    """Runs doing work: not those parked after a restart until their client reconnects."""
    return [r for r in runs.active.values()
            if not (r.parked and not r.log.listened.is_set())]


async def drain(app: web.Application, grace_s: float, hurry: asyncio.Event) -> Drain:
    """Stop taking work, let what is in flight finish for up to ``grace_s`` seconds (or
    until ``hurry`` is set), then suspend the runs still going.

    Returns:
        The app's :class:`Drain` (``suspended`` lists the checkpointed run ids).
    """
    state, gate = app[STATE], app[DRAIN]
    gate.draining_since = time.monotonic()
    runs = state.runs
    busy = _busy(runs)
    parked = [r for r in runs.active.values() if r not in busy]
    for run in parked:  # nothing under way: suspended now, resumed on the next start
        run.suspend()
    log.info("drain_started", grace_s=grace_s, in_flight=gate.in_flight, runs=len(busy))
    deadline = gate.draining_since + grace_s
    while (gate.in_flight or _busy(runs)) and not hurry.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hurry.wait(), timeout=min(left, 0.05))
    still = _busy(runs)
    gate.finished = sum(1 for r in busy if r not in still)
    for run in still:
        run.suspend()
        gate.suspended.append(run.run_id)
    tasks = [r.task for r in parked + still if r.task is not None]
    if tasks:
        await asyncio.wait(tasks, timeout=5.0)
    log.info("drain_done", waited_s=round(time.monotonic() - gate.draining_since, 2),
             finished_runs=gate.finished, suspended_runs=gate.suspended,
             in_flight=gate.in_flight)
    return gate


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to the first address ``host`` resolves to, not listening yet:
    the port is ours (a taken one fails here, before any model loads), and clients are
    refused, not left hanging, until :func:`serve` listens on it.

    Raises:
        OSError: the address is taken or not this machine's.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart on the port
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


T = TypeVar("T")


def event_loop_factory(env: dict[str, str] | None = None
                       ) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` when uvloop is installed and ``FLOWLIFT_EVENT_LOOP`` is
    not ``asyncio``; None (asyncio's default loop) otherwise."""
    env = dict(os.environ) if env is None else env
    if env.get("FLOWLIFT_EVENT_LOOP", "").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


GC_YOUNG_THRESHOLD = 10_000
"""Allocations between two collections of the cyclic GC's youngest generation once the
proxy serves (CPython's default: 700; 3.14's: 2,000)."""


def settle_heap() -> None:
    """Tune the cyclic garbage collector for serving, once the proxy is ready: move
    everything alive now (imports, config, the loaded engines) out of its reach
    (``gc.freeze``, after a collection so no garbage is kept), so that a full
    collection scans only what requests created since, and collect the youngest
    generation every :data:`GC_YOUNG_THRESHOLD` allocations rather than every 700.

    Why (measured under ``bench/proxy_overhead.py``'s load, bench/RESULTS.md, issue 28
    item 5): a full collection walked the whole start-up heap (~130,000 objects, ~58 ms
    each, one every ~1,800 requests) and young collections ran every few requests, at a
    fixed cost each: together ~12% of the proxy's CPU, and a 58 ms stall now and then.
    ``gc.freeze`` is the standard library's way (its docs; Instagram, "Dismissing Python
    Garbage Collection at Instagram", 2017). Frozen objects are still freed by
    reference counting; only reference cycles among them are never collected.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` (e.g. :func:`serve`) to its end on a new event loop: uvloop's where
    :func:`event_loop_factory` gives it, else asyncio's."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(main)


async def serve(app: web.Application, sock: socket.socket, *, grace_s: float = 30.0,
                cancel_after_s: float = 1.0) -> str | None:
    """Serve ``app`` on ``sock`` (from :func:`bind`) until SIGTERM/SIGINT, then drain
    (see the module). A client that disconnects cancels its request's handler, so a
    whole (non-streamed) answer nobody waits for any more stops generating too.

    Args:
        grace_s: how long in-flight work may take to finish after the signal.
        cancel_after_s: after the grace period (and the suspensions), how long aiohttp
            waits for the requests still open before cancelling them.

    Returns:
        ``None`` after a signal; the reason when the engines failed to load (the proxy
        then stops instead of answering 503 forever, so a supervisor sees the failure).
    """
    runner = ProxyRunner(app, shutdown_timeout=cancel_after_s, handle_signals=False,
                         handler_cancellation=True)  # answers half-closed requests
    stop, hurry = asyncio.Event(), asyncio.Event()
    state = app[STATE]

    async def watch_load() -> None:
        while not state.ready.is_set() and not state.load_error:
            await asyncio.sleep(0.2)
        if state.load_error:
            stop.set()
        else:
            settle_heap()

    def on_signal(signum: int) -> None:
        (hurry if stop.is_set() else stop).set()
        log.info("signal", signal=signal.Signals(signum).name)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        log.info("listening", address=sock.getsockname()[:2], grace_s=grace_s)
        watcher = asyncio.create_task(watch_load())
        await stop.wait()
        watcher.cancel()
        if state.load_error:
            return state.load_error
        await drain(app, grace_s, hurry)
        return None
    finally:
        await runner.cleanup()  # listener closed, engines and store closed
        log.info("stopped")
        sys.stderr.flush()
        sys.stdout.flush()
