"""Forwarding one OpenAI request to upstream providers: retries, fallbacks, streaming.

The request body travels as the client sent it -- unknown fields, nulls and number
spelling included (case B1) -- unless the backend renames the model. Answers come back
unchanged too: a plain answer as the upstream's bytes, a stream event by event as each
arrives (case S5), re-framed but byte-identical in its data, multibyte characters
whole however the TCP writes split them (case S4).

Attempts, retries and fallbacks are :mod:`flowlift.proxy.dispatch.upstream.attempts`'.
Here: the idle
timeout between stream events, and once bytes are out, a failure ends the stream with
an in-band error event, never with a clean-looking finish of a truncated answer (S6).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from types import EllipsisType
from typing import Any

import orjson
from aiohttp import web

from flowlift.errors import RequestError, UpstreamError
from flowlift.proxy.dispatch.backends import Backend, Backends, Local
from flowlift.proxy.dispatch.batch.flex import tier_fields
from flowlift.proxy.dispatch.local import EmbeddedCall, serve_local
from flowlift.proxy.dispatch.routing.hints import StepHints, hint_fields, hint_headers
from flowlift.proxy.dispatch.routing.latency import CacheReport, Demand
from flowlift.proxy.dispatch.routing.routing import Route
from flowlift.proxy.dispatch.slots.scheduler import Priority, Slot
from flowlift.proxy.dispatch.upstream.attempts import Opened, open_answer
from flowlift.proxy.dispatch.upstream.http import TRANSPORT_ERRORS, translate
from flowlift.proxy.dispatch.upstream.provider import (
    Upstream,
    client_headers,
    error_message,
    forwarded_headers,
)
from flowlift.proxy.telemetry import requests as request_tracing
from flowlift.proxy.telemetry.requests import RequestTrace
from flowlift.proxy.wire import chunks
from flowlift.proxy.wire.messages import render_message
from flowlift.proxy.wire.sse_bytes import (
    complete_prefix,
    data_fields,
    finished,
    has_data,
    has_error,
    without_usage,
)
from flowlift.tracing import get_logger
from flowlift.tracing.spans import inject

log = get_logger("flowlift.proxy.dispatch.upstream.forward")
OnOutput = Callable[[str, dict[str, Any] | None], None]


USAGE_PATHS = frozenset({"/chat/completions", "/completions"})
TIERED_PATHS = frozenset({"/chat/completions", "/responses"})
"""Where a flex or priority backend's ``service_tier`` is sent."""
"""Where a stream's usage comes in a chunk of its own when asked for
(``stream_options.include_usage``)."""


def asks_usage(data: dict[str, Any]) -> bool:
    """Whether a client's streamed request asked for the usage chunk
    (``stream_options: {"include_usage": true}``; ``{}`` or absent is no)."""
    options = data.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _usage_asked(path: str, data: dict[str, Any]) -> dict[str, Any] | None:
    """The body fields that ask the upstream for a stream's usage when the client did
    not (issue 16: every request's usage is accounted), or None when nothing changes."""
    if path not in USAGE_PATHS or data.get("stream") is not True or asks_usage(data):
        return None
    options = data.get("stream_options")
    return {"stream_options": {**(options if isinstance(options, dict) else {}),
                               "include_usage": True}}


def _body_for(upstream: Upstream, raw: bytes, data: dict[str, Any], model: str,
              extra: dict[str, Any] | None = None, path: str = "",
              hints: StepHints | None = None, session_open: bool = False) -> bytes:
    target = upstream.upstream_model(model)
    # a flex or priority backend's service_tier (generation endpoints only)
    tier = tier_fields(upstream.spec, data) if path in TIERED_PATHS else {}
    if hints is not None and upstream.spec.hints:  # the opted-in hints (dispatch.hints)
        tier = {**tier, **hint_fields(upstream.spec, hints, data,
                                      session_open=session_open)}
    if tier:
        extra = {**(extra or {}), **tier}
    if target == model and extra is None:
        return raw
    return orjson.dumps({**data, **(extra or {}), "model": target})


