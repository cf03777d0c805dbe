"""A run's trace rebuilt from its event log (after a restart, or read offline).

Each ``step.finished`` / ``step.failed`` event carries the step's trace record
(``trace``: instants in ms since the run started, attempts, tokens; see
:class:`flowlift.tracing.StepTrace`), ``run.started`` the run's start (``started_at``,
epoch s) and each ``run.resumed`` the gap its restart left (``restart``: ``{from_ms,
to_ms}``, :meth:`flowlift.tracing.RunTrace.restarted`). A resumed run continues its
clock from that start and takes those records back, so its trace, report, metrics and
cost totals count the steps that finished before the crash; a reader without a proxy
(``flowlift trace --state-db``) rebuilds the trace of a run that never finished the same
way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flowlift.proxy.store.events import FINAL, Event
from flowlift.tracing import RunTrace

STEP_ENDS = ("step.finished", "step.failed", "step.skipped")


def started_at(events: Iterable[Event]) -> float | None:
    """The run's first start (epoch s), from its first ``run.started`` event."""
    for _, name, data in events:
        if name == "run.started" and "started_at" in data:
            return float(data["started_at"])
    return None


def restore_trace(trace: RunTrace, events: Iterable[Event]) -> int:
    """Put the recorded steps of ``events`` into ``trace`` (their clock included).

    Returns:
        How many step records were restored.
    """
    events = list(events)
    start = started_at(events)
    if start is not None:
        trace.continue_from(start)
    restored = 0
    for _, name, data in events:
        if name == "run.resumed" and isinstance(data.get("restart"), dict):
            trace.restarts.append(dict(data["restart"]))  # an earlier restart's gap
        record = data.get("trace")
        if name in STEP_ENDS and isinstance(record, dict) and data["step_id"] in trace.steps:
            trace.step(data["step_id"]).restore(record)
            restored += 1
    return restored


def trace_records(run_id: str, graph: dict[str, Any], events: list[Event]
                  ) -> list[dict[str, Any]]:
    """A stored run's trace records: the final ones when it finished, else rebuilt from
    its step events (steps that never finished show as ``pending``)."""
    final = next((d for _, n, d in events if n == FINAL), None)
    if final is not None and final.get("trace"):
        return list(final["trace"])
    trace = RunTrace(run_id, str(graph.get("name") or "workflow"),
                     str(graph.get("class") or "interactive"))
    for node in graph.get("nodes") or []:
        trace.add_step(node["id"], node["kind"], node.get("name", ""), node.get("model"))
    restore_trace(trace, events)
    trace.status = "running" if final is None else str(final.get("status"))
    return trace.records()
