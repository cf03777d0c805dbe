"""Attempts of one request across a route's backends, until one answers.

Per attempt: connect timeout, a first-token timeout (headers and the first stream
event) and, for plain answers, the request's remaining budget (case R3). The last
stream attempt the route allows (``max_attempts``) has no attempt to fail over to, so it
waits for its first event within what is left of the request's budget instead of the
first-token timeout (issue 38, item 12: a timeout meant to fail over only cuts off an
answer nothing replaces); a whole answer keeps its per-attempt ``response_timeout_s``. Failures
before anything reached the client are retried: at once on another backend when one is
untried, else after the upstream's ``Retry-After`` (case R1) or jittered exponential
backoff ("full jitter", Brooker 2015) -- tenacity does the waiting and the stop rules
(attempts, and no wait that would end past the request's total budget).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson
from httpx_sse import EventSource, ServerSentEvent
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_random_exponential,
)

from flowlift.errors import Overloaded, UpstreamError
from flowlift.proxy.dispatch.routing.latency import CacheReport, Demand, Features, LatencyBook
from flowlift.proxy.dispatch.routing.routing import Route
from flowlift.proxy.dispatch.slots.scheduler import Slot
from flowlift.proxy.dispatch.upstream.health import Call, Evidence
from flowlift.proxy.dispatch.upstream.http import TRANSPORT_ERRORS, Answer, as_httpx, translate
from flowlift.proxy.dispatch.upstream.provider import Upstream, error_from
from flowlift.proxy.wire.sse_bytes import complete_prefix, has_data
from flowlift.tracing import get_logger

if TYPE_CHECKING:
    from flowlift.proxy.dispatch.backends import Backends, Local

log = get_logger("flowlift.proxy.dispatch.upstream.attempts")
_BACKOFF = wait_random_exponential(multiplier=0.25, max=8.0)
_REQUESTS = itertools.count()
BodyFor = Callable[[Upstream], bytes]
HeadersFor = Callable[[Upstream], Mapping[str, str]]
"""The headers one upstream gets besides the request's own (its ``pass_headers``, the
hints it opted in to)."""
Admit = Callable[[], Awaitable[Slot]]
"""Waits for a slot of the route's upstream pool and returns it, granted, before each
upstream attempt (workflow steps wait there in priority order); None: no pool
(drop-in requests)."""
Stream = Literal[False, "bytes", "events"]
"""How an answer is read: whole (False), as raw bytes cut at event boundaries
(forwarding), or as parsed server-sent events (upstream-backed workflow steps)."""


@dataclass(slots=True)
class Timing:
    """One attempt's times, for the replica's latency model
    (:class:`~flowlift.proxy.dispatch.routing.latency.LatencyBook`).

    Attributes:
        book: where the replica's model lives.
        model: the model asked.
        demand: the request as known before it was sent.
        features: the request on the replica when sent.
        started: ``time.monotonic()`` when sent.
        first_at: when the first stream event (or the whole answer) came.
    """

    book: LatencyBook
    model: str
    demand: Demand
    features: Features
    started: float
    first_at: float = 0.0

    def done(self, name: str, output_tokens: int | None, *, streamed: bool,
             cache: CacheReport | None = None) -> None:
        """The attempt on replica ``name`` succeeded now with ``output_tokens`` (None:
        unknown); ``streamed``: False for a whole answer (its TTFT is not measured);
        ``cache``: what the replica reported of its prompt cache (the TTFT model learns
        the uncached tokens it reported, not the ones expected)."""
        now = time.monotonic()
        features = self.features
        if cache is not None:
            features = dataclasses.replace(
                features, cached_tokens=round(features.prompt_tokens * cache.hit))
        self.book.observe(name, self.model, features, ttft_s=self.first_at
                          - self.started, total_s=now - self.started,
                          output_tokens=output_tokens, now=now, streamed=streamed)
        self.book.sent(name, self.demand.affinity, self.demand.prompt_tokens,
                       expected_cached=self.features.cached_tokens, report=cache)


@dataclass(slots=True)
class Opened:
    """A successful attempt, not yet delivered. The caller must :meth:`release` it and
    records its outcome on ``call`` (:class:`~flowlift.proxy.dispatch.upstream.provider.Call`)."""

    upstream: Upstream
    call: Call
    answer: Answer
    body: bytes | None = None  # plain answers,
    doc: dict[str, Any] | None = None  # and the JSON object they hold (parsed once)
    events: AsyncIterator[ServerSentEvent] | None = None  # streams read as events
    first: ServerSentEvent | None = None
    head: bytes = b""  # streams forwarded as bytes: the whole events received so far,
    tail: bytes = b""  # the start of the next one,
    chunks: AsyncIterator[bytes] | None = None  # and the rest as it arrives
    slot: Slot | None = None  # the pool slot it holds (see Admit)
    timing: Timing | None = None  # for the replica's latency model
    waited_s: float = 0.0  # seconds its request waited on upstreams until now (see Waited)
    cache: CacheReport | None = None  # what the replica reported of the prompt's cache

    def succeeded(self, output_tokens: int | None = None) -> None:
        """The answer went through whole (``output_tokens``: its length, if known): the
        backend's circuit closes and its latency model learns the answer's times (and
        its prefix cache from :attr:`cache`, when the reader of the answer set it)."""
        self.call.succeeded()
        if self.timing is not None:
            self.timing.done(self.upstream.name, output_tokens, streamed=self.body is None,
                             cache=self.cache)

    async def release(self) -> None:
        """Close the upstream answer, count the request out of the backend and give
        its pool slot back."""
        try:
            for it in (self.events, self.chunks):
                aclose = getattr(it, "aclose", None)  # (async generators have one)
                if aclose is not None:
                    await aclose()
            await self.answer.aclose()
        finally:
            self.call.close()
            if self.slot is not None:
                self.slot.release()


@dataclass(slots=True)
class Waited:
    """Seconds one request's attempts spent waiting on upstreams: each attempt from
    sending its request to its whole answer or first stream event (failed attempts
    too), back-off between attempts, and a pool slot's queue. What the proxy's own
    overhead leaves out (:mod:`flowlift.proxy.telemetry.requests`)."""

    s: float = 0.0


def _evidence(call: Call, exc: UpstreamError) -> Evidence:
    """What a failed attempt says about its backend (the rule is
    :mod:`flowlift.proxy.dispatch.upstream.health`'s): no HTTP answer is ``"down"`` (a timeout:
    ``"silent"``), a 5xx ``"down"``, a 429 ``"busy"``; anything after a non-5xx
    answer's headers (a first-token timeout, a stream with no event) or a 4xx is about
    the request."""
    if call.status is None:
        return "silent" if exc.status == 504 else "down"
    if call.status >= 500:
        return "down"
    return "busy" if call.status == 429 else "request"


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, UpstreamError) and exc.retryable


class _Wait:
    """Fail over at once while an untried backend is available; else honour the
    upstream's ``Retry-After``; else jittered exponential backoff."""

    def __init__(self, backends: Backends, route: Route, tried: set[str]) -> None:
        self.backends, self.route, self.tried = backends, route, tried

    def __call__(self, state: RetryCallState) -> float:
        if self.backends.untried(self.route, self.tried):
            return 0.0
        exc = state.outcome.exception() if state.outcome else None
        after = getattr(exc, "retry_after_s", None)
        return float(after) if after is not None else _BACKOFF(state)


