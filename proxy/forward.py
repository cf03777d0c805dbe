"""Forwarding one OpenAI request to upstream providers: retries, fallbacks, streaming.

The request body travels as the client sent it -- unknown fields, nulls and number
spelling included (case B1) -- unless the backend renames the model. Answers come back
unchanged too: a plain answer as the upstream's bytes, a stream event by event as each
arrives (case S5), re-framed but byte-identical in its data, multibyte characters
whole however the TCP writes split them (case S4).

Per attempt: connect timeout, a first-token timeout (headers and the first stream
event) and an idle timeout between events (case R3); per request: a total budget.
Failures before anything reached the client are retried: at once on another backend
when one is untried, else after the upstream's ``Retry-After`` (case R1) or jittered
exponential backoff ("full jitter", Brooker 2015) -- tenacity does the waiting and the
stop rules. Once bytes are out, a failure ends the stream with an in-band error event,
never with a clean-looking finish of a truncated answer (case S6).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from aiohttp import web
from httpx_sse import EventSource, ServerSentEvent
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_random_exponential,
)

from flowlift.errors import UpstreamError
from flowlift.proxy.providers import Providers
from flowlift.proxy.routing import Route
from flowlift.proxy.upstream import Upstream, error_from, forwarded_headers, translate
from flowlift.tracing import get_logger

log = get_logger("flowlift.proxy.forward")
OnOutput = Callable[[str, dict[str, Any] | None], None]
EmbeddedCall = Callable[[str, Any], Awaitable[web.StreamResponse]]
_FINISHED = re.compile(r'"finish_reason"\s*:\s*"')
_TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed",
                              "error"})
_BACKOFF = wait_random_exponential(multiplier=0.25, max=8.0)


@dataclass(slots=True)
class _Opened:
    """A successful attempt, not yet delivered to the client."""

    upstream: Upstream
    response: httpx.Response
    body: bytes | None = None  # plain answers
    events: AsyncIterator[ServerSentEvent] | None = None  # streams
    first: ServerSentEvent | None = None


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


def _body_for(upstream: Upstream, raw: bytes, data: dict[str, Any], model: str) -> bytes:
    target = upstream.upstream_model(model)
    if target == model:
        return raw
    return orjson.dumps({**data, "model": target})


async def _attempt(upstream: Upstream, path: str, body: bytes, headers: dict[str, str], *,
                   stream: bool, budget_s: float) -> _Opened:
    spec = upstream.spec
    request = upstream.client.build_request("POST", path, content=body, headers=headers)
    response: httpx.Response | None = None
    stage = "before answering"
    try:
        async with asyncio.timeout(min(spec.first_token_timeout_s, budget_s) if stream
                                   else budget_s):
            response = await upstream.client.send(request, stream=True)
            if response.status_code >= 400:
                raise await error_from(response, upstream.name)
            if not stream:
                stage = "while sending its answer"
                return _Opened(upstream, response, body=await response.aread())
            stage = "before its first stream event"
            events = EventSource(response).aiter_sse()
            first = await anext(events, None)
            if first is None:
                raise UpstreamError(f"backend {upstream.name!r} ended the stream before any "
                                    "event", status=502, backend=upstream.name)
            return _Opened(upstream, response, events=events, first=first)
    except UpstreamError:
        if response is not None:
            await response.aclose()
        raise
    except (TimeoutError, httpx.HTTPError) as exc:
        if response is not None:
            await response.aclose()
        raise translate(exc, upstream.name, stage=stage) from None


async def forward(request: web.Request, *, providers: Providers, route: Route, path: str,
                  raw: bytes, data: dict[str, Any], affinity: str | None = None,
                  embedded: EmbeddedCall | None = None,
                  on_output: OnOutput | None = None) -> web.StreamResponse:
    """Answer ``request`` from the route's backends.

    Args:
        path: the upstream path (``/chat/completions``, ``/completions``, ``/embeddings``,
            ``/responses``), appended to each backend's ``base_url``.
        raw, data: the client's body as bytes and parsed.
        affinity: workflow or session id for replica affinity.
        embedded: answers on an embedded backend (``(served_model, backend)``); None
            when the endpoint has no embedded implementation.
        on_output: called once with the first choice's text and the usage when a whole
            answer went through (inferred workflows use it).

    Raises:
        Overloaded: no backend can take the request now (429/503 with ``Retry-After``).
        UpstreamError: every attempt failed; the last upstream's error is passed on.
    """
    stream = data.get("stream") is True
    headers = forwarded_headers(request.headers)
    tried: set[str] = set()
    t0 = time.monotonic()
    retrying = AsyncRetrying(
        stop=stop_after_attempt(route.max_attempts) | stop_before_delay(route.total_timeout_s),
        wait=_Wait(providers, route, tried), retry=retry_if_exception(_retryable),
        reraise=True)
    opened: _Opened | None = None
    try:
        async for attempt in retrying:
            with attempt:
                name = providers.choose(route, affinity, tried)
                tried.add(name)
                local = providers.embedded_backend(name)
                if local is not None:
                    if embedded is None:
                        raise UpstreamError(f"{path} is not served by the embedded engine; "
                                            "configure an upstream backend for model "
                                            f"{route.model!r}", status=400, retryable=False)
                    return await embedded(*local)
                upstream = providers.upstreams[name]
                upstream.health.in_flight += 1
                try:
                    opened = await _attempt(
                        upstream, path, _body_for(upstream, raw, data, route.model), headers,
                        stream=stream, budget_s=route.total_timeout_s - (time.monotonic() - t0))
                except UpstreamError as exc:
                    upstream.health.in_flight -= 1
                    if exc.retryable:
                        upstream.health.failure(time.monotonic(), status=exc.status,
                                                retry_after=exc.retry_after_s)
                    log.info("upstream_attempt_failed", backend=name, status=exc.status,
                             retryable=exc.retryable, attempt=attempt.retry_state.attempt_number)
                    raise
    except UpstreamError as exc:
        return upstream_error_response(exc)
    assert opened is not None
    try:
        if opened.body is not None:
            return _plain(opened, on_output)
        return await _stream(request, opened, on_output)
    finally:
        opened.upstream.health.in_flight -= 1


def upstream_error_response(exc: UpstreamError) -> web.Response:
    """The client's answer when every attempt failed: the last upstream's own error body
    and status when it sent an OpenAI-shaped one, else flowlift's (with ``Retry-After``
    when the upstream named a wait)."""
    headers = {"X-Flowlift-Backend": exc.backend} if exc.backend else {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if exc.body:
        try:
            doc = orjson.loads(exc.body)
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return web.Response(body=exc.body, status=exc.status,
                                content_type="application/json", headers=headers)
    return web.json_response(exc.to_openai(), status=exc.status, headers=headers)


def _plain(opened: _Opened, on_output: OnOutput | None) -> web.Response:
    opened.upstream.health.success()
    body = opened.body or b""
    if on_output is not None:
        _observe_plain(body, on_output)
    return web.Response(body=body, status=opened.response.status_code,
                        content_type="application/json",
                        headers={"X-Flowlift-Backend": opened.upstream.name})


def _observe_plain(body: bytes, on_output: OnOutput) -> None:
    try:
        doc = orjson.loads(body)
        choice = (doc.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
        on_output(text, doc.get("usage"))
    except (orjson.JSONDecodeError, AttributeError, IndexError, TypeError):
        log.info("unreadable_upstream_answer", size=len(body))


def _encode(event: ServerSentEvent) -> bytes:
    data = event.data
    if event.event in ("", "message") and "\n" not in data:
        return b"data: " + data.encode() + b"\n\n"
    lines = [] if event.event in ("", "message") else [f"event: {event.event}"]
    lines += [f"data: {line}" for line in data.split("\n")]
    return ("\n".join(lines) + "\n\n").encode()


def _finished(event: ServerSentEvent) -> bool:
    return (event.data == "[DONE]" or event.event in _TERMINAL_EVENTS
            or _FINISHED.search(event.data) is not None)


class _Collect:
    """The streamed text and usage, for ``on_output``."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None

    def add(self, data: str) -> None:
        if data == "[DONE]":
            return
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if doc.get("usage"):
            self.usage = doc["usage"]
        for choice in doc.get("choices") or ():
            if choice.get("index", 0) == 0:
                delta = choice.get("delta") or {}
                self.parts.append(delta.get("content") or choice.get("text") or "")


