"""Attempts of one request across a route's backends, until one answers.

Per attempt: connect timeout, a first-token timeout (headers and the first stream
event) and, for plain answers, the request's remaining budget (case R3). Failures
before anything reached the client are retried: at once on another backend when one is
untried, else after the upstream's ``Retry-After`` (case R1) or jittered exponential
backoff ("full jitter", Brooker 2015) -- tenacity does the waiting and the stop rules
(attempts, and no wait that would end past the request's total budget).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx
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
from flowlift.proxy.dispatch.backends import Backend
from flowlift.proxy.dispatch.providers import Providers
from flowlift.proxy.dispatch.routing import Route
from flowlift.proxy.dispatch.sse_bytes import complete_prefix
from flowlift.proxy.dispatch.upstream import Upstream, error_from, translate
from flowlift.tracing import get_logger

log = get_logger("flowlift.proxy.dispatch.attempts")
_BACKOFF = wait_random_exponential(multiplier=0.25, max=8.0)
BodyFor = Callable[[Upstream], bytes]
Stream = Literal[False, "bytes", "events"]
"""How an answer is read: whole (False), as raw bytes cut at event boundaries
(forwarding), or as parsed server-sent events (upstream-backed workflow steps)."""


@dataclass(slots=True)
class Opened:
    """A successful attempt, not yet delivered. The caller must :meth:`release` it."""

    upstream: Upstream
    response: httpx.Response
    body: bytes | None = None  # plain answers,
    doc: dict[str, Any] | None = None  # and the JSON object they hold (parsed once)
    events: AsyncIterator[ServerSentEvent] | None = None  # streams read as events
    first: ServerSentEvent | None = None
    head: bytes = b""  # streams forwarded as bytes: the whole events received so far,
    tail: bytes = b""  # the start of the next one,
    chunks: AsyncIterator[bytes] | None = None  # and the rest as it arrives

    async def release(self) -> None:
        """Close the upstream response and count the request out of the backend."""
        try:
            for it in (self.events, self.chunks):
                if it is not None:
                    await it.aclose()  # type: ignore[attr-defined]
            await self.response.aclose()
        finally:
            self.upstream.health.in_flight -= 1


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, UpstreamError) and exc.retryable


class _Wait:
    """Fail over at once while an untried backend is available; else honour the
    upstream's ``Retry-After``; else jittered exponential backoff."""

    def __init__(self, providers: Providers, route: Route, tried: set[str]) -> None:
        self.providers, self.route, self.tried = providers, route, tried

    def __call__(self, state: RetryCallState) -> float:
        if self.providers.untried(self.route, self.tried):
            return 0.0
        exc = state.outcome.exception() if state.outcome else None
        after = getattr(exc, "retry_after_s", None)
        return float(after) if after is not None else _BACKOFF(state)


async def _attempt(upstream: Upstream, path: str, body: bytes, headers: dict[str, str], *,
                   stream: Stream, budget_s: float) -> Opened:
    spec = upstream.spec
    response: httpx.Response | None = None
    stage = "before answering"
    try:
        async with asyncio.timeout(min(spec.first_token_timeout_s if stream
                                       else spec.response_timeout_s, budget_s)):
            response = await upstream.send(upstream.request(path, body, headers))
            if response.status_code >= 400:
                raise await error_from(response, upstream.name)
            if not stream:
                stage = "while sending its answer"
                return _whole(upstream, response, await response.aread())
            stage = "before its first stream event"
            opened = await (_first_bytes if stream == "bytes" else _first_event)(upstream,
                                                                                 response)
            if opened is None:
                raise UpstreamError(f"backend {upstream.name!r} ended the stream before any "
                                    "event", status=502, backend=upstream.name)
            return opened
    except (TimeoutError, httpx.HTTPError) as exc:
        if response is not None:
            await response.aclose()
        raise translate(exc, upstream.name, stage=stage) from None
    except BaseException:  # an UpstreamError, or cancelled: the connection goes back
        if response is not None:
            await response.aclose()
        raise


def _whole(upstream: Upstream, response: httpx.Response, body: bytes) -> Opened:
    """A whole answer, checked: a 200 that is not a JSON object, or a 1xx/204/3xx, is
    the upstream's fault (a retryable 502), never passed on to break the client."""
    if response.status_code == 200:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, dict):
            return Opened(upstream, response, body=body, doc=doc)
        problem = "an answer that is not a JSON object"
    else:
        problem = f"HTTP {response.status_code}, which is no answer to a POST"
    raise UpstreamError(f"backend {upstream.name!r} sent {problem}", status=502,
                        backend=upstream.name)