async def _attempt(upstream: Upstream, call: Call, path: str, body: bytes,
                   headers: dict[str, str], *, stream: Stream, budget_s: float,
                   waited: Waited, last: bool = False) -> Opened:
    spec = upstream.spec
    response: Answer | None = None
    stage = "before answering"
    sent = 0.0  # when the request went (0: not out, or its wait already counted)
    per_attempt = spec.first_token_timeout_s if stream else spec.response_timeout_s
    try:
        async with asyncio.timeout(budget_s if last and stream else min(per_attempt, budget_s)):
            sent = time.monotonic()
            response = await upstream.post(path, body, headers)
            call.answered(response.status)
            if response.status >= 400:
                raise await error_from(response, upstream.name)
            if not stream:
                stage = "while sending its answer"
                answer = await response.read()
                waited.s += time.monotonic() - sent
                sent = 0.0
                return _whole(upstream, call, response, answer)
            stage = "before its first stream event"
            first = _first_bytes if stream == "bytes" else _first_event
            opened = await first(upstream, call, response)
            waited.s += time.monotonic() - sent
            sent = 0.0
            if opened is None:
                raise UpstreamError(f"backend {upstream.name!r} ended the stream before any "
                                    "event", status=502, backend=upstream.name)
            return opened
    except TRANSPORT_ERRORS as exc:
        if response is not None:
            await response.aclose()
        raise translate(exc, upstream.name, stage=stage) from None
    except BaseException:  # an UpstreamError, or cancelled: the connection goes back
        if response is not None:
            await response.aclose()
        raise
    finally:
        if sent:  # a failed attempt: all its time was the upstream's
            waited.s += time.monotonic() - sent


