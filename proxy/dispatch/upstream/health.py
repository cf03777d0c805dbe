"""The health of one upstream backend: requests in flight, the evidence that it fails
requests in general, the cool-down that evidence causes and the probe that ends it.
Every count goes through :meth:`Health.call` and the :class:`Call` it returns, so a
request is counted in once and out once, on every path.

The rule (a backend is cooled on evidence about the *backend*, never on one request's
bad luck):

* **Evidence** (:data:`Evidence`) is what a failed attempt says:

  - ``"down"`` -- no HTTP answer at all (connection refused or reset before the
    response headers) or a 5xx answer: the backend fails. Counts.
  - ``"silent"`` -- the attempt timed out before any response header arrived (a black
    hole). Counts only if the backend answered *no other request* since this attempt
    was sent; a backend that answered others meanwhile is alive, and the silence was
    about this request (a prompt it chews on, a model it stalls).
  - ``"busy"`` -- a 429. With ``Retry-After`` the backend takes nothing until then
    (the upstream said so); without it, nothing is recorded (the request backs off).
  - ``"request"`` -- about the request only, never counted: a 4xx, a first-token
    timeout after the response headers came, a stream stalled (idle timer) or cut
    after its first events.

* **Cooling**: ``failures_to_cool`` (N) *distinct requests in a row* whose attempts gave
  counting evidence, each within ``window_s`` of the first of them, cool the backend for
  ``cooldown_s`` (or the upstream's ``Retry-After`` when longer). A request retried on the
  same backend counts once however many of its attempts failed; any success breaks the
  row.

* **Recovery by probe**: when the cool-down ends the backend is *half-open*: exactly one
  request goes through as a probe while the others still see it unavailable. The
  probe's success closes the circuit; counting evidence from it cools the backend again
  at once (for ``cooldown_s``); a probe that ends with no evidence either way (its own
  stall, a 4xx, a cancel) lets the next request probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Evidence = Literal["down", "silent", "busy", "request"]
"""What one failed attempt says about its backend (see the module doc)."""

PROBE_WAIT_S = 1.0
"""``Retry-After`` while a half-open backend's probe is in flight (seconds)."""


@dataclass(slots=True)
class Health:
    """Circuit state of one backend (the rule is the module doc's).

    Attributes:
        failures_to_cool: N, distinct requests in a row with counting evidence.
        cooldown_s: how long a cooled backend takes nothing (seconds).
        window_s: the row's span: a failure more than this after the row's first one
            starts a new row (seconds).
        max_in_flight: requests in flight before the backend is full.
        clock: monotonic seconds (injected by tests).
        consecutive_failures: distinct requests in the current row.
        cooled_until: ``clock()`` time until which the backend takes nothing.
        half_open: the cool-down ended and no probe has succeeded yet.
        probing: a probe request is in flight.
        answered_at: ``clock()`` time the backend last answered any request (response
            headers of a non-5xx answer).
    """

    failures_to_cool: int = 3
    cooldown_s: float = 30.0
    window_s: float = 60.0
    max_in_flight: int = 64
    clock: Callable[[], float] = time.monotonic
    consecutive_failures: int = 0
    cooled_until: float = 0.0
    half_open: bool = False
    probing: bool = False
    answered_at: float = float("-inf")
    in_flight: int = 0
    _row: set[int] = field(default_factory=set)
    _row_started: float = 0.0
    _requests: int = 0

    def available(self, now: float) -> bool:
        """Whether a new request may go to the backend at ``now`` (not cooling, no
        other probe in flight, room in flight)."""
        return not self.cooling(now) and self.in_flight < self.max_in_flight

    def cooling(self, now: float) -> bool:
        """Cooled down, or half-open with its one probe already in flight."""
        return now < self.cooled_until or (self.half_open and self.probing)

    def wait_s(self, now: float) -> float:
        """Seconds until the backend may take a request again (0: it may now)."""
        if now < self.cooled_until:
            return self.cooled_until - now
        return PROBE_WAIT_S if self.half_open and self.probing else 0.0

    def call(self, request: int | None = None) -> Call:
        """Count one attempt in; the returned :class:`Call` counts it out and records
        its outcome (the only code that touches these counters).

        Args:
            request: the id of the request the attempt belongs to (attempts of one
                request count once toward cooling); None: a request of its own.
        """
        self.in_flight += 1
        if request is None:
            self._requests -= 1
            request = self._requests  # negative: never equal to a caller's id
        probe = self.half_open and not self.probing and self.clock() >= self.cooled_until
        if probe:
            self.probing = True
        return Call(self, request, self.clock(), probe)

    # -- outcomes (through Call) ------------------------------------------------------
    def _answered(self, at: float) -> None:
        self.answered_at = max(self.answered_at, at)

    def _success(self) -> None:
        self.consecutive_failures = 0
        self._row.clear()
        self.cooled_until = 0.0
        self.half_open = self.probing = False

    def _failure(self, call: Call, evidence: Evidence, retry_after_s: float | None) -> None:
        now = self.clock()
        if evidence == "busy":
            if retry_after_s is not None:
                self._cool(now + retry_after_s)
            return
        counts = evidence == "down" or (evidence == "silent"
                                        and self.answered_at < call.started)
        if not counts:
            return
        if call.probe:
            self._cool(now + max(self.cooldown_s, retry_after_s or 0.0))
            return
        if not self._row or now - self._row_started > self.window_s:
            self._row, self._row_started = set(), now
        self._row.add(call.request)
        self.consecutive_failures = len(self._row)
        if self.consecutive_failures >= self.failures_to_cool:
            self._cool(now + max(self.cooldown_s, retry_after_s or 0.0))

    def _cool(self, until: float) -> None:
        self.cooled_until = max(self.cooled_until, until)
        self.half_open = True  # after the cool-down: one probe first
        self.probing = False
        self._row.clear()
        self.consecutive_failures = 0


@dataclass(slots=True)
class Call:
    """One attempt in flight on an upstream (from :meth:`Health.call`).

    :meth:`answered` notes that the backend sent response headers; :meth:`succeeded`
    or :meth:`failed` records the outcome as soon as it is known (a client that reads
    the end of an answer finds the health already updated); :meth:`close` counts the
    attempt out, once, whatever happened (cancelled included).

    Attributes:
        request: the id of the request the attempt belongs to.
        started: ``health.clock()`` when it was sent.
        probe: it is the half-open backend's probe.
        status: the HTTP status of its answer once the headers came, else None.
    """

    health: Health
    request: int
    started: float
    probe: bool = False
    closed: bool = False
    status: int | None = None

    def answered(self, status: int) -> None:
        """The backend sent this attempt's response headers with HTTP ``status`` (a
        non-5xx answer shows the backend alive)."""
        self.status = status
        if status < 500:
            self.health._answered(self.health.clock())

    def succeeded(self) -> None:
        """The answer went through whole: the circuit closes."""
        self.health._answered(self.health.clock())
        self.health._success()
        self.probe = False

    def failed(self, evidence: Evidence, *, retry_after_s: float | None = None) -> None:
        """The attempt failed; ``evidence`` says what that tells about the backend
        (``retry_after_s``: the upstream's ``Retry-After``, seconds)."""
        self.health._failure(self, evidence, retry_after_s)
        self._end_probe()

    def close(self) -> None:
        """Count the attempt out (idempotent); a probe that ended without a verdict
        lets the next request probe."""
        if not self.closed:
            self.closed = True
            self.health.in_flight -= 1
            self._end_probe()

    def _end_probe(self) -> None:
        if self.probe:
            self.probe = False
            self.health.probing = False
