"""The proxy's traces and metrics: one :class:`Telemetry` per app (``app[TELEMETRY]``).

* Workflow runs: :meth:`Telemetry.run_started` gives the run's task a context whose
  current span is the run's ``invoke_workflow`` span (a child of the caller's
  ``traceparent``); :meth:`Telemetry.run_closed` ends it, emits its steps' spans from
  the trace (:mod:`flowlift.tracing.run_spans`) and feeds the metrics.
* OpenAI API requests: :mod:`flowlift.proxy.telemetry.requests` (called by the app's
  middleware, :func:`flowlift.proxy.middleware.proxy_stack`).
* ``GET /metrics``: Prometheus' text format (:mod:`flowlift.tracing.metrics`).

Spans are exported by a batch processor in the background (see
:mod:`flowlift.tracing.spans`); the app flushes it when it shuts down. Nothing here
raises into a run or a request: failures are logged.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST

from flowlift.graph import LLMNode
from flowlift.proxy.telemetry import requests as request_tracing
from flowlift.tracing import genai, spans
from flowlift.tracing.logging import get_logger
from flowlift.tracing.metrics import Metrics
from flowlift.tracing.run_spans import RunSpans

if TYPE_CHECKING:
    from flowlift.local_engine.residency import ResidencyManager
    from flowlift.proxy.dispatch.backends import Backends
    from flowlift.proxy.workflows.runs import Run

log = get_logger("flowlift.tracing")


def _model_loads(residency: ResidencyManager | None) -> list[tuple[str, int, int]]:
    """``[(model, loads, unloads)]`` of a residency manager (none without one)."""
    if residency is None:
        return []
    return [(m, residency.loads[m], residency.unloads[m]) for m in sorted(residency.models)]


class Telemetry:
    """Tracer and metrics of one proxy.

    Args:
        provider: the proxy's tracer provider
            (:func:`~flowlift.tracing.spans.proxy_tracer_provider`).
        backends: the proxy's backends and upstreams (read by the metrics at
            scrape time, and to name a model's provider on its spans).
        active_runs: the number of workflow runs active now (read at scrape time).
        owned: the provider is this proxy's own (shut down with it); False for one it
            shares (a :func:`~flowlift.tracing.spans.capture_spans` provider): only flushed.
        residency: the residency manager of the embedded models, if any (its load and
            unload counts are read at scrape time).
    """

    def __init__(self, provider: TracerProvider, backends: Backends,
                 active_runs: Callable[[], int], *, owned: bool = True,
                 residency: ResidencyManager | None = None) -> None:
        self.provider, self.owned = provider, owned
        self.tracer = provider.get_tracer("flowlift.proxy")
        self.backends = backends
        prices = backends.config.prices() if backends.config is not None else {}
        self.metrics = Metrics(queue_depth=self._queue_depth,
                               active_workflows=active_runs,
                               upstream_in_flight=self._in_flight,
                               preemptions=self._preemptions,
                               price_per_1k=prices.get,
                               model_loads=lambda: _model_loads(residency),
                               programs=self._programs)
        self._runs: dict[str, RunSpans] = {}

    @classmethod
    def for_proxy(cls, provider: TracerProvider | None, trace_dir: Path | None,
                  backends: Backends,
                  active_runs: Callable[[], int],
                  residency: ResidencyManager | None = None) -> Telemetry:
        """The telemetry of one proxy app.

        Args:
            provider: a tracer provider to use (not shut down with the app); None: the
                proxy's own (:func:`~flowlift.tracing.spans.proxy_tracer_provider`, JSON
                lines under ``trace_dir`` unless OTLP is configured).
        """
        owned = provider is None and not spans.capturing()
        provider = provider or spans.proxy_tracer_provider(trace_dir)
        return cls(provider, backends, active_runs, owned=owned, residency=residency)

    def request_spans(self) -> request_tracing.RequestTracing:
        """What gives each OpenAI API request its span and feeds the metrics
        (:class:`flowlift.proxy.telemetry.requests.RequestTracing`, called by the
        proxy's middleware)."""
        return request_tracing.RequestTracing(self.tracer, self.observe_request,
                                              recording=spans.exports(self.provider))

    def _queue_depth(self) -> list[tuple[str, str, int]]:
        out = []
        for backend in self.backends.backends:
            for cls, n in backend.slots.queued_by_class().items():
                out.append((backend.name, cls, n))
        return out

    def _preemptions(self) -> list[tuple[str, int]]:
        return [(b.name, b.slots.preemptions) for b in self.backends.backends
                if b.slots.preempt]

    def _programs(self) -> list[tuple[str, int, int, int, int]]:
        out = []
        for b in self.backends.backends:
            book = b.slots.programs
            if book.enabled:
                out.append((b.name, len(book), book.keeping(), book.aged, book.held))
        return out

    def _in_flight(self) -> list[tuple[str, int]]:
        return [(name, up.health.in_flight) for name, up in self.backends.upstreams.items()]

    def provider_of(self, model: str | None) -> str:
        try:
            return genai.provider_name(self.backends.resolve(model)[1].engine)
        except Exception:
            return "vllm"

    # -- workflow runs ----------------------------------------------------------------
    def run_started(self, run: Run) -> contextvars.Context | None:
        """The context to run ``run``'s task in (its span current), or None on failure."""
        try:
            models = {n.id: n.model for n in run.graph.nodes if isinstance(n, LLMNode)}
            run_spans = RunSpans(self.tracer, run.trace, run.trace_parent,
                                 self.provider_of, models)
            self._runs[run.run_id] = run_spans
            return run_spans.task_context()
        except Exception:
            log.exception("tracing_failed", hook="run_started")
            return None

    def run_closed(self, run: Run) -> None:
        """Count the run in the metrics; end its span and emit its steps' spans in a
        worker thread (the trace is final now), so the run's last event is not held up
        by building them (~0.2 ms a step, ``bench/tracing_overhead.py``)."""
        missed = run.deadline_missed
        try:
            self.metrics.observe_run(run.trace, deadline_missed=missed, tenant=run.tenant)
        except Exception:
            log.exception("metrics_failed", hook="run_closed")
        run_spans = self._runs.pop(run.run_id, None)
        if run_spans is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            _close_spans(run_spans, missed)
        else:
            loop.run_in_executor(None, _close_spans, run_spans, missed)

    # -- OpenAI requests --------------------------------------------------------------
    def observe_request(self, rt: request_tracing.RequestTrace) -> None:
        """Count one finished OpenAI request in the metrics, once: its outcome, latency,
        tokens (estimated ones flagged) and spend."""
        prompt, completion, cached, partial = rt.usage_numbers()
        start = rt.slot_at or rt.t0
        ttft = None if rt.first_at is None else rt.first_at - start
        decode = (None if rt.first_at is None or rt.last_at is None
                  else rt.last_at - rt.first_at)
        self.metrics.observe_request(rt.operation, rt.outcome, rt.response_model or rt.model,
                                     ttft, decode, (prompt, completion, cached), partial,
                                     overhead_s=rt.overhead_s(), stream=rt.stream)
        if rt.model is not None:  # spend goes by the served name: the config prices it
            self.metrics.spend(rt.model, prompt or 0, completion or 0)
            self.metrics.tenant_usage(rt.tenant, rt.model, prompt or 0, completion or 0)

    async def shutdown(self) -> None:
        """Flush (and, when owned, stop) the exporter, in a thread: it blocks up to its
        timeout."""
        await asyncio.to_thread(self.provider.shutdown if self.owned
                                else self.provider.force_flush)


def _close_spans(run_spans: RunSpans, deadline_missed: bool) -> None:
    try:
        run_spans.close(deadline_missed=deadline_missed)
    except Exception:
        log.exception("tracing_failed", hook="run_closed")


TELEMETRY: web.AppKey[Telemetry] = web.AppKey("flowlift.telemetry", Telemetry)


async def metrics_handler(request: web.Request) -> web.Response:
    """``GET /metrics``: the proxy's metrics in Prometheus' text format."""
    body = request.app[TELEMETRY].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def setup(app: web.Application, telemetry: Telemetry) -> None:
    """Serve ``telemetry`` on ``app``: ``app[TELEMETRY]``, the ``/metrics`` route, the
    ``x-flowlift-overhead-ms`` header of OpenAI requests' responses, and a flush at
    shutdown. (Its request spans are begun and ended by the app's middleware:
    :meth:`Telemetry.request_spans`.)"""
    app[TELEMETRY] = telemetry
    app.router.add_get("/metrics", metrics_handler)
    app.on_response_prepare.append(request_tracing.overhead_header)

    async def flush(_: web.Application) -> None:
        await telemetry.shutdown()
    app.on_cleanup.append(flush)
