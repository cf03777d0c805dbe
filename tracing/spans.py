"""OpenTelemetry set-up: tracer providers, export, W3C trace context, captured spans.

Export never sits on a request's path: spans go through a ``BatchSpanProcessor``
(a background thread), to OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set -- ``OTEL_EXPORTER_OTLP_PROTOCOL``
``http/protobuf`` (the default, as in the OTLP exporter spec) or ``grpc`` -- else to
JSON lines (``spans.jsonl`` in the trace directory), else nowhere. An exporter that fails
reports ``FAILURE`` to the processor, which logs it; nothing raises into a request.

:func:`capture_spans` (re-exported by :mod:`flowlift.testing`) is the test helper, like
``structlog.testing.capture_logs``: while it is active, flowlift's proxies created in it
and the SDK record into an in-memory exporter.

Trace context is W3C Trace Context (``traceparent`` / ``tracestate``), read with
:func:`extract` and written with :func:`inject`.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import orjson
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "CapturedSpans",
    "JsonLinesSpanExporter",
    "capture_spans",
    "capturing",
    "configure_tracing",
    "exports",
    "extract",
    "inject",
    "proxy_tracer_provider",
    "sdk_tracer_provider",
    "span_record",
]

_W3C = TraceContextTextMapPropagator()
_captures: list[TracerProvider] = []  # capture_spans() stack: test hook, like structlog's config
_silent: weakref.WeakSet[TracerProvider] = weakref.WeakSet()  # made with nowhere to export


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as a JSON-ready dict: ids in hex (as W3C ``traceparent`` writes them),
    times in ns since the epoch, the kind and status code by name."""
    ctx, parent = span.context, span.parent
    status = span.status
    rec: dict[str, Any] = {
        "name": span.name, "trace_id": format(ctx.trace_id, "032x") if ctx else None,
        "span_id": format(ctx.span_id, "016x") if ctx else None,
        "parent_span_id": format(parent.span_id, "016x") if parent else None,
        "kind": span.kind.name, "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": {"code": status.status_code.name, "description": status.description},
        "attributes": dict(span.attributes or {}),
        "service": (span.resource.attributes.get("service.name")
                    if span.resource is not None else None)}
    if span.events:
        rec["events"] = [{"name": e.name, "time_unix_nano": e.timestamp,
                          "attributes": dict(e.attributes or {})} for e in span.events]
    return rec


