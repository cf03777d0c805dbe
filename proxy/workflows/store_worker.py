"""Store calls off the event loop: one worker thread that runs every run-store call in
the order it was asked.

The stores (:mod:`flowlift.proxy.workflows.store`, ``store_pg``) are synchronous: a
SQLite commit or a round trip to PostgreSQL. Called on the proxy's event loop, a slow
or stalled database stalled every request of the proxy, ``/healthz`` included. The
registry hands each call to this worker instead and awaits its future, so the loop
serves everything else meanwhile.

**Order and durability.** One thread, one FIFO queue (a
:class:`concurrent.futures.ThreadPoolExecutor` of one worker): calls run one at a time
in the order they were submitted, so a run's events are written in ``seq`` order, a
lease is released after the run's last event, and a read submitted after a write sees
it. An event reaches followers only once its write has returned (committed: see
:class:`~flowlift.proxy.workflows.events.EventLog`), so "in the database before any
client hears of it" holds as it did when writes blocked the loop.

**Two lanes.** A call that creates a run, or that only asks whether the database
answers, is *urgent* (``call(..., urgent=True)``): it runs before every ordinary call
waiting, in order among the urgent ones, so a new run or a readiness probe does not
queue behind the events of every run started before it. Creating a run depends on no
other run's writes (a second create of one id still finds the first: creates keep their
order), and a run's own events are submitted only after its create returned.

**Bound.** The queue itself takes every call (an event already computed is never
dropped); admission is bounded instead: while more than ``max_backlog`` calls wait, or
the call at the head has run for more than ``stall_s`` (a database that restarts, is out
of connections or unreachable: the store retries inside the call, see
:mod:`~flowlift.proxy.workflows.store_pg`), :meth:`behind` says so and new runs are
refused with a 503 and ``Retry-After`` until the store catches up. A caller that answers
a client gives its call ``within_s`` (:meth:`call`): a store that finished no call for
that long (stalled), or one still moving but past :data:`MOVING_PATIENCE` times it,
answers the client :class:`~flowlift.errors.StoreUnavailable` (503) instead of a wait,
and a call that had not started by then never runs. A store that keeps finishing calls
is waited on: a burst of 1,000 new runs on a 2-core machine queues creates for ~2.7 s
behind each other (the worker shares the interpreter lock with the loop that is parsing
the burst), which is a busy store, not a failed one (``tests/reliability/test_load.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from flowlift.errors import StoreUnavailable

T = TypeVar("T")

MOVING_PATIENCE = 10
"""How many times its ``within_s`` a bounded call waits while the store keeps finishing
other calls (a busy store) before its caller is answered 503."""


_Call = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[object, ...]]
"""A call waiting: its future, the function and its arguments."""


class StoreWorker:
    """The run store's worker thread (see the module docstring).

    Args:
        max_backlog: calls waiting above which :meth:`behind` answers (new runs wait).
        stall_s: how long one call may run before :meth:`behind` answers.
    """

    def __init__(self, max_backlog: int = 10_000, stall_s: float = 2.0) -> None:
        self.max_backlog = max_backlog
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._urgent: deque[_Call] = deque()
        self._ordinary: deque[_Call] = deque()
        self._closed = False
        self._waiting = 0
        self._finished = 0  # calls finished so far (how a moving store is told)
        self._since: float | None = None  # time.monotonic() the running call began
        self._thread = threading.Thread(target=self._work, name="flowlift-store",
                                        daemon=True)  # (a call stuck on a vanished
        self._thread.start()                          # database must not hold the exit)

    @property
    def backlog(self) -> int:
        """Calls submitted and not finished yet."""
        return self._waiting

    @property
    def stalled_s(self) -> float:
        """How long the running call has run (0.0: none runs)."""
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def behind(self) -> str | None:
        """Why new runs should wait (the store is ``max_backlog`` calls behind, or its
        running call has not returned for ``stall_s``), or None."""
        if self._waiting > self.max_backlog:
            return (f"the run store is {self._waiting} writes behind (a slow or unreachable "
                    "database); retry shortly")
        stalled = self.stalled_s
        if stalled > self.stall_s:
            return (f"the run store has not answered for {stalled:.1f} s (its database is "
                    "restarting, out of connections or unreachable); retry shortly")
        return None

    def _timed(self, fn: Callable[..., T], *args: object) -> T:
        """On the worker: ``fn(*args)``, its start noted for :attr:`stalled_s`."""
        self._since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._since = None

    def _work(self) -> None:
        """The worker thread: the urgent calls first, each lane in order."""
        while True:
            with self._ready:
                while not self._urgent and not self._ordinary and not self._closed:
                    self._ready.wait()
                if not self._urgent and not self._ordinary:
                    return  # closed and drained
                future, fn, args = (self._urgent or self._ordinary).popleft()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = self._timed(fn, *args)
                    except BaseException as exc:  # (the future carries it to its caller)
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self._waiting -= 1
                    self._finished += 1

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the worker after every call submitted before.

        Returns:
            Its future (the call's result, or its exception).
        """
        return self._submit(fn, *args)

    def _submit(self, fn: Callable[..., T], *args: object,
                urgent: bool = False) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the run store's worker is closed")
            self._waiting += 1
            (self._urgent if urgent else self._ordinary).append((future, fn, args))
            self._ready.notify()
        return future

    def later(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """:meth:`submit` as an asyncio future of the running loop (its callbacks run on
        the loop)."""
        return asyncio.wrap_future(self.submit(fn, *args))

    async def call(self, fn: Callable[..., T], *args: object,
                   within_s: float | None = None, urgent: bool = False) -> T:
        """``fn(*args)`` on the worker, awaited; ``within_s``: at most that long (a
        client waits for the answer), else as long as it takes; ``urgent``: ahead of
        the ordinary calls waiting (a call no earlier write must precede: see the
        module docstring).

        Raises:
            StoreUnavailable: the store finished no call for ``within_s`` (stalled), or
                kept finishing others for :data:`MOVING_PATIENCE` times ``within_s``
                (a call that had not started by then never runs; one that had runs to
                its end unheard).
            Exception: whatever ``fn`` raised.
        """
        future = self._submit(fn, *args, urgent=urgent)
        waited = asyncio.wrap_future(future)
        if within_s is None:
            return await waited
        give_up = time.monotonic() + MOVING_PATIENCE * within_s
        finished = self._finished
        while True:
            try:
                done, _ = await asyncio.wait({waited}, timeout=within_s)
            except asyncio.CancelledError:
                waited.cancel()  # (its caller went away: a call not started never runs)
                raise
            if done:
                return waited.result()
            moved, finished = self._finished != finished, self._finished
            if not moved or time.monotonic() >= give_up:
                break
        future.cancel()  # (not started: never runs; running: ends unheard)
        waited.cancel()
        raise StoreUnavailable(
            (f"the run store did not answer within {within_s:g} s (a stalled or "
             "unreachable database); retry shortly") if not moved else
            (f"the run store is {self._waiting} calls behind and did not answer within "
             f"{MOVING_PATIENCE * within_s:g} s (a slow database); retry shortly"),
            retry_after_s=1.0)

    async def flush(self) -> None:
        """Wait until every call submitted before has finished (the queue is FIFO)."""
        await self.call(lambda: None)

    def drain(self, timeout_s: float) -> bool:
        """Wait (blocking) up to ``timeout_s`` for every call submitted before.

        Returns:
            Whether they all finished.
        """
        flushed = self.submit(lambda: None)
        return not concurrent.futures.wait([flushed], timeout=timeout_s).not_done

    def close(self, wait: bool = True) -> None:
        """Wait for every call submitted, then stop the thread; ``wait=False``: drop the
        calls not started and leave a running one to end by itself (a call stuck on a
        vanished database must not hold the proxy's exit)."""
        with self._ready:
            self._closed = True
            dropped = [] if wait else [*self._urgent, *self._ordinary]
            if not wait:
                self._urgent.clear()
                self._ordinary.clear()
                self._waiting -= len(dropped)
            self._ready.notify()
        for future, *_ in dropped:
            future.cancel()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()
