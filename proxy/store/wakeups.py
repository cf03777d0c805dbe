"""Wakeups: how the registry's waiters learn that the run store changed for them.

Several proxies on one PostgreSQL run store hand runs to each other through the store:
a replica tails a run another executes, the owner picks up the ``@tool`` results,
appends, closes and cancels posted elsewhere, and a replica takes over a run whose
lease was released. Each of these waits on a :class:`Watch` of the kinds of change it
cares about, for some run keys (:func:`~flowlift.proxy.tenants.run_key`) or any:

=============  =========================================  ==============================
kind           written when                               who waits
=============  =========================================  ==============================
``event``      a run's event is appended                  tails of that run
``posted``     a tool result, append, close or cancel     the run's owner (its pickup)
               is kept for a run
``released``   a run's lease is released unfinished       every replica (takeover)
``claimed``    another proxy claims a run's lease         its holder (it lost the run)
=============  =========================================  ==============================

This base class has no channel (SQLite: one proxy owns the file; or a listener not
started): a watch wakes when its poll interval ``poll_s`` passes, as plain polling did,
or when this proxy itself calls :meth:`Wakeups.notify`. The PostgreSQL store's
:class:`~flowlift.proxy.store.postgres_listen.PgWakeups` feeds :meth:`notify` from
``LISTEN``; while it listens the watches fall back to the slower ``fallback_s`` (the
safety net), and whenever its connection is down they poll every ``poll_s`` again by
themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Container, Iterator
from typing import Final

KINDS: Final = frozenset({"event", "posted", "released", "claimed"})


class Watch:
    """One waiter's interest: ``kinds`` maps each kind to the run keys it cares about
    (None: any key). Use it as :meth:`Wakeups.watch` hands it out."""

    def __init__(self, owner: Wakeups, kinds: dict[str, Container[str] | None]) -> None:
        unknown = set(kinds) - KINDS
        if unknown:
            raise ValueError(f"unknown wakeup kinds {sorted(unknown)}; known: {sorted(KINDS)}")
        self._owner = owner
        self.kinds = kinds
        self._woken = asyncio.Event()

    def wants(self, kind: str, key: str) -> bool:
        keys = self.kinds.get(kind, ())
        return kind in self.kinds and (keys is None or not key or key in keys)

    def wake(self) -> None:
        self._woken.set()

    def clear(self) -> None:
        """Forget the wakeups so far: call it before reading the store, so that a change
        written while the read runs wakes the next :meth:`wait` at once."""
        self._woken.clear()

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Until a change this watch wants is announced, or ``timeout_s`` passes (None:
        the poll interval, :meth:`Wakeups.interval`).

        Returns:
            True when woken by a change, False when the interval passed.
        """
        timeout = self._owner.interval() if timeout_s is None else timeout_s
        try:
            await asyncio.wait_for(self._woken.wait(), timeout)
        except TimeoutError:
            return False
        return True


class Wakeups:
    """The watches of one proxy (see the module docstring).

    Args:
        poll_s: how often a watch polls while nothing announces changes.
        fallback_s: how often it polls while a channel announces them (:attr:`listening`).
    """

    def __init__(self, poll_s: float = 0.2, fallback_s: float = 2.0) -> None:
        self.poll_s = poll_s
        self.fallback_s = fallback_s
        self._watches: set[Watch] = set()

    @property
    def listening(self) -> bool:
        """Whether a channel announces the store's changes now (never, here)."""
        return False

    def interval(self) -> float:
        """How long a watch waits when nothing wakes it."""
        return self.fallback_s if self.listening else self.poll_s

    @contextlib.contextmanager
    def watch(self, **kinds: Container[str] | None) -> Iterator[Watch]:
        """A :class:`Watch` of ``kinds`` (``event={key}``, ``released=None``...) while the
        block runs.

        Raises:
            ValueError: a kind that is not one of :data:`KINDS`.
        """
        watch = Watch(self, kinds)
        self._watches.add(watch)
        try:
            yield watch
        finally:
            self._watches.discard(watch)

    def notify(self, kind: str, key: str) -> None:
        """Wake the watches that want ``kind`` for run ``key`` (``""``: any run). Call it
        on the event loop."""
        for watch in list(self._watches):
            if watch.wants(kind, key):
                watch.wake()

    def wake_all(self) -> None:
        """Wake every watch (the channel went down or came back: whatever it missed is
        read again, and the next waits use the new interval)."""
        for watch in list(self._watches):
            watch.wake()

    def start(self) -> None:
        """Begin announcing changes (a channel's listener); nothing here."""

    def close(self) -> None:
        """Stop announcing changes; nothing here."""
