"""The SDK's spans: ``invoke_workflow {name}`` around a run, ``execute_tool {name}``
around each ``@tool`` call, and the W3C ``traceparent`` sent with the graph so the
proxy's spans join the same trace.

The SDK records with the application's OpenTelemetry tracer provider (or the one of
:func:`flowlift.testing.capture_spans`). An application that set up none gets
OpenTelemetry's no-op provider: nothing is recorded and no ``traceparent`` is sent --
unless the app is itself inside a traced request, whose context is continued. Tracing
never raises into the app: a failure to record is swallowed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from flowlift.tracing import genai
from flowlift.tracing.spans import inject, sdk_tracer_provider

if TYPE_CHECKING:
    from flowlift.sdk.workflow import Workflow


def _tracer() -> trace.Tracer:
    return sdk_tracer_provider().get_tracer("flowlift.sdk")


@contextlib.contextmanager
def workflow_span(wf: Workflow) -> Iterator[dict[str, str]]:
    """Run the block in the workflow's ``invoke_workflow`` span; yields the trace
    headers to send with the graph (empty when nothing records)."""
    span = _start_workflow_span(wf, None)
    token = otel_context.attach(trace.set_span_in_context(span))
    headers: dict[str, str] = {}
    error: BaseException | None = None
    try:
        inject(headers)
        yield headers
    except BaseException as exc:
        error = exc
        raise
    finally:
        otel_context.detach(token)
        _end_workflow_span(wf, span, error)


class OpenWorkflowSpan:
    """The ``invoke_workflow`` span of an open run (:mod:`flowlift.sdk.open_run`): it
    starts at the block's first read and ends when the block exits. Never attached to
    the app's context (reads may happen in any task or thread): :attr:`context` is the
    parent of the run's ``@tool`` spans, :attr:`headers` go with every request."""

    def __init__(self, wf: Workflow) -> None:
        self._wf = wf
        self.span = _start_workflow_span(wf, otel_context.get_current())
        self.context = trace.set_span_in_context(self.span)
        self.headers: dict[str, str] = {}
        inject(self.headers, self.context)

    def end(self, exc: BaseException | None = None) -> None:
        _end_workflow_span(self._wf, self.span, exc)


def _start_workflow_span(wf: Workflow, parent: otel_context.Context | None) -> trace.Span:
    return _tracer().start_span(f"invoke_workflow {wf.name}", context=parent,
                                kind=SpanKind.CLIENT,
                                attributes={genai.OPERATION: "invoke_workflow",
                                            genai.WORKFLOW_NAME: wf.name,
                                            "flowlift.workflow.class": wf.workflow_class,
                                            "flowlift.workflow.steps": len(wf.nodes)})


def _end_workflow_span(wf: Workflow, span: trace.Span, exc: BaseException | None) -> None:
    """Record the run's outcome (``exc``: what the block raised) and end the span."""
    with contextlib.suppress(Exception):
        if exc is not None:
            span.set_attribute(genai.ERROR_TYPE, type(exc).__name__)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
        if wf.run_id is not None:
            span.set_attribute(genai.WORKFLOW_ID, wf.run_id)
        span.set_attribute("flowlift.workflow.status", wf.status)
        if wf.failures:
            span.set_attribute("flowlift.workflow.failed_steps", len(wf.failures))
            span.set_attribute(genai.ERROR_TYPE, "step_failed")
            span.set_status(Status(StatusCode.ERROR, f"{len(wf.failures)} steps failed"))
    span.end()


def current_context() -> otel_context.Context:
    """The current OpenTelemetry context (to hand to tool threads)."""
    return otel_context.get_current()


@contextlib.contextmanager
def tool_span(wf: Workflow, step_id: str, name: str,
              parent: otel_context.Context | None = None) -> Iterator[Any]:
    """Run one ``@tool`` call in an ``execute_tool {name}`` span (``parent``: the
    workflow's context, for calls in worker threads). Yields a callback taking the
    call's result (``{"value"}`` or ``{"error"}``) to mark a failed call."""
    span = _tracer().start_span(f"execute_tool {name}", context=parent,
                                kind=SpanKind.INTERNAL, attributes={
                                    genai.OPERATION: "execute_tool", genai.TOOL_NAME: name,
                                    genai.TOOL_CALL_ID: step_id, genai.STEP_ID: step_id,
                                    genai.WORKFLOW_ID: wf.run_id or ""})

    def result(outcome: dict[str, Any]) -> None:
        if "error" in outcome:
            with contextlib.suppress(Exception):
                span.set_attribute(genai.ERROR_TYPE, str(outcome["error"]).split(":", 1)[0])
                span.set_status(Status(StatusCode.ERROR, str(outcome["error"])))

    token = otel_context.attach(trace.set_span_in_context(span, parent))
    try:
        yield result  # the tool's own spans (if it makes any) are children of this one
    finally:
        otel_context.detach(token)
        span.end()
