"""One span per OpenAI API request (``chat {model}``, ``text_completion {model}``...).

:class:`RequestTracing` (called by the proxy's middleware) starts the span when the
request arrives -- a child of the caller's W3C ``traceparent`` -- makes it the current
span (the proxy's own span is the upstream's parent), and ends it
when the handler is done: for a stream that is when the stream was exhausted, cut short
or abandoned by the client, since the handler returns only then (cases T1, T2). What the
answer held is noted as it passes (:class:`RequestTrace`: the model, the engine's chunks
or the upstream's events), so an abandoned stream's span still carries the usage so far
(output tokens counted with the engine's tokenizer). Tracing never raises into a request:
every hook swallows and logs its own failure.

The stage split, from the instants noted, as attributes (``flowlift.queue_ms``: arrival
to an engine slot, embedded engine; ``flowlift.routing_ms``: arrival to an upstream's
first answer, retries and fallbacks included; ``flowlift.prefill_ms``: slot to first
chunk; ``flowlift.decode_ms``: first to last chunk) and a ``first_token`` event.

The proxy's own overhead, as LiteLLM's ``x-litellm-overhead-duration-ms`` header and
TensorZero's ``tensorzero_inference_latency_overhead_seconds`` metric report theirs: the
request's handling time minus the time it waited on an upstream or an engine
(:attr:`RequestTrace.waited_s`: an upstream attempt from sending its request to its
whole answer or first stream event, failed attempts, back-off, a pool's queue, and each
later read of the stream; the embedded engine's slot and chunks, as the handler waited
for them). Sent as the response header :data:`OVERHEAD_HEADER` when the response starts
(:func:`overhead_header`): a stream's headers leave before its body, so there it is the
overhead up to the first byte (SSE has no trailers); the whole request's figure,
stream included, goes to the ``flowlift_proxy_overhead_seconds`` histogram when the
handler is done (a plain answer's header holds that same figure). Time spent writing to
a slow client counts as the proxy's. The span's end and the metrics run right after
the answer is written (``call_soon``), off its path.
"""

from __future__ import annotations

import asyncio
import contextvars
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from flowlift.local_engine.base import Engine, GenerationChunk, Usage
from flowlift.proxy.tenants import tenant_of
from flowlift.proxy.wire import chunks
from flowlift.proxy.wire.sse_bytes import block_at, data_of, finished, has_data
from flowlift.tracing import genai
from flowlift.tracing.logging import get_logger
from flowlift.tracing.spans import extract

log = get_logger("flowlift.tracing")
_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "flowlift_request_trace", default=None)
TRACED_PATHS = {f"/v1{path}": op for path, op in genai.OPERATIONS.items()}
OVERHEAD_HEADER = "x-flowlift-overhead-ms"
"""Response header: the proxy's own time in milliseconds up to when the response
started (see the module doc)."""
CHARS_PER_TOKEN = 4
"""The estimate of tokens from characters where no tokenizer counted them (English
text with OpenAI-style BPE vocabularies averages about 4 characters a token)."""
_MAY_HOLD = re.compile(rb'"usage":\s*\{|"finish_reason":\s*"|"status":\s*"(?:incomplete|failed)"'
                       rb'|"type":\s*"error"')
"""What may hold what the span and the metrics need: a usage, a finish reason, a
failed or incomplete status, an error."""
_MARKS = (b'"usage"', b'"status"', b'"type"')
"""Where a match of :data:`_MAY_HOLD` but a finish reason starts (what the metrics need
of a stream whose span records nothing): found with ``bytes.find``, each checked with
the pattern there (a pattern searched through a write tries every quote in it)."""
_MARKS_RECORDING = (*_MARKS, b'"finish_reason"')
_HELD_MAX = 16
"""Stream events kept for the span before they are read on the stream's path."""