class JsonLinesSpanExporter(SpanExporter):
    """Writes each finished span as one JSON object per line (:func:`span_record`) to
    ``path``, appending.

    A write that fails (disk full, directory gone) returns ``FAILURE``; it never raises.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            lines = b"".join(orjson.dumps(span_record(s), default=str) + b"\n" for s in spans)
            with self._lock:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self.path.open("ab")
                self._file.write(lines)
                self._file.flush()
        except (OSError, TypeError, ValueError):
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter | None:
    """The OTLP exporter the ``OTEL_EXPORTER_OTLP_*`` settings of ``env`` ask for (None:
    no endpoint set). Headers, timeout, certificates: the exporter reads them itself."""
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not (traces or base):
        return None
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )
        return GrpcExporter(endpoint=traces or base)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    # the spec: a signal-specific endpoint is used as is; the base one gets /v1/traces
    return OTLPSpanExporter(endpoint=traces or f"{(base or '').rstrip('/')}/v1/traces")


def proxy_tracer_provider(trace_dir: Path | None, *,
                          env: Mapping[str, str] | None = None) -> TracerProvider:
    """The proxy's own tracer provider (never installed as the process's global one).

    Args:
        trace_dir: where ``spans.jsonl`` goes when no OTLP endpoint is configured.
        env: the environment to read ``OTEL_*`` settings from (default ``os.environ``).

    Returns:
        The active :func:`capture_spans` provider when there is one; else a provider
        with a batch processor over OTLP, JSON lines, or (neither configured) no exporter.
    """
    if _captures:
        return _captures[-1]
    env = os.environ if env is None else env
    provider = TracerProvider(resource=Resource.create({"service.name": env.get(
        "OTEL_SERVICE_NAME", "flowlift-proxy")}), shutdown_on_exit=False)  # the app shuts
    # it down at cleanup; no atexit hook per app (tests make hundreds)
    exporter = _otlp_exporter(env)
    if exporter is None and trace_dir is not None:
        exporter = JsonLinesSpanExporter(trace_dir / "spans.jsonl")
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    else:
        _silent.add(provider)
    return provider


def exports(provider: TracerProvider) -> bool:
    """Whether spans of ``provider`` go anywhere: False only for a
    :func:`proxy_tracer_provider` made with nowhere to export them (no OTLP endpoint, no
    trace directory), whose spans nothing would ever read."""
    return provider not in _silent


def capturing() -> bool:
    """Whether a :func:`capture_spans` block is active."""
    return bool(_captures)


def configure_tracing(service_name: str, *, jsonl_path: str | os.PathLike[str] | None = None,
                      env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Set up OpenTelemetry for an application that has none, so the SDK's spans are
    recorded and its ``traceparent`` joins the proxy's spans to them: OTLP when
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, else JSON lines at ``jsonl_path``, through a
    batch processor (flushed at exit). An app that already installed a provider keeps it.

    Returns:
        The provider installed, or None (one was already set, or nothing to export to).
    """
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return None
    env = os.environ if env is None else env
    exporter = _otlp_exporter(env)
    if exporter is None and jsonl_path is not None:
        exporter = JsonLinesSpanExporter(jsonl_path)
    if exporter is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": env.get(
        "OTEL_SERVICE_NAME", service_name)}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def sdk_tracer_provider() -> trace.TracerProvider:
    """The provider the SDK records with: the active :func:`capture_spans` one, else the
    application's global OpenTelemetry provider (a no-op one unless the app set one up,
    in which case the SDK's spans cost nothing and no ``traceparent`` is sent)."""
    return _captures[-1] if _captures else trace.get_tracer_provider()


class CapturedSpans:
    """Finished spans recorded while :func:`capture_spans` is active."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    @property
    def spans(self) -> list[ReadableSpan]:
        """Every finished span so far, in the order they ended."""
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        """Finished spans called ``name`` (e.g. ``"chat fake-model"``)."""
        return [s for s in self.spans if s.name == name]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        """Finished spans whose parent is ``parent``, by start time."""
        pid = parent.context.span_id
        return sorted((s for s in self.spans if s.parent is not None and s.parent.span_id == pid),
                      key=lambda s: s.start_time or 0)


@contextmanager
def capture_spans() -> Iterator[CapturedSpans]:
    """Record flowlift's spans in memory for the duration of the block (tests)::

        with capture_spans() as captured:
            app = create_app({"m": FakeEngine(["m"])})
            ...
        assert captured.named("chat m")

    Proxies created inside the block, and the SDK's workflows run inside it, use the
    captured provider.
    """
    captured = CapturedSpans()
    _captures.append(captured.provider)
    try:
        yield captured
    finally:
        _captures.remove(captured.provider)
        captured.provider.shutdown()


def extract(headers: Mapping[str, str]) -> Context | None:
    """The caller's trace context from W3C ``traceparent`` / ``tracestate`` headers, or
    None when there is none (a malformed ``traceparent`` is ignored, as the spec says)."""
    if "traceparent" not in headers:
        return None
    ctx = _W3C.extract({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def inject(headers: MutableMapping[str, str], context: Context | None = None) -> None:
    """Write the current (or ``context``'s) span as W3C ``traceparent`` / ``tracestate``,
    replacing any the caller sent; nothing is written when no span is recording."""
    if trace.get_current_span(context).get_span_context().is_valid:
        headers.pop("traceparent", None)
        headers.pop("tracestate", None)
        _W3C.inject(headers, context=context)