def _whole(upstream: Upstream, call: Call, response: Answer, body: bytes) -> Opened:
    """A whole answer, checked: a 200 that is not a JSON object, or a 1xx/204/3xx, is
    the upstream's fault (a retryable 502), never passed on to break the client."""
    if response.status == 200:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, dict):
            return Opened(upstream, call, response, body=body, doc=doc)
        problem = "an answer that is not a JSON object"
    else:
        problem = f"HTTP {response.status}, which is no answer to a POST"
    raise UpstreamError(f"backend {upstream.name!r} sent {problem}", status=502,
                        backend=upstream.name)


async def _first_event(upstream: Upstream, call: Call,
                       response: Answer) -> Opened | None:
    events = EventSource(as_httpx(response)).aiter_sse()
    first = await anext(events, None)
    return None if first is None else Opened(upstream, call, response, events=events,
                                             first=first)


async def _first_bytes(upstream: Upstream, call: Call,
                       response: Answer) -> Opened | None:
    chunks = response.chunks()
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        end = complete_prefix(buffer)
        if end and has_data(buffer[:end]):  # comments (keep-alives) are no first token
            return Opened(upstream, call, response, head=buffer[:end], tail=buffer[end:],
                          chunks=chunks)
    return None


async def open_answer(backends: Backends, route: Route, *, path: str, body_for: BodyFor,
                      headers: dict[str, str], stream: Stream, affinity: str | None = None,
                      admit: Admit | None = None, demand: Demand | None = None,
                      headers_for: HeadersFor | None = None) -> Opened | Local:
    """Try the route's backends until one answers.

    Args:
        path: appended to each upstream's ``base_url`` (``/chat/completions``...).
        body_for: the request body for an upstream (model renamed when it must be).
        headers: client headers allowed upstream.
        stream: how to read the answer (:data:`Stream`); a stream's first event must
            arrive within the first-token timeout, a whole answer within the budget.
        affinity: workflow or session id for replica affinity.
        admit: the pool slot each upstream attempt waits for (:data:`Admit`); the
            opened answer holds it until released.
        demand: the request's prompt and output length, for the route's
            ``"predicted-latency"`` replica choice (None: only ``affinity`` is known).
        headers_for: each upstream's own headers beside ``headers`` (None: none).

    Returns:
        The opened answer, or :class:`~flowlift.proxy.dispatch.backends.Local` when the
        route picked an embedded backend (the caller runs it there, through its slots).

    Raises:
        Overloaded: nothing can take the request now (429/503 with ``Retry-After``).
        UpstreamError: every attempt failed (the last one's error).
    """
    attempts = _Attempts(backends, route, path, body_for, headers, stream,
                         demand or Demand(affinity=affinity), admit, headers_for)
    try:  # the common case, without the retry machinery's overhead
        target = attempts.choose()
        return await attempts.send(target, 1) if isinstance(target, Upstream) else target
    except UpstreamError as exc:
        if not exc.retryable or route.max_attempts == 1:
            raise
        pending: UpstreamError | None = exc
    retrying = AsyncRetrying(
        stop=stop_after_attempt(route.max_attempts)
        | stop_before_delay(route.total_timeout_s - (time.monotonic() - attempts.t0)),
        wait=_Wait(backends, route, attempts.tried), retry=retry_if_exception(_retryable),
        sleep=attempts.back_off, reraise=True)
    async for attempt in retrying:
        with attempt:
            if pending is not None:  # attempt 1 already failed: tenacity waits after it
                failed, pending = pending, None
                raise failed
            target = attempts.choose()
            return (await attempts.send(target, attempt.retry_state.attempt_number)
                    if isinstance(target, Upstream) else target)
    raise AssertionError("unreachable: tenacity re-raises the last failure")


