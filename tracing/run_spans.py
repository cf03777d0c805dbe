"""A workflow run as OpenTelemetry spans (GenAI semantic conventions).

The run's ``invoke_workflow {name}`` span is live: it starts with the run (a child of
the caller's ``traceparent`` when one came with the graph) and is the current span of
the run's task, so upstream requests of its steps carry it as their ``traceparent``.
Its children are built when the run ends, from the :class:`RunTrace` records, with the
instants the run measured as their start and end times -- nothing on the hot path::

    invoke_workflow docs                      ready ............................ finished
      chat SmolLM2 (step extract_1)           ready ......................... finished
        queue                                 ready .. started
        attempt 1   (outcome ok)                       started ............. finished
          prefill                                      started .. first_token
          decode                                                 first_token .. generated
        validate                                                      generated .. finished
      execute_tool related (step related_1)   wanted ............ result arrived
        tool_wait

A retried step has one ``attempt N`` child per try (a contract failure, an engine
error, a cascade's next model), so retries show where their time went. An agent step
has one ``turn N`` child per model turn (with its prefill and decode) and one
``execute_tool {name}`` child per tool call its model asked for (``tool_wait`` inside)::

      chat SmolLM2 (step agent_1)
        turn 1  (outcome tool_calls)
        execute_tool search   (call agent_1:call_1)
        execute_tool lookup   (call agent_1:call_2)
        turn 2  (outcome ok)
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from flowlift.tracing import genai
from flowlift.tracing.recorder import AttemptTrace, RunTrace, StepTrace, ToolCallTrace

ProviderOf = Callable[[str | None], str]
_OUTCOME_ERROR = {"error": "engine_error", "contract_failed": "contract_failed"}


def _ns(trace_: RunTrace, ms: float) -> int:
    return int(trace_.started_at * 1e9) + round(ms * 1e6)  # one base: offsets stay exact


def step_error_type(st: StepTrace) -> str:
    """A low-cardinality ``error.type`` for a failed step."""
    msg = st.error or ""
    if st.attempts and st.attempts[-1].outcome in _OUTCOME_ERROR:
        return _OUTCOME_ERROR[st.attempts[-1].outcome]
    if msg.startswith("skipped"):
        return "upstream_step_failed"
    if "deadline" in msg:
        return "deadline_exceeded"
    if "cancelled" in msg:
        return "cancelled"
    return "step_failed"


class RunSpans:
    """The spans of one run.

    Args:
        tracer: the proxy's tracer.
        trace_: the run's records (its clock gives the spans' times).
        parent: the caller's trace context (W3C ``traceparent``), or None for a new trace.
        provider_of: model name -> ``gen_ai.provider.name``.
        request_models: step id -> the model the graph asked for.
    """

    def __init__(self, tracer: trace.Tracer, trace_: RunTrace, parent: Context | None,
                 provider_of: ProviderOf, request_models: dict[str, str | None]) -> None:
        self.tracer, self.trace, self.provider_of = tracer, trace_, provider_of
        self.request_models = request_models
        self.span: Span = tracer.start_span(
            f"invoke_workflow {trace_.name}", context=parent, kind=SpanKind.SERVER,
            start_time=_ns(trace_, 0.0), attributes={
                genai.OPERATION: "invoke_workflow", genai.WORKFLOW_ID: trace_.run_id,
                genai.WORKFLOW_NAME: trace_.name,
                "flowlift.workflow.class": trace_.workflow_class})
        self._ctx = trace.set_span_in_context(self.span)

    def task_context(self) -> contextvars.Context:
        """A copy of the current context with the run's span current (for the run task)."""
        ctx = contextvars.copy_context()
        ctx.run(otel_context.attach, self._ctx)
        return ctx

    def close(self, deadline_missed: bool = False) -> None:
        """End the run span and emit its steps' spans from the trace records."""
        t, span = self.trace, self.span
        for st in t.steps.values():
            if st.kind in ("llm", "tool") and (st.ready_ms is not None
                                               or st.finished_ms is not None):
                self._step(st)  # a step skipped for a failed input: a span at its end
        span.set_attribute("flowlift.workflow.status", t.status)
        span.set_attribute("flowlift.workflow.steps", len(t.steps))
        if t.status != "succeeded":
            span.set_attribute(genai.ERROR_TYPE, "deadline_exceeded" if deadline_missed
                               else "cancelled" if t.status == "cancelled" else "step_failed")
            span.set_status(Status(StatusCode.ERROR, f"run {t.status}"))
        span.end(_ns(t, t.finished_ms if t.finished_ms is not None else t.now_ms()))

    def _child(self, name: str, parent: Span, start_ms: float | None, end_ms: float | None,
               attributes: dict[str, Any], kind: SpanKind = SpanKind.INTERNAL) -> Span | None:
        if start_ms is None or end_ms is None:
            return None
        child = self.tracer.start_span(name, context=trace.set_span_in_context(parent),
                                       kind=kind, start_time=_ns(self.trace, start_ms),
                                       attributes=attributes)
        child.end(_ns(self.trace, max(end_ms, start_ms)))
        return child

    def _ids(self, st: StepTrace, stage: str | None = None) -> dict[str, Any]:
        ids: dict[str, Any] = {genai.WORKFLOW_ID: self.trace.run_id, genai.STEP_ID: st.step_id}
        if stage is not None:
            ids[genai.STAGE] = stage
        return ids

    def _step(self, st: StepTrace) -> None:
        end_ms = st.finished_ms if st.finished_ms is not None else self.trace.now_ms()
        start_ms = st.ready_ms if st.ready_ms is not None else end_ms
        if st.kind == "tool":
            attrs = {**self._ids(st), genai.OPERATION: "execute_tool", genai.TOOL_NAME: st.name,
                     genai.TOOL_CALL_ID: st.step_id}
            span = self.tracer.start_span(f"execute_tool {st.name}",
                                          context=trace.set_span_in_context(self.span),
                                          start_time=_ns(self.trace, start_ms),
                                          attributes=attrs)
            self._child("tool_wait", span, st.ready_ms, end_ms, self._ids(st, "tool_wait"))
        else:
            span = self._llm_step(st, start_ms, end_ms)
        if st.status == "failed":
            span.set_attribute(genai.ERROR_TYPE, step_error_type(st))
            span.set_status(Status(StatusCode.ERROR, st.error))
        span.end(_ns(self.trace, end_ms))

    def _llm_step(self, st: StepTrace, start_ms: float, end_ms: float) -> Span:
        provider = self.provider_of(st.model)
        attrs: dict[str, Any] = {**self._ids(st), genai.OPERATION: "chat",
                                 genai.PROVIDER: provider, "flowlift.step.name": st.name}
        requested = self.request_models.get(st.step_id) or st.model
        if requested:
            attrs[genai.REQUEST_MODEL] = requested
        if st.model and st.started_ms is not None:
            attrs[genai.RESPONSE_MODEL] = st.model
        if st.started_ms is not None:
            attrs.update(genai.usage_attributes(st.prompt_tokens, st.completion_tokens,
                                                st.cached_tokens))
        if st.same_as:
            attrs["flowlift.step.same_as"] = st.same_as
        if st.attempts:
            attrs["flowlift.step.attempts"] = len(st.attempts)
            if st.attempts[-1].finish_reason:
                attrs[genai.FINISH_REASONS] = (st.attempts[-1].finish_reason,)
        kind = SpanKind.CLIENT if provider == "openai" else SpanKind.INTERNAL
        span = self.tracer.start_span(f"chat {st.model or requested or 'default'}",
                                      context=trace.set_span_in_context(self.span), kind=kind,
                                      start_time=_ns(self.trace, start_ms),
                                      attributes=attrs)
        first = st.attempts[0].started_ms if st.attempts else st.started_ms
        self._child("queue", span, st.ready_ms, first if first is not None else
                    (end_ms if st.same_as or st.status == "failed" else None),
                    self._ids(st, "queue"))
        for i, at in enumerate(st.attempts):
            last = i == len(st.attempts) - 1
            self._attempt(span, st, at, st.generated_ms if last else None)
        for call in st.tool_calls:
            self._tool_call(span, st, call)
        if st.attempts and st.attempts[-1].outcome != "error":
            self._child("validate", span, st.generated_ms, st.finished_ms,
                        self._ids(st, "validate"))
        return span

    def _attempt(self, step_span: Span, st: StepTrace, at: AttemptTrace,
                 generated_ms: float | None) -> None:
        attrs: dict[str, Any] = {**self._ids(st, "attempt"), "flowlift.attempt": at.attempt,
                                 "flowlift.attempt.outcome": at.outcome,
                                 genai.REQUEST_MODEL: at.model,
                                 **genai.usage_attributes(at.prompt_tokens,
                                                          at.completion_tokens,
                                                          at.cached_tokens)}
        if at.turn is not None:
            attrs["flowlift.turn"] = at.turn
        elif at.attempt > 1:
            attrs["flowlift.retry"] = True
        if at.finish_reason:
            attrs[genai.FINISH_REASONS] = (at.finish_reason,)
        end = at.finished_ms if at.finished_ms is not None else self.trace.now_ms()
        name = f"attempt {at.attempt}" if at.turn is None else f"turn {at.turn}"
        span = self.tracer.start_span(name,
                                      context=trace.set_span_in_context(step_span),
                                      start_time=_ns(self.trace, at.started_ms),
                                      attributes=attrs)
        decode_end = generated_ms if generated_ms is not None else end
        self._child("prefill", span, at.started_ms, at.first_token_ms,
                    self._ids(st, "prefill"))
        self._child("decode", span, at.first_token_ms, decode_end, self._ids(st, "decode"))
        if at.outcome in _OUTCOME_ERROR:
            span.set_attribute(genai.ERROR_TYPE, _OUTCOME_ERROR[at.outcome])
            span.set_status(Status(StatusCode.ERROR, at.error))
        span.end(_ns(self.trace, end))

    def _tool_call(self, step_span: Span, st: StepTrace, call: ToolCallTrace) -> None:
        """An agent step's tool call: ``execute_tool {name}`` with its ``tool_wait`` (the
        app ran it) or ``tool_run`` (the proxy did, ``flowlift.tool.server``)."""
        end = call.finished_ms if call.finished_ms is not None else self.trace.now_ms()
        attrs: dict[str, Any] = {**self._ids(st), genai.OPERATION: "execute_tool",
                                 genai.TOOL_NAME: call.name, genai.TOOL_CALL_ID: call.call_id,
                                 "flowlift.turn": call.turn,
                                 "flowlift.tool.outcome": call.outcome}
        stage = "tool_wait" if call.server is None else "tool_run"
        if call.server is not None:
            attrs["flowlift.tool.server"] = call.server
        span = self.tracer.start_span(f"execute_tool {call.name}",
                                      context=trace.set_span_in_context(step_span),
                                      start_time=_ns(self.trace, call.wanted_ms),
                                      attributes=attrs)
        self._child(stage, span, call.wanted_ms, end, self._ids(st, stage))
        if call.outcome in ("error", "invalid"):
            span.set_attribute(genai.ERROR_TYPE, f"tool_{call.outcome}")
            span.set_status(Status(StatusCode.ERROR, call.error))
        span.end(_ns(self.trace, end))