async def _first_event(upstream: Upstream, response: httpx.Response) -> Opened | None:
    events = EventSource(response).aiter_sse()
    first = await anext(events, None)
    return None if first is None else Opened(upstream, response, events=events, first=first)


async def _first_bytes(upstream: Upstream, response: httpx.Response) -> Opened | None:
    chunks = response.aiter_raw()
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        end = complete_prefix(buffer)
        if end:
            return Opened(upstream, response, head=buffer[:end], tail=buffer[end:],
                          chunks=chunks)
    return None


async def open_answer(providers: Providers, route: Route, *, path: str, body_for: BodyFor,
                      headers: dict[str, str], stream: Stream,
                      affinity: str | None = None) -> Opened | tuple[str, Backend]:
    """Try the route's backends until one answers.

    Args:
        path: appended to each upstream's ``base_url`` (``/chat/completions``...).
        body_for: the request body for an upstream (model renamed when it must be).
        headers: client headers allowed upstream.
        stream: how to read the answer (:data:`Stream`); a stream's first event must
            arrive within the first-token timeout, a whole answer within the budget.
        affinity: workflow or session id for replica affinity.

    Returns:
        The opened answer, or ``(served_model, backend)`` when the route picked an
        embedded backend (the caller runs it there).

    Raises:
        Overloaded: nothing can take the request now (429/503 with ``Retry-After``).
        UpstreamError: every attempt failed (the last one's error).
    """
    attempts = _Attempts(providers, route, path, body_for, headers, stream, affinity)
    try:  # the common case, without the retry machinery's overhead
        return await attempts.once(1)
    except UpstreamError as exc:
        if not exc.retryable or route.max_attempts == 1:
            raise
        pending: UpstreamError | None = exc
    retrying = AsyncRetrying(
        stop=stop_after_attempt(route.max_attempts)
        | stop_before_delay(route.total_timeout_s - (time.monotonic() - attempts.t0)),
        wait=_Wait(providers, route, attempts.tried), retry=retry_if_exception(_retryable),
        reraise=True)
    async for attempt in retrying:
        with attempt:
            if pending is not None:  # attempt 1 already failed: tenacity waits after it
                failed, pending = pending, None
                raise failed
            return await attempts.once(attempt.retry_state.attempt_number)
    raise AssertionError("unreachable: tenacity re-raises the last failure")


class _Attempts:
    """The state of one request's attempts: backends tried, the last failure, the clock."""

    def __init__(self, providers: Providers, route: Route, path: str, body_for: BodyFor,
                 headers: dict[str, str], stream: Stream, affinity: str | None) -> None:
        self.providers, self.route, self.path = providers, route, path
        self.body_for, self.headers, self.stream = body_for, headers, stream
        self.affinity = affinity
        self.tried: set[str] = set()
        self.last: UpstreamError | None = None
        self.t0 = time.monotonic()

    async def once(self, number: int) -> Opened | tuple[str, Backend]:
        try:
            name = self.providers.choose(self.route, self.affinity, self.tried)
        except Overloaded:
            if self.last is None:
                raise
            self.last.retryable = False  # this request's own failure says more than "cooling"
            raise self.last from None
        self.tried.add(name)
        local = self.providers.embedded_backend(name)
        if local is not None:
            return local
        upstream = self.providers.upstreams[name]
        upstream.health.in_flight += 1
        try:
            return await _attempt(upstream, self.path, self.body_for(upstream), self.headers,
                                  stream=self.stream, budget_s=self.route.total_timeout_s
                                  - (time.monotonic() - self.t0))
        except UpstreamError as exc:
            self.last = exc
            upstream.health.in_flight -= 1
            if exc.retryable:
                upstream.health.failure(time.monotonic(), status=exc.status,
                                        retry_after=exc.retry_after_s)
            log.info("upstream_attempt_failed", backend=name, status=exc.status,
                     retryable=exc.retryable, attempt=number)
            raise
        except BaseException:  # cancelled (its run or its client went away): counted out,
            upstream.health.in_flight -= 1  # or the backend would fill up and look busy
            raise