def _working_set(backends: Backends, route: Route, path: str,
                 affinity: str | None) -> Backend | None:
    """The upstream pool whose working set admits this drop-in generation (None: not
    a session's generation, ``--working-set`` is off, or no replica of the route reads
    its KV cache from ``/metrics``)."""
    if affinity is None or path not in USAGE_PATHS:
        return None
    pool = backends.pool(route)
    if pool is None or not pool.slots.working.enabled:
        return None
    return pool if any(backends.upstreams[n].kv is not None for n in route.replicas
                       if n in backends.upstreams) else None


async def _admitted(pool: Backend, affinity: str | None,
                    on_output: OnOutput | None) -> tuple[Slot, OnOutput]:
    """The session's slot in ``pool`` (:func:`_working_set`) once its working set admits
    it (:mod:`flowlift.proxy.dispatch.slots.working_set`), and an ``on_output`` that also
    records the turn's usage as the session's KV footprint."""
    slot = pool.slots.slot(Priority.of("interactive", program=affinity))
    await slot.acquire()

    def observed(text: str, usage: dict[str, Any] | None) -> None:
        if usage is not None:
            pool.slots.observed(slot.priority, int(usage.get("prompt_tokens") or 0)
                                + int(usage.get("completion_tokens") or 0))
        if on_output is not None:
            on_output(text, usage)
    return slot, observed


async def forward(request: web.Request, *, backends: Backends, route: Route, path: str,
                  raw: bytes, data: dict[str, Any], affinity: str | None = None,
                  embedded: EmbeddedCall | None = None,
                  on_output: OnOutput | None = None,
                  traced: RequestTrace | None = None) -> web.StreamResponse:
    """Answer ``request`` from the route's backends (see :func:`open_answer`).

    A session's generation (``affinity``) on a route whose replicas report their KV
    cache (``kv_metrics``) waits, with ``flowlift serve --working-set``, until the
    route's working set admits it (:mod:`flowlift.proxy.dispatch.slots.working_set`:
    the same policy as on the embedded engine), and its usage is the session's KV
    footprint.

    Args:
        path: the upstream path (``/chat/completions``, ``/completions``, ``/embeddings``,
            ``/responses``), appended to each backend's ``base_url``.
        raw, data: the client's body as bytes and parsed.
        affinity: workflow or session id for replica affinity.
        embedded: answers on the embedded backend the route chose (it takes the
            backend's slots); None when the endpoint has no embedded implementation.
        on_output: called once with the first choice's text and the usage when a whole
            answer went through (inferred workflows use it).
        traced: the request's trace, handed down from its route (None: untraced): its
            span is the upstream's parent, and it notes the answer as it passes.

    Raises:
        Overloaded: no backend can take the request now (429/503 with ``Retry-After``).
        RequestError: the route chose the embedded engine for an endpoint it lacks.
    """
    pool = _working_set(backends, route, path, affinity)
    slot = None
    if pool is not None:  # (awaited before the answer: no frame while the request waits)
        slot, on_output = await _admitted(pool, affinity, on_output)
    try:
        deadline = asyncio.get_running_loop().time() + route.total_timeout_s
        headers = forwarded_headers(request.headers)
        if traced is not None and not traced.recording:  # (no OpenTelemetry calls for it)
            traced.inject(headers)  # the proxy's own span (a child of the caller's)
        else:
            inject(headers)  # is the upstream's parent
        extra = _usage_asked(path, data)
        sessions = backends.sessions
        hints = None
        if affinity is not None and path in USAGE_PATHS:  # generations: SGLang sessions
            await sessions.open((backends.upstreams[n] for n in route.backends
                                 if n in backends.upstreams), affinity)
            hints = _session_hints(backends, route, affinity)
        try:
            opened = await open_answer(
                backends, route, path=path, headers=headers,
                body_for=lambda up: _body_for(
                    up, raw, data, route.model, extra if up.spec.stream_usage else None, path,
                    hints, sessions.is_open(up.name, affinity)),
                stream="bytes" if data.get("stream") is True else False, affinity=affinity,
                # (what only a choice that predicts reads: open_answer knows the affinity)
                demand=demand_of(raw, data, affinity) if route.predicts else None,
                headers_for=(None if hints is None and not _passes_headers(backends, route)
                             else lambda up: _upstream_headers(up, request.headers, hints)))
        except UpstreamError as exc:
            return upstream_error_response(exc)
        if isinstance(opened, Local):
            if embedded is None:
                raise RequestError(f"{path} is not served by the embedded engine; configure an "
                                   f"upstream backend for model {route.model!r}", param="model")
            return await serve_local(opened, embedded)
        if traced is not None:
            traced.upstream(opened.upstream.name, opened.doc, opened.waited_s)
        try:
            if opened.body is not None:
                return _plain(opened, on_output)
            return await _stream(request, opened, on_output, deadline,
                                 strip_usage=extra is not None
                                 and opened.upstream.spec.stream_usage, traced=traced)
        finally:
            await opened.release()
    finally:
        if slot is not None:
            slot.release()


