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

**Bound.** The queue itself takes every call (an event already computed is never
dropped); admission is bounded instead: while more than ``max_backlog`` calls wait,
:meth:`behind` says so and new runs are refused with a 503 and ``Retry-After`` until the
store catches up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StoreWorker:
    """The run store's worker thread (see the module docstring).

    Args:
        max_backlog: calls waiting above which :meth:`behind` answers (new runs wait).
    """

    def __init__(self, max_backlog: int = 10_000) -> None:
        self.max_backlog = max_backlog
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flowlift-store")
        self._lock = threading.Lock()
        self._waiting = 0

    @property
    def backlog(self) -> int:
        """Calls submitted and not finished yet."""
        return self._waiting

    def behind(self) -> str | None:
        """Why new runs should wait (the store is ``max_backlog`` calls behind), or None."""
        if self._waiting <= self.max_backlog:
            return None
        return (f"the run store is {self._waiting} writes behind (a slow or unreachable "
                "database); retry shortly")

    def _done(self, _: object) -> None:
        with self._lock:
            self._waiting -= 1

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the worker after every call submitted before.

        Returns:
            Its future (the call's result, or its exception).
        """
        with self._lock:
            self._waiting += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self._done)
        return future

    def later(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """:meth:`submit` as an asyncio future of the running loop (its callbacks run on
        the loop)."""
        return asyncio.wrap_future(self.submit(fn, *args))

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the worker, awaited.

        Raises:
            Exception: whatever ``fn`` raised.
        """
        return await self.later(fn, *args)

    async def flush(self) -> None:
        """Wait until every call submitted before has finished (the queue is FIFO)."""
        await self.call(lambda: None)

    def close(self) -> None:
        """Wait for every call submitted, then stop the thread."""
        self._pool.shutdown(wait=True)
