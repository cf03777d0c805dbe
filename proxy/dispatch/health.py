"""The health of one upstream backend: requests in flight, consecutive failures and the
cool-down they cause. Every count goes through :meth:`Health.call` and the
:class:`Call` it returns, so a request is counted in once and out once, on every path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class Health:
    """Circuit state of one backend: consecutive failures, cool-down, requests in flight.

    ``failures_to_cool`` consecutive failures cool the backend for ``cooldown_s`` (or
    the upstream's ``Retry-After`` when longer); a 429 with ``Retry-After`` cools it at
    once for that long. One success closes the circuit again.
    """

    failures_to_cool: int = 3
    cooldown_s: float = 30.0
    consecutive_failures: int = 0
    cooled_until: float = 0.0
    in_flight: int = 0
    max_in_flight: int = 64

    def available(self, now: float) -> bool:
        return now >= self.cooled_until and self.in_flight < self.max_in_flight

    def cooling(self, now: float) -> bool:
        return now < self.cooled_until

    def success(self) -> None:
        self.consecutive_failures = 0
        self.cooled_until = 0.0

    def failure(self, now: float, *, status: int | None = None,
                retry_after: float | None = None) -> None:
        self.consecutive_failures += 1
        until = 0.0
        if status == 429 and retry_after is not None:
            until = now + retry_after
        if self.consecutive_failures >= self.failures_to_cool:
            until = max(until, now + max(self.cooldown_s, retry_after or 0.0))
        self.cooled_until = max(self.cooled_until, until)

    def call(self) -> Call:
        """Count one request in; the returned :class:`Call` counts it out and records
        its outcome (the only code that touches these counters)."""
        self.in_flight += 1
        return Call(self)


@dataclass(slots=True)
class Call:
    """One request in flight on an upstream (from :meth:`Health.call`).

    :meth:`succeeded` or :meth:`failed` records the outcome as soon as it is known (a
    client that reads the end of an answer finds the health already updated);
    :meth:`close` counts the request out, once, whatever happened (cancelled included).
    """

    health: Health
    closed: bool = False

    def succeeded(self) -> None:
        """The answer went through whole: the circuit closes."""
        self.health.success()

    def failed(self, *, status: int | None = None, retry_after_s: float | None = None) -> None:
        """The backend failed this request (``status`` and ``Retry-After`` when it said)."""
        self.health.failure(time.monotonic(), status=status, retry_after=retry_after_s)

    def close(self) -> None:
        """Count the request out (idempotent)."""
        if not self.closed:
            self.closed = True
            self.health.in_flight -= 1