def _session_hints(backends: Backends, route: Route, session: str) -> StepHints | None:
    """A drop-in generation's hints: its session (the program) and its ordinal there,
    when a backend of the route opts in to any hint (None: none does)."""
    if not any(backends.upstreams[n].spec.hints for n in route.backends
               if n in backends.upstreams):
        return None
    return StepHints(None, session, step=backends.steps.next(session))


def _passes_headers(backends: Backends, route: Route) -> bool:
    """Whether an upstream of ``route`` lets client headers through (``pass_headers``)."""
    return any(backends.upstreams[n].spec.pass_headers for n in route.backends
               if n in backends.upstreams)


def _upstream_headers(up: Upstream, client: Mapping[str, str],
                      hints: StepHints | None) -> dict[str, str]:
    """What ``up`` gets besides the trace context: the client headers its
    ``pass_headers`` allow, and its opted-in hints' headers (those win)."""
    out = client_headers(up.spec, client)
    if hints is not None:
        out.update(hint_headers(up.spec, hints))
    return out


def upstream_error_response(exc: UpstreamError) -> web.Response:
    """The client's answer when every attempt failed.

    An upstream's own 4xx with an OpenAI-shaped body goes to the client as it is (the
    request was at fault); a 4xx whose JSON body says what was wrong in another shape
    (vLLM's and SGLang's ``{"object": "error", "message": ...}``, FastAPI's
    ``{"detail": ...}``) keeps its status, its message carried into the OpenAI error
    shape (case N9). Anything else is the backend's fault, never the client's and never
    flowlift's own 500: 5xx becomes 502 (503 stays 503), other non-OpenAI answers 502,
    and a 429/503 always carries ``Retry-After``.
    """
    headers = {"X-Flowlift-Backend": exc.backend} if exc.backend else {}
    status = exc.status if exc.status < 500 or exc.status in (503, 504) else 502
    retry_after = exc.retry_after_s
    if status in (429, 503) and retry_after is None:
        retry_after = 1.0
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    if exc.body:
        try:
            doc = orjson.loads(exc.body)
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return web.Response(body=exc.body, status=status,
                                content_type="application/json", headers=headers)
        message = error_message(exc.body)
        if status < 500 and message is not None and isinstance(doc, dict):
            return web.json_response({"error": {
                "message": message, "type": _CLIENT_ERROR_TYPES.get(status,
                                                                    "invalid_request_error"),
                "param": doc.get("param") if isinstance(doc.get("param"), str) else None,
                "code": doc.get("code") if isinstance(doc.get("code"), str) else None}},
                status=status, headers=headers)
        if status < 500:
            status = 502  # an HTML 404 from a misconfigured base_url is not the client's
    body = exc.to_openai()
    body["error"]["message"] = (f"{exc.message} (upstream status {exc.status})"
                                if status != exc.status else exc.message)
    return web.json_response(body, status=status, headers=headers)


_CLIENT_ERROR_TYPES = {401: "authentication_error", 403: "permission_error",
                       404: "not_found_error", 409: "conflict_error",
                       422: "unprocessable_entity_error", 429: "rate_limit_error"}


