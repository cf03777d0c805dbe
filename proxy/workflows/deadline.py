"""One deadline for a whole run, with a clock that stops while the app has the ball.

While any client-run (``@tool``) step is out, the run is waiting on the application,
not on flowlift, so that time is not charged to the deadline; the clock resumes when
the last outstanding result arrives.
"""

from __future__ import annotations

import asyncio
import time


class DeadlineClock:
    """A pausable countdown of ``budget_s`` seconds.

    Use ``async with clock.paused():`` around client-run waits, and ``await
    clock.expired()`` to wait for the budget to run out.
    """

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self._left_s = budget_s
        self._since: float | None = time.monotonic()
        self._pauses = 0
        self._changed = asyncio.Event()

    def left_s(self) -> float:
        """Budget left now, in seconds (never negative)."""
        running = 0.0 if self._since is None else time.monotonic() - self._since
        return max(self._left_s - running, 0.0)

    def _pause(self) -> None:
        self._pauses += 1
        if self._pauses == 1:
            self._left_s = self.left_s()
            self._since = None
            self._changed.set()

    def _resume(self) -> None:
        self._pauses -= 1
        if self._pauses == 0:
            self._since = time.monotonic()
            self._changed.set()

    def paused(self) -> _Paused:
        return _Paused(self)

    async def expired(self) -> None:
        """Return once the budget is used up (paused time does not count)."""
        while True:
            self._changed.clear()
            if self._since is None:
                await self._changed.wait()
                continue
            left = self.left_s()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except TimeoutError:
                if self.left_s() <= 0:
                    return


class _Paused:
    def __init__(self, clock: DeadlineClock) -> None:
        self._clock = clock

    async def __aenter__(self) -> None:
        self._clock._pause()

    async def __aexit__(self, *exc: object) -> None:
        self._clock._resume()