def _ns(t: float) -> int:
    """``time.monotonic()`` seconds as epoch nanoseconds."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


def _failed(what: str, exc: Exception) -> None:
    log.warning("tracing_failed", hook=what, error=f"{type(exc).__name__}: {exc}")


@contextmanager
def _safe(what: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # tracing must never break a request
        _failed(what, exc)


def _matches(events: bytes, marks: tuple[bytes, ...]) -> list[int]:
    """Where :data:`_MAY_HOLD` matches in ``events`` at one of ``marks``, in order."""
    found = []
    for mark in marks:
        at = events.find(mark)
        while at >= 0:
            if _MAY_HOLD.match(events, at):
                found.append(at)
            at = events.find(mark, at + len(mark))
    found.sort()
    return found


class RequestTrace:
    """What one OpenAI request's span learns while the request runs."""

    # what a request may never set, as class-level defaults (one store less each,
    # per request); what every request sets or fills is the instance's own
    waited_s = 0.0  # waiting on an upstream or an engine (see the module doc)
    ended_at: float | None = None  # the handler returned (or raised)
    model: str | None = None
    stream = False
    engine: Engine | None = None
    engine_model: str | None = None
    slot_at: float | None = None
    routed_at: float | None = None
    first_at: float | None = None
    last_at: float | None = None
    events = 0
    done = False
    upstream_usage: dict[str, Any] | None = None
    upstream_counts: Usage | None = None
    upstream_status: str | None = None  # a Responses API answer's status
    upstream_text = 0  # characters of a whole upstream answer's text
    _answer: dict[str, Any] | None = None  # a whole upstream answer, not read yet
    _want_model = True  # no event naming the model held yet
    _prompt: dict[str, Any] | None = None  # the request's body, for prompt_estimate
    response_model: str | None = None
    outcome = "unknown"
    status: int | None = None  # the response's HTTP status, once ended
    tenant: str | None = None  # whose request (flowlift.proxy.tenants)
    tokens: tuple[Any, Any] = (None, None)  # its context's, while current (RequestTracing)

    def __init__(self, span: trace.Span, operation: str) -> None:
        self.span, self.operation = span, operation
        self.recording = span.is_recording()  # (a span that goes nowhere takes no attributes)
        self.t0 = time.monotonic()
        self.texts: dict[int, list[str]] = {}
        self.usage: dict[int, Any] = {}
        self.finish: dict[int, str] = {}
        self._held: list[bytes] = []  # a forwarded stream's events to read, not read yet
        self.ids: dict[str, str] = {}  # the workflow and step it joined

    def inject(self, headers: dict[str, str]) -> None:
        """Write this request's span into ``headers`` as W3C ``traceparent`` (and
        ``tracestate`` when it carries one), replacing any the caller sent: the
        header OpenTelemetry's ``TraceContextTextMapPropagator`` writes for it
        (``00-{trace_id:032x}-{span_id:016x}-{flags:02x}``, W3C Trace Context
        section 3.2), formatted here without the current context's and the
        propagator's lookups. The proxy sends its own span upstream this way when
        the span records nothing (the tracer's spans go nowhere); a recording span's
        header is :func:`flowlift.tracing.spans.inject`'s."""
        ctx = self.span.get_span_context()
        headers.pop("traceparent", None)
        headers.pop("tracestate", None)
        headers["traceparent"] = (f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}"
                                  f"-{ctx.trace_flags:02x}")
        if ctx.trace_state:
            headers["tracestate"] = ctx.trace_state.to_header()

    def overhead_s(self, now: float | None = None) -> float:
        """The proxy's own time so far (up to ``now``, ``time.monotonic()`` seconds;
        None: the end if the handler is done, else now): elapsed minus
        :attr:`waited_s`, never below 0."""
        if now is None:
            now = self.ended_at if self.ended_at is not None else time.monotonic()
        return max(now - self.t0 - self.waited_s, 0.0)

    # -- hooks (called by the handlers; each one never raises) -------------------------
    def request(self, model: str, joined: tuple[str, str | None] | None, stream: bool,
                body: dict[str, Any] | None = None) -> None:
        """The request was read: its served ``model``, the workflow and step it
        ``joined``, whether it streams, and its ``body`` (its prompt's characters are
        the estimate of its prompt tokens when no usage comes back: :attr:`prompt_estimate`)."""
        try:  # (once a request: no context manager object, as _safe would make)
            self.model, self.stream, self._prompt = model, stream, body
            if joined is not None:
                self.ids[genai.WORKFLOW_ID] = joined[0]
                if joined[1] is not None:
                    self.ids[genai.STEP_ID] = joined[1]
            if self.recording:
                self.span.update_name(f"{self.operation} {model}")
                self.span.set_attributes({genai.REQUEST_MODEL: model, "flowlift.stream": stream,
                                          **self.ids})
        except Exception as exc:  # tracing must never break a request
            _failed("request", exc)

    @property
    def prompt_estimate(self) -> int | None:
        """Prompt tokens estimated from the characters of the body's ``messages``,
        ``prompt`` or ``input`` as JSON (None: no body, or no prompt in it); computed
        when asked (only a request that got no usage back needs it)."""
        body = self._prompt
        chars = sum(len(orjson.dumps(body[key])) for key in ("messages", "prompt", "input")
                    if key in body) if body is not None else 0
        return -(-chars // CHARS_PER_TOKEN) if chars else None

    def slot(self, engine: Engine, model: str, backend: str) -> None:
        with _safe("slot"):
            if self.slot_at is None:
                self.slot_at, self.engine, self.engine_model = time.monotonic(), engine, model
                self.response_model = model
                if self.recording:
                    self.span.set_attributes({genai.PROVIDER: genai.provider_name(engine),
                                              "flowlift.backend": backend})

    def chunk(self, index: int, chunk: GenerationChunk) -> None:
        try:  # (per chunk: no context manager object, as _safe would make)
            now = time.monotonic()
            if self.first_at is None and chunk.text:
                self.first_at = now
            self.last_at = now
            self.texts.setdefault(index, []).append(chunk.text)
            if chunk.usage is not None:
                self.usage[index] = chunk.usage
            if chunk.finish_reason:
                self.finish[index] = chunk.finish_reason
        except Exception as exc:  # tracing must never break a request
            _failed("chunk", exc)

    def upstream(self, backend: str, doc: dict[str, Any] | None = None,
                 waited_s: float = 0.0) -> None:
        """An upstream answered (``doc``: its whole JSON answer, when not streamed;
        ``waited_s``: seconds the attempts waited on upstreams until then)."""
        try:  # (once a request: no context manager object, as _safe would make)
            self.routed_at = time.monotonic()
            self.waited_s += waited_s
            if self.recording:
                self.span.set_attributes({genai.PROVIDER: "openai",
                                          "flowlift.backend": backend})
            if doc is not None:
                self.done = True
                self._answer = doc  # read when the request ends (_read_answer)
        except Exception as exc:  # tracing must never break a request
            _failed("upstream", exc)

    def answered(self, usage: dict[str, Any] | None, finish: str | None) -> None:
        """The proxy built the whole answer itself from one or more generations (a
        Responses turn: :mod:`flowlift.proxy.openai.responses`): ``usage`` (chat
        ``CompletionUsage``, summed over the generations) and the last ``finish``
        reason are the request's, whichever backend ran them."""
        with _safe("answered"):
            self.done = True
            if finish:
                self.finish[0] = finish
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                self.upstream_counts = Usage(int(usage.get("prompt_tokens") or 0),
                                             int(usage.get("completion_tokens") or 0),
                                             int(cached or 0))
                self.upstream_usage = dict(usage)

    def sse(self, events: bytes, done: bool | None = None, plain: bool = False) -> None:
        """Whole events of a forwarded upstream stream. Only those that may hold usage or
        a finish reason (a byte search), and the first naming the model, are kept, and
        read when the request ends (:meth:`_read_answer`), off the stream's path.

        Args:
            done: whether they hold the end marker, when the caller knows
                (:func:`~flowlift.proxy.wire.sse_bytes.finished`); None: found here.
            plain: the caller found no ``"usage"``, ``"error"``, ``event:`` or
                ``[DONE]`` in them (only a status may be left to look for).
        """
        try:  # (per write: no context manager object, as _safe would make; no call)
            if has_data(events):  # (keep-alive comments: no model event)
                self._sse(events, finished(events) if done is None else done, plain)
        except Exception as exc:  # tracing must never break a request
            _failed("sse", exc)

    def _sse(self, events: bytes, done: bool, plain: bool) -> None:
        now = time.monotonic()
        self.first_at = self.first_at or now
        self.last_at = now
        self.events += events.count(b"data:")
        self.done = self.done or done
        held = self._held
        if self._want_model and (at := events.find(b'"model"')) >= 0:
            held.append(events[slice(*block_at(events, at))])
            self._want_model = False
        marks: tuple[bytes, ...] = _MARKS
        if self.recording:
            marks = _MARKS_RECORDING
        elif plain and b'"status"' not in events:  # (what else may hold a count)
            return
        for at in _matches(events, marks):  # (a write may hold the whole stream)
            block = events[slice(*block_at(events, at))]
            if not held or held[-1] != block:
                held.append(block)
        if len(held) > _HELD_MAX:  # (an upstream that sends usage in every event)
            self._read_held()

    def _read_held(self) -> None:
        held, self._held = self._held, []
        for block in held:
            data = data_of(block)
            # (its choices only for a recording span's finish reasons: the metrics
            # read a stream's model, usage and status, its end from the end marker)
            chunk = (chunks.parse_event(data, choices=self.recording)
                     if data is not None and data.startswith("{") else None)
            if chunk is not None:
                self._note(chunk)

    def _read_answer(self) -> None:
        """Note what an upstream's answer held (its model, usage, finish reasons, a whole
        answer's text length): once, when the request ends, off the answer's path."""
        self._read_held()
        doc, self._answer = self._answer, None
        if doc is not None:  # its choices: for the span, or to estimate a missing usage
            answer = chunks.parse(doc, choices=self.recording or not doc.get("usage"))
            self._note(answer)
            self.upstream_text = sum(len(c.text) for c in answer.choices)

    def _note(self, chunk: chunks.Chunk) -> None:
        """The model, usage and finish reasons of an upstream's event or answer."""
        if chunk.model is not None:
            self.response_model = chunk.model
        if chunk.usage_json is not None:
            self.upstream_usage = dict(chunk.usage_json)
            self.upstream_counts = chunk.usage
        if chunk.status is not None:
            self.upstream_status = chunk.status
        for choice in chunk.choices:
            if choice.finish_reason:
                self.finish[choice.index] = choice.finish_reason

    # -- the end ------------------------------------------------------------------------
    def usage_numbers(self) -> tuple[int | None, int | None, int | None, bool]:
        """(prompt, completion, cached, partial) tokens of the answer so far: the
        upstream's or the engine's own counts; else (an upstream cut before it reported,
        or one that reports none) an estimate flagged ``partial``: the prompt's
        characters / :data:`CHARS_PER_TOKEN`, one token per stream event, or the whole
        answer's characters / :data:`CHARS_PER_TOKEN`. A Responses API answer the
        upstream ended ``failed`` without a usage has none (all None, not partial): the
        provider counted nothing, and an estimate would bill what it does not."""
        u = self.upstream_counts
        if u is not None:
            return u.prompt_tokens, u.completion_tokens, u.cached_tokens, False
        if self.upstream_status == "failed":  # the provider ended it failed, counting
            return None, None, None, False    # nothing: no usage is invented for it
        if self.routed_at is not None:  # an upstream answered, without a usage
            completion = (self.events if self.stream
                          else -(-self.upstream_text // CHARS_PER_TOKEN))
            return self.prompt_estimate, completion, None, True
        if not self.texts:  # nothing generated: only the prompt, if it reached an engine
            return ((self.prompt_estimate, 0, None, True) if self.slot_at is not None
                    else (None, None, None, False))
        prompt = cached = completion = 0
        partial = unknown = False
        for index, pieces in self.texts.items():
            counted = self.usage.get(index)
            if counted is not None:
                completion += counted.completion_tokens
                if index == 0:
                    prompt, cached = counted.prompt_tokens, counted.cached_tokens
                continue
            partial = True  # cut short: count what was generated with the engine's tokenizer
            counted = (self.engine.count_tokens(self.engine_model or "", "".join(pieces))
                       if self.engine is not None else None)
            unknown = unknown or counted is None
            completion += counted or 0
        head = partial and 0 not in self.usage
        return (self.prompt_estimate if head else prompt, None if unknown else completion,
                None if head else cached, partial)

    def end(self, status: int | None, abandoned: bool, error: BaseException | None) -> None:
        """Record the outcome and end the span (always, whatever fails on the way)."""
        try:
            self._read_answer()
            self._conclude(status, abandoned, error)
            if self.span.is_recording():  # (nothing to compute for a span that goes nowhere)
                self._span_attributes(error)
                self._stages()
        finally:
            self.span.end()

    def _conclude(self, status: int | None, abandoned: bool,
                  error: BaseException | None) -> None:
        complete = self.done or (bool(self.texts) and len(self.finish) >= len(self.texts))
        failed = self.upstream_status == "failed"  # a Responses API answer that failed,
        if failed or self.upstream_status == "incomplete":  # or stopped short
            complete = False
        self.outcome = ("complete" if complete and status == 200 else "abandoned"
                        if abandoned else "error" if (status or 500) >= 400 or error or failed
                        else "incomplete")
        self.status = status

    def _span_attributes(self, error: BaseException | None) -> None:
        span, status = self.span, self.status
        attrs: dict[str, Any] = {"flowlift.outcome": self.outcome}
        if status is not None:
            attrs["http.response.status_code"] = status
        if self.outcome in ("error", "incomplete"):
            attrs[genai.ERROR_TYPE] = (type(error).__name__ if error is not None
                                       else str(status) if status and status >= 400
                                       else "stream_incomplete")
            span.set_status(Status(StatusCode.ERROR))
        if self.response_model:
            attrs[genai.RESPONSE_MODEL] = self.response_model
        if self.finish:
            attrs[genai.FINISH_REASONS] = [self.finish[i] for i in sorted(self.finish)]
        if self.events:
            attrs["flowlift.stream.events"] = self.events
        if self.texts:
            attrs["flowlift.stream.chunks"] = sum(len(p) for p in self.texts.values())
        prompt, completion, cached, partial = self.usage_numbers()
        span.set_attributes({**attrs, **genai.usage_attributes(prompt, completion, cached),
                             "flowlift.usage.partial": partial})

    def _stages(self) -> None:
        """The stage split as ``flowlift.<stage>_ms`` attributes and a ``first_token``
        event at its instant (one request's stages follow each other: no child spans,
        which would double tracing's cost on the proxy's fastest path)."""
        pairs = (("queue", self.t0, self.slot_at), ("routing", self.t0, self.routed_at),
                 ("prefill", self.slot_at, self.first_at),
                 ("decode", self.first_at, self.last_at))
        attrs = {f"flowlift.{name}_ms": round((end - start) * 1000, 3)
                 for name, start, end in pairs if start is not None and end is not None}
        attrs["flowlift.overhead_ms"] = round(self.overhead_s() * 1000, 3)
        self.span.set_attributes(attrs)
        if self.first_at is not None:
            self.span.add_event("first_token", timestamp=_ns(self.first_at))


TRACE_KEY: web.RequestKey[RequestTrace] = web.RequestKey("flowlift.request_trace",
                                                        RequestTrace)
"""``request[TRACE_KEY]``: the request's :class:`RequestTrace` (traced requests only)."""


async def overhead_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` signal: a traced request's response gets
    :data:`OVERHEAD_HEADER` (its headers are about to be sent)."""
    rt = request.get(TRACE_KEY)
    if rt is not None:
        response.headers[OVERHEAD_HEADER] = f"{rt.overhead_s() * 1000:.3f}"


def current() -> RequestTrace | None:
    """The OpenAI request being traced in this context, if any."""
    return _current.get()


_IDS = RandomIdGenerator()


def _unexported_span(parent: otel_context.Context | None) -> trace.Span:
    """A span that records nothing, with an id of its own under the caller's trace (a
    new trace without one): the ``traceparent`` sent upstream is what a recorded span's
    would be (the default parent-based sampler's flags)."""
    up = None if parent is None else trace.get_current_span(parent).get_span_context()
    if up is not None and up.is_valid:
        own = SpanContext(up.trace_id, _IDS.generate_span_id(), is_remote=False,
                          trace_flags=up.trace_flags, trace_state=up.trace_state)
    else:
        own = SpanContext(_IDS.generate_trace_id(), _IDS.generate_span_id(), is_remote=False,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.NonRecordingSpan(own)


class RequestTracing:
    """The span of each OpenAI API request (see the module doc), begun and ended by two
    plain calls that the proxy's one middleware makes around everything else it does
    (:func:`flowlift.proxy.middleware.proxy_stack`: no middleware, no coroutine, of
    its own per request).

    Args:
        tracer: the proxy's tracer.
        observe: ``observe(request_trace)`` after each request (metrics), or None.
        recording: False when the tracer's spans go nowhere
            (:func:`flowlift.tracing.spans.exports`): each request then gets a
            non-recording span with an id of its own (the ``traceparent`` sent upstream
            is as ever), and the metrics and overhead figures are kept as ever.
    """

    def __init__(self, tracer: trace.Tracer, observe: Any = None, *,
                 recording: bool = True) -> None:
        self.tracer, self.observe, self.recording = tracer, observe, recording

    def begin(self, request: web.Request) -> RequestTrace | None:
        """Start ``request``'s span and make it current (None: a request not traced,
        anything but a POST on :data:`TRACED_PATHS`); :meth:`end` must follow."""
        operation = TRACED_PATHS.get(request.path)
        if operation is None or request.method != "POST":
            return None
        parent = extract(request.headers)
        span = (self.tracer.start_span(operation, context=parent, kind=SpanKind.SERVER,
                                       attributes={genai.OPERATION: operation,
                                                   "http.route": request.path})
                if self.recording else _unexported_span(parent))
        rt = RequestTrace(span, operation)
        request[TRACE_KEY] = rt
        rt.tokens = (_current.set(rt), otel_context.attach(trace.set_span_in_context(span)))
        return rt

    def end(self, request: web.Request, rt: RequestTrace, status: int | None,
            error: BaseException | None) -> None:
        """The handler is done (``status``: its response's, None when it raised
        ``error``): restore the context; the span's end and the metrics follow once
        the answer is on its way (a plain answer is written after the middleware
        returns, and this callback runs after that)."""
        rt.ended_at = time.monotonic()
        current, attached = rt.tokens
        otel_context.detach(attached)
        _current.reset(current)
        transport = request.transport
        abandoned = (transport is None or transport.is_closing()
                     or isinstance(error, asyncio.CancelledError))
        if abandoned:  # case N1: the client left; its upstream work was stopped
            log.info("request_cancelled_by_client", path=request.path,
                     model=rt.model, after_ms=round((rt.ended_at - rt.t0) * 1000))
        rt.tenant = tenant_of(request)  # (the key check ran after begin)
        asyncio.get_running_loop().call_soon(_finish, rt, status, abandoned, error,
                                             self.observe)


def _finish(rt: RequestTrace, status: int | None, abandoned: bool,
            error: BaseException | None, observe: Any) -> None:
    """End ``rt``'s span and count it in the metrics (never raises)."""
    try:  # (once per request: no context manager objects, as _safe would make)
        rt.end(status, abandoned, error)
    except Exception as exc:  # tracing must never break a request
        _failed("end", exc)
    if observe is not None:
        try:
            observe(rt)
        except Exception as exc:
            _failed("observe", exc)