def demand_of(raw: bytes, data: dict[str, Any], affinity: str | None) -> Demand:
    """What the replica choice knows of a drop-in request: its prompt length estimated
    from its body (4 bytes a token: no tokenizer of the upstream's model here; the same
    estimate on every replica, so only the scale of a learned weight depends on it), its
    ``max_tokens`` (or ``max_completion_tokens``), its affinity key."""
    cap = data.get("max_completion_tokens", data.get("max_tokens"))
    return Demand(len(raw) // 4, cap if isinstance(cap, int) and cap > 0 else None, affinity)


def _plain(opened: Opened, on_output: OnOutput | None) -> web.Response:
    usage = (opened.doc or {}).get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if opened.timing is not None:  # (a replica choice that predicts: its cache belief)
        opened.cache = CacheReport.of(usage)
    opened.succeeded(tokens if isinstance(tokens, int) else None)
    body = opened.body or b""
    if on_output is not None and opened.doc is not None:
        _observe_plain(opened.doc, on_output)
    return web.Response(body=body, status=opened.answer.status,
                        content_type="application/json",
                        headers={"X-Flowlift-Backend": opened.upstream.name})


def _observe_plain(doc: dict[str, Any], on_output: OnOutput) -> None:
    answer = chunks.parse(doc)
    choice = answer.choice(0)
    try:
        text = ("" if choice is None else render_message(choice.message)[1]
                if choice.message is not None else choice.text)
        on_output(text, None if answer.usage_json is None else dict(answer.usage_json))
    except (AttributeError, IndexError, TypeError):  # e.g. tool_calls that are no list
        log.info("unreadable_upstream_answer", keys=sorted(doc)[:8])


class _Collect:
    """The streamed text and usage, for ``on_output``."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None

    def add(self, events: bytes) -> None:
        for data in data_fields(events):
            chunk = chunks.parse_event(data)
            if chunk is None:
                continue  # [DONE]
            if chunk.usage_json is not None:
                self.usage = dict(chunk.usage_json)
            self.parts.extend(c.text for c in chunk.choices if c.index == 0)


class _Passing:
    """What a forwarded stream has shown so far, and each whole piece passed on: noted
    for the span, written to the client (less the usage it did not ask for), collected
    for ``on_output``."""

    def __init__(self, resp: web.StreamResponse, on_output: OnOutput | None,
                 strip_usage: bool, traced: RequestTrace | EllipsisType | None = ...,
                 *, read_cache: bool = False) -> None:
        self.resp, self.strip_usage = resp, strip_usage
        self.collect = _Collect() if on_output is not None else None
        self.read_cache = read_cache  # the replica choice learns the reported cache
        self.cache: CacheReport | None = None
        # the trace forward was handed (``...``, used on its own: the context's)
        self.traced = request_tracing.current() if traced is ... else traced
        self.done = False  # the end marker came
        self.events = 0  # events passed on (about one output token each)
        self.errored = False  # the upstream sent its own error event

    def note(self, events: bytes) -> bytes:
        """Note whole ``events`` (for the span, the end, an error, ``on_output``); what
        to write to the client of them. (A plain call: the stream's loop writes, no
        coroutine of this method's own per write.)"""
        # what a write may hold, each looked for once (most writes hold none of them:
        # an output token's event); each check below runs only where its string is
        usage, error = b'"usage"' in events, b'"error"' in events
        named, end = b"event:" in events, b"[DONE]" in events
        done = (end or named) and finished(events)
        if self.traced is not None:
            self.traced.sse(events, done=done, plain=not (usage or error or named or end))
        self.events += events.count(b"\n\n")
        self.done = self.done or done
        self.errored = self.errored or ((error or named) and has_error(events))
        if self.collect is not None:
            self.collect.add(events)
        if usage and self.read_cache:
            self.cache = _reported_cache(events) or self.cache
        return without_usage(events) if usage and self.strip_usage else events


def _reported_cache(events: bytes) -> CacheReport | None:
    """The prefix-cache report in the usage of whole ``events``, if one holds it."""
    for data in data_fields(events):
        chunk = chunks.parse_event(data) if '"usage"' in data else None
        if chunk is not None and chunk.usage_json is not None:
            return CacheReport.of(dict(chunk.usage_json))
    return None


async def _stream(request: web.Request, opened: Opened, on_output: OnOutput | None,
                  deadline: float, *, strip_usage: bool = False,
                  traced: RequestTrace | None = None) -> web.StreamResponse:
    """Forward the stream as it arrives, whole events per write (:mod:`.sse_bytes`).

    The idle timeout restarts only when a whole model event arrives (bytes dribbling
    in without ever finishing one, or ``: keep-alive`` comments, do not keep a stream
    alive: cases S6, N4, N6), and the request's total budget (``deadline``, event-loop
    time) ends any stream that outlives it. With ``strip_usage`` (the proxy asked for
    the usage, the client did not) the usage is read for the records and left out of
    what the client gets. One failure, one error event: the upstream's own when it sent
    one, else flowlift's (:func:`_cut_short`).
    """
    upstream = opened.upstream
    assert opened.chunks is not None
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache",
                                       "X-Flowlift-Backend": upstream.name})
    passing = _Passing(resp, on_output, strip_usage, traced,
                       read_cache=opened.timing is not None)
    traced, clock = passing.traced, time.monotonic
    buffer = opened.tail
    failure: str | None = None
    try:
        await resp.prepare(request)
        await resp.write(passing.note(opened.head))
        try:
            async with asyncio.timeout(None) as expiry:
                with IdleTimer(expiry, upstream.spec.idle_timeout_s, deadline) as idle:
                    reads = opened.chunks
                    while True:
                        asked = clock()
                        try:
                            chunk = await anext(reads)
                        except StopAsyncIteration:
                            break
                        finally:  # each read waits on the upstream (the proxy's own time not)
                            if traced is not None:
                                traced.waited_s += clock() - asked
                        buffer += chunk
                        end = complete_prefix(buffer)
                        if not end:
                            continue
                        events, buffer = buffer[:end], buffer[end:]
                        if has_data(events):  # a keep-alive comment does not keep it alive
                            idle.restart()
                        await resp.write(passing.note(events))
        except TRANSPORT_ERRORS as exc:
            failure = str(translate(exc, upstream.name, stage="mid-stream"))
        await _end(opened, passing, failure, on_output)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client_went_away", backend=upstream.name)
    return resp


