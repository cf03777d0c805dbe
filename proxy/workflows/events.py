"""A run's event log: numbered events, any number of followers, replay from an id.

Every event gets the next sequence number (its SSE ``id``), so a client that lost its
connection resumes with ``Last-Event-ID`` and misses nothing. An optional ``sink``
persists each event as it is appended (see :mod:`flowlift.proxy.workflows.store`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

Event = tuple[int, str, dict[str, Any]]
FINAL = "run.finished"


class EventLog:
    """Append-only events of one run.

    Args:
        sink: called with each new event (``seq, name, data``) before followers see it.
        history: events restored from the store (their numbers are kept).
    """

    def __init__(self, sink: Callable[[int, str, dict[str, Any]], None] | None = None,
                 history: Iterable[Event] = ()) -> None:
        self._events: list[Event] = list(history)
        self._sink = sink
        self._changed = asyncio.Event()
        self.listeners = 0
        self.listened = asyncio.Event()  # set once anyone has followed the log
        self.ended = False  # no more events here (the run went to another proxy)

    @property
    def last_seq(self) -> int:
        return self._events[-1][0] if self._events else 0

    def emit(self, name: str, data: dict[str, Any]) -> int:
        seq = self.last_seq + 1
        if self._sink is not None:
            self._sink(seq, name, data)
        self._events.append((seq, name, data))
        self._changed.set()
        return seq

    def end(self) -> None:
        """No more events will come here (the run's lease went to another proxy): every
        follower's stream ends after the events it has not read yet, so its client
        reconnects and follows the run where it runs now."""
        self.ended = True
        self._changed.set()

    def history(self) -> list[Event]:
        return list(self._events)

    async def follow(self, after: int = 0) -> AsyncIterator[Event]:
        """Events with ``seq > after``: the past at once, then new ones as they come;
        ends after the run's final event."""
        self.listeners += 1
        self.listened.set()
        try:
            index = next((i for i, e in enumerate(self._events) if e[0] > after),
                         len(self._events))
            while True:
                while index < len(self._events):
                    event = self._events[index]
                    index += 1
                    yield event
                    if event[1] == FINAL:
                        return
                if self.ended:
                    return
                self._changed.clear()
                await self._changed.wait()
        finally:
            self.listeners -= 1
