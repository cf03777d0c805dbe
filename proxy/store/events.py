"""A run's event log: numbered events, any number of followers, replay from an id.

Every event gets the next sequence number (its SSE ``id``), so a client that lost its
connection resumes with ``Last-Event-ID`` and misses nothing. An optional ``sink``
persists each event as it is appended (see :mod:`flowlift.proxy.store.sqlite`); a
sink that writes off the event loop returns the write's future, and followers get the
event only once that write (and every one before it) has landed -- never an event the
store may not hold. A write that fails holds back that event and every later one.

Tool calls are handed out, not broadcast: a follower that serves a tool (``serves``:
its names, or None for all of them, as the run's own client) claims each ``tool.wanted``
of that name it reads first; while it holds the claim, other followers that serve the
name do not get that event. The claim ends with the step's result (``step.finished``,
``step.failed``, ``tool.result``) or with the claimant's stream, whose claims are then
offered to the others. Followers that serve none of it see the event as any other.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any, TypeAlias

Event = tuple[int, str, dict[str, Any]]
Written: TypeAlias = "asyncio.Future[None] | None"
"""What a sink returns: None (written already) or the future of the write."""
FINAL = "run.finished"
WANTED = "tool.wanted"
ANSWERED = ("step.finished", "step.failed", "tool.result")


class EventLog:
    """Append-only events of one run.

    Args:
        sink: called with each new event (``seq, name, data``) before followers see it.
        history: events restored from the store (their numbers are kept).
    """

    def __init__(self, sink: Callable[[int, str, dict[str, Any]], Written] | None = None,
                 history: Iterable[Event] = ()) -> None:
        self._events: list[Event] = list(history)
        self._durable = len(self._events)  # how many of them followers may see (written)
        self._ahead: set[int] = set()  # events written while an earlier one was not
        self._cap = sys.maxsize  # a write failed: followers see nothing from it on
        self._sink = sink
        self._changed = asyncio.Event()
        self.listeners = 0
        self.listened = asyncio.Event()  # set once anyone has followed the log
        self.ended = False  # no more events here (the run went to another proxy)
        self._claims: dict[str, object] = {}  # waiting tool call -> the follower it went to
        self._answered: set[str] = {d.get("step_id", "") for _, n, d in self._events
                                    if n in ANSWERED}

    @property
    def last_seq(self) -> int:
        return self._events[-1][0] if self._events else 0

    def emit(self, name: str, data: dict[str, Any]) -> int:
        seq = self.last_seq + 1
        written = None if self._sink is None else self._sink(seq, name, data)
        self._events.append((seq, name, data))
        if name in ANSWERED:
            self._answered.add(data.get("step_id", ""))
            self._claims.pop(data.get("step_id", ""), None)
        if written is None:
            self._landed(len(self._events))
        else:
            written.add_done_callback(functools.partial(self._landed, len(self._events)))
        return seq

    def _landed(self, count: int, write: asyncio.Future[None] | None = None) -> None:
        """The write of the ``count``-th event returned: followers may see it once every
        event before it landed too, unless it or one before it failed."""
        if write is not None and (write.cancelled() or write.exception() is not None):
            self._cap = min(self._cap, count - 1)
            return
        self._ahead.add(count)
        moved = False
        while self._durable + 1 in self._ahead and self._durable < self._cap:
            self._ahead.discard(self._durable + 1)
            self._durable += 1
            moved = True
        if moved:
            self._changed.set()

    @property
    def durable_seq(self) -> int:
        """The number of the last event followers may see (its write landed)."""
        return self._events[self._durable - 1][0] if self._durable else 0

    def end(self) -> None:
        """No more events will come here (the run's lease went to another proxy): every
        follower's stream ends after the events it has not read yet, so its client
        reconnects and follows the run where it runs now."""
        self.ended = True
        self._changed.set()

    def history(self) -> list[Event]:
        return list(self._events)

    def _take(self, me: object, event: Event, serves: frozenset[str] | None) -> bool:
        """Whether follower ``me`` gets ``tool.wanted`` ``event`` now (claiming it when it
        serves the tool); False: another follower holds it."""
        data = event[2]
        step_id = data.get("step_id", "")
        if serves is not None and data.get("name") not in serves:
            return True
        if step_id in self._answered:
            return True
        holder = self._claims.setdefault(step_id, me)
        return holder is me

    def _release(self, me: object) -> None:
        mine = [step for step, holder in self._claims.items() if holder is me]
        for step in mine:
            del self._claims[step]
        if mine:
            self._changed.set()  # the other followers take them over

    async def follow(self, after: int = 0, serves: frozenset[str] | None = None
                     ) -> AsyncGenerator[Event, None]:
        """Events with ``seq > after``: the past at once, then new ones as they come;
        ends after the run's final event. ``serves``: the tools this follower runs (None:
        all), so it gets a ``tool.wanted`` only when no other follower holds it (see the
        module docstring); a held one comes once its holder's stream ends unanswered."""
        me = object()
        held: list[Event] = []  # tool calls another follower holds
        self.listeners += 1
        self.listened.set()
        try:
            index = next((i for i, e in enumerate(self._events[:self._durable])
                          if e[0] > after), self._durable)
            while True:
                while index < self._durable:
                    event = self._events[index]
                    index += 1
                    if event[1] == WANTED and not self._take(me, event, serves):
                        held.append(event)
                        continue
                    yield event
                    if event[1] == FINAL:
                        return
                held = [e for e in held if e[2].get("step_id") not in self._answered]
                freed = [e for e in held if self._take(me, e, serves)]
                for event in freed:
                    held.remove(event)
                    yield event
                if freed or index < self._durable:
                    continue
                if self.ended:
                    return
                self._changed.clear()
                await self._changed.wait()
        finally:
            self.listeners -= 1
            self._release(me)