class IdleTimer:
    """An idle timeout restarted by every event, at the cost of a float store: it
    expires ``expiry`` (an entered ``asyncio.timeout(None)``: the stream's task gets its
    ``TimeoutError``) ``idle_s`` after the last :meth:`restart`, or at ``deadline``
    (event-loop time) if sooner. Its one timer handle re-arms itself when it fires
    early, where ``asyncio.Timeout.reschedule`` would cancel and create a handle per
    event (~4 us each, measured). A context manager: leaving it cancels the handle.
    """

    def __init__(self, expiry: asyncio.Timeout, idle_s: float, deadline: float) -> None:
        self.expiry, self.idle_s, self.deadline = expiry, idle_s, deadline
        self.loop = asyncio.get_running_loop()
        self.until = self.armed = min(self.loop.time() + idle_s, deadline)
        self.handle = self.loop.call_at(self.armed, self._due)

    def restart(self) -> None:
        self.until = min(self.loop.time() + self.idle_s, self.deadline)

    def __enter__(self) -> IdleTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.cancel()

    def _due(self) -> None:
        if self.until > self.armed:  # restarted since: wait for the new end
            self.armed = self.until
            self.handle = self.loop.call_at(self.armed, self._due)
        else:
            self.expiry.reschedule(self.loop.time())  # now


async def _end(opened: Opened, passing: _Passing, failure: str | None,
               on_output: OnOutput | None) -> None:
    if passing.errored:  # the upstream's own error event was the one
        opened.call.failed("request")
        log.warning("stream_ended_by_upstream_error", backend=opened.upstream.name)
    elif not passing.done:
        await _cut_short(passing.resp, opened, failure)
    else:  # the events less the end marker and the finish: about the output tokens
        opened.cache = passing.cache
        opened.succeeded(max(passing.events - 2, 1))
        if passing.collect is not None and on_output is not None:
            on_output("".join(passing.collect.parts), passing.collect.usage)


async def _cut_short(resp: web.StreamResponse, opened: Opened, failure: str | None) -> None:
    """End a stream that stopped before its end marker with an in-band error event."""
    upstream = opened.upstream
    failure = failure or (f"backend {upstream.name!r} closed the stream before it finished "
                          "(no finish_reason, no [DONE])")
    err = UpstreamError(failure + "; the answer above is incomplete", status=502,
                        backend=upstream.name)
    await resp.write(b"data: " + orjson.dumps(err.to_openai()) + b"\n\n")
    opened.call.failed("request")  # a stall or cut of this stream: not the backend's
    log.warning("stream_cut_short", backend=upstream.name, reason=failure)