async def _stream(request: web.Request, opened: _Opened,
                  on_output: OnOutput | None) -> web.StreamResponse:
    upstream, first = opened.upstream, opened.first
    assert first is not None and opened.events is not None
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache",
                                       "X-Flowlift-Backend": upstream.name})
    collect = _Collect() if on_output is not None else None
    finished = _finished(first)
    failure: str | None = None
    loop = asyncio.get_running_loop()
    try:
        await resp.prepare(request)
        await resp.write(_encode(first))
        if collect is not None:
            collect.add(first.data)
        try:
            async with asyncio.timeout(None) as idle:
                idle.reschedule(loop.time() + upstream.spec.idle_timeout_s)
                async for event in opened.events:
                    await resp.write(_encode(event))
                    idle.reschedule(loop.time() + upstream.spec.idle_timeout_s)
                    finished = finished or _finished(event)
                    if collect is not None:
                        collect.add(event.data)
        except (TimeoutError, httpx.HTTPError) as exc:
            failure = str(translate(exc, upstream.name, stage="mid-stream"))
        if not finished:
            failure = failure or (f"backend {upstream.name!r} closed the stream before it "
                                  "finished (no finish_reason, no [DONE])")
            err = UpstreamError(failure + "; the answer above is incomplete", status=502,
                                backend=upstream.name)
            await resp.write(b"data: " + orjson.dumps(err.to_openai()) + b"\n\n")
            upstream.health.failure(time.monotonic())
            log.warning("stream_cut_short", backend=upstream.name, reason=failure)
        else:
            upstream.health.success()
            if collect is not None and on_output is not None:
                on_output("".join(collect.parts), collect.usage)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client_went_away", backend=upstream.name)
    finally:
        await opened.events.aclose()  # type: ignore[attr-defined]
        await opened.response.aclose()
    return resp