class _Attempts:
    """The state of one request's attempts: backends tried, the last failure, the clock."""

    def __init__(self, backends: Backends, route: Route, path: str, body_for: BodyFor,
                 headers: dict[str, str], stream: Stream, demand: Demand,
                 admit: Admit | None, headers_for: HeadersFor | None = None) -> None:
        self.backends, self.route, self.path = backends, route, path
        self.body_for, self.headers, self.stream = body_for, headers, stream
        self.headers_for = headers_for
        self.demand, self.admit = demand, admit
        self.tried: set[str] = set()
        self.key = next(_REQUESTS)  # the request's id in its backends' health
        self.last: UpstreamError | None = None
        self.t0 = time.monotonic()
        self.waited = Waited()

    async def back_off(self, seconds: float) -> None:
        """Tenacity's sleep between attempts (counted as waiting on upstreams)."""
        self.waited.s += seconds
        await asyncio.sleep(seconds)

    def choose(self) -> Local | Upstream:
        """The next attempt's backend: the embedded one the route chose, or the
        upstream to :meth:`send` it to (a plain call, then one coroutine per attempt).

        Raises:
            Overloaded: nothing can take it now (this request's last failure instead,
                when it had one).
        """
        try:
            name = self.backends.choose(self.route, self.demand.affinity, self.tried,
                                        self.demand)
        except Overloaded:
            if self.last is None:
                raise
            self.last.retryable = False  # this request's own failure says more than "cooling"
            raise self.last from None
        self.tried.add(name)
        local = self.backends.local(name)
        if local is not None:
            return local
        return self.backends.upstreams[name]

    async def send(self, upstream: Upstream, number: int) -> Opened:
        """Attempt ``number`` (1 first) on ``upstream`` (its pool slot first, when the
        route has a pool).

        Raises:
            UpstreamError: it failed (recorded in the upstream's health).
        """
        slot = None
        if self.admit is not None:
            waiting = time.monotonic()
            slot = await self.admit()
            queued = time.monotonic() - waiting
            self.t0 += queued  # queued in the pool: not the budget's
            self.waited.s += queued
        try:
            timing = None  # learned only where a choice is made by it
            if self.route.predicts:
                timing = Timing(self.backends.latency, self.route.model, self.demand,
                                self.backends.features(upstream.name, self.demand),
                                time.monotonic())
            headers = self.headers
            if self.headers_for is not None:
                headers = {**headers, **self.headers_for(upstream)}
            call = upstream.health.call(self.key)
            try:
                opened = await _attempt(upstream, call, self.path, self.body_for(upstream),
                                        headers, stream=self.stream,
                                        budget_s=self.route.total_timeout_s
                                        - (time.monotonic() - self.t0), waited=self.waited,
                                        last=number >= self.route.max_attempts)
            except BaseException as exc:  # cancelled too (its run or its client went away):
                call.close()  # counted out, or the backend would fill up and look busy
                if isinstance(exc, UpstreamError):
                    self.last = exc
                    evidence = _evidence(call, exc)
                    call.failed(evidence, retry_after_s=exc.retry_after_s)
                    if timing is not None and evidence in ("down", "silent"):  # its fault
                        now = time.monotonic()
                        self.backends.latency.failed(upstream.name, now - timing.started, now)
                    if evidence == "down" and call.status is None:  # no answer at all:
                        self.backends.latency.forget(upstream.name)  # a restart, cache gone
                    log.info("upstream_attempt_failed", backend=upstream.name,
                             status=exc.status, retryable=exc.retryable, attempt=number,
                             evidence=evidence)
                raise
            opened.slot, opened.waited_s = slot, self.waited.s
            if timing is not None:
                timing.first_at = time.monotonic()
                opened.timing = timing
            return opened
        except BaseException:
            if slot is not None:
                slot.release()
            raise
