"""Tracing: one workflow id across every step, time split by stage.

``StepTrace``/``RunTrace`` record when each step was ready, dispatched, produced its
first token and finished (offsets in ms from the run's start); :func:`stage_summary`
splits the time into queue, prefill (TTFT), decode, validate and tool wait.

OpenTelemetry (GenAI semantic conventions): :mod:`flowlift.tracing.spans` (providers,
export, W3C trace context, :func:`capture_spans`), :mod:`flowlift.tracing.run_spans` (a
run as spans), :mod:`flowlift.tracing.metrics` (Prometheus), :mod:`flowlift.tracing.genai`
(attribute names).
"""

from flowlift.tracing.logging import bind_run, configure_logging, get_logger
from flowlift.tracing.recorder import AttemptTrace, RunTrace, StepTrace, ToolCallTrace
from flowlift.tracing.spans import capture_spans, configure_tracing
from flowlift.tracing.summary import STAGES, format_stage_table, stage_summary

__all__ = [
    "STAGES",
    "AttemptTrace",
    "RunTrace",
    "StepTrace",
    "ToolCallTrace",
    "bind_run",
    "capture_spans",
    "configure_logging",
    "configure_tracing",
    "format_stage_table",
    "get_logger",
    "stage_summary",
]
