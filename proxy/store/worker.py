"""Store calls off the event loop: one worker thread that runs every run-store call in
the order it was asked.

The stores (:mod:`flowlift.proxy.store.sqlite`, ``store_pg``) are synchronous: a
SQLite commit or a round trip to PostgreSQL. Called on the proxy's event loop, a slow
or stalled database stalled every request of the proxy, ``/healthz`` included. The
registry hands each call to this worker instead and awaits its future, so the loop
serves everything else meanwhile.

**Order and durability.** One thread, one FIFO queue (a
:class:`concurrent.futures.ThreadPoolExecutor` of one worker): calls run one at a time
in the order they were submitted, so a run's events are written in ``seq`` order, a
lease is released after the run's last event, and a read submitted after a write sees
it. An event reaches followers only once its write has returned (committed: see
:class:`~flowlift.proxy.store.events.EventLog`), so "in the database before any
client hears of it" holds as it did when writes blocked the loop.

**Bound.** The queue itself takes every call (an event already computed is never
dropped); admission is bounded instead: while more than ``max_backlog`` calls wait, or
the call at the head has run for more than ``stall_s`` (a database that restarts, is out
of connections or unreachable: the store retries inside the call, see
:mod:`~flowlift.proxy.store.postgres`), :meth:`behind` says so and new runs are
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
from collections.abc import Callable
from typing import TypeVar

from flowlift.errors import StoreUnavailable

T = TypeVar("T")

MOVING_PATIENCE = 10
"""How many times its ``within_s`` a bounded call waits while the store keeps finishing
other calls (a busy store) before its caller is answered 503."""


class StoreWorker:
    """The run store's worker thread (see the module docstring).

    Args:
        max_backlog: calls waiting above which :meth:`behind` answers (new runs wait).
        stall_s: how long one call may run before :meth:`behind` answers.
    """

    def __init__(self, max_backlog: int = 10_000, stall_s: float = 2.0) -> None:
        self.max_backlog = max_backlog
        self.stall_s = stall_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flowlift-store")
        self._lock = threading.Lock()
        self._waiting = 0
        self._finished = 0  # calls run to their end (how a moving store is told; the
        # worker alone writes it)
        self._since: float | None = None  # time.monotonic() the running call began

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
            self._finished += 1  # (a call that ran: one cancelled unstarted is no progress)

    def _done(self, _: object) -> None:
        with self._lock:
            self._waiting -= 1

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the worker after every call submitted before.

        Returns:
            Its future (the call's result, or its exception).
        """
        return self._submit(fn, *args)

    def _submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        with self._lock:
            self._waiting += 1
        future = self._pool.submit(self._timed, fn, *args)
        future.add_done_callback(self._done)
        return future

    def later(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """:meth:`submit` as an asyncio future of the running loop (its callbacks run on
        the loop)."""
        return asyncio.wrap_future(self.submit(fn, *args))

    async def call(self, fn: Callable[..., T], *args: object,
                   within_s: float | None = None) -> T:
        """``fn(*args)`` on the worker, awaited; ``within_s``: at most that long (a
        client waits for the answer), else as long as it takes.

        Raises:
            StoreUnavailable: the store finished no call for ``within_s`` (stalled), or
                kept finishing others for :data:`MOVING_PATIENCE` times ``within_s``
                (a call that had not started by then never runs; one that had runs to
                its end unheard).
            Exception: whatever ``fn`` raised.
        """
        future = self._submit(fn, *args)
        waited = asyncio.wrap_future(future)
        if within_s is None:
            return await waited
        give_up = time.monotonic() + MOVING_PATIENCE * within_s
        finished = self._finished
        while True:
            try:
                done, _ = await asyncio.wait({waited}, timeout=within_s)
            except asyncio.CancelledError:
                # (its caller went away: a call not started never runs; the thread's own
                # future is cancelled here, not on the loop's next turn, so the worker
                # cannot start it in between)
                future.cancel()
                waited.cancel()
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
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
