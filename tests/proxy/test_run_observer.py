"""A run's observer (the proxy's telemetry) comes through the registry's constructor:
every run the registry starts or resumes reports to it, with the caller's trace context."""

from __future__ import annotations

import asyncio
import contextvars

from opentelemetry.context import Context

from flowlift.compiler import CompileOptions, compile_graph
from flowlift.costs import CostTracker
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.workflows.observer import NO_OBSERVER
from flowlift.proxy.workflows.registry import RunRegistry
from flowlift.proxy.workflows.runs import Run
from flowlift.testing import FakeEngine

SEEN_BY_TASK: contextvars.ContextVar[str] = contextvars.ContextVar("seen_by_task",
                                                                   default="caller's")
GRAPH = {"nodes": [{"kind": "llm", "id": "a", "messages": [
    {"role": "user", "content": [{"text": "hi"}]}]}]}


class Recorder:
    """A RunObserver noting what it was told; runs' tasks run in its own context."""

    def __init__(self) -> None:
        self.started: list[tuple[str, Context | None]] = []
        self.closed: list[tuple[str, str, bool, str]] = []

    def run_started(self, run: Run) -> contextvars.Context | None:
        self.started.append((run.run_id, run.trace_parent))
        ctx = contextvars.copy_context()
        ctx.run(SEEN_BY_TASK.set, "observer's")
        return ctx

    def run_closed(self, run: Run) -> None:
        self.closed.append((run.run_id, run.trace.status, run.deadline_missed,
                            SEEN_BY_TASK.get()))  # called from the run's task


async def test_started_and_resumed_runs_report_to_the_registrys_observer():
    store = RunStore(":memory:")
    graph = Graph.model_validate(GRAPH)
    store.create("wf-old", graph.to_wire())
    observer = Recorder()
    registry = RunRegistry(store, observer=observer)
    backends, costs = Backends({"m": FakeEngine(["m"])}), CostTracker()
    (resumed,) = await registry.resume_all(backends, costs)
    parent = Context({"marker": 1})
    run = await registry.start(Graph.model_validate(GRAPH), backends, costs,
                         compile_graph(graph, CompileOptions(default_model="m")),
                         parent=parent)
    assert run.observer is observer and resumed.observer is observer
    assert observer.started == [("wf-old", None), (run.run_id, parent)]
    await asyncio.wait_for(run.task, 10)  # type: ignore[arg-type]
    assert observer.closed == [(run.run_id, "succeeded", False, "observer's")]
    resumed.cancel()
    await asyncio.wait([resumed.task])  # type: ignore[list-item]


async def test_without_an_observer_a_run_still_runs():
    registry = RunRegistry()
    assert registry.observer is NO_OBSERVER
    graph = Graph.model_validate(GRAPH)
    run = await registry.start(graph, Backends({"m": FakeEngine(["m"])}), CostTracker(),
                         compile_graph(graph, CompileOptions(default_model="m")))
    assert run.observer is NO_OBSERVER and run.trace_parent is None
    await asyncio.wait_for(run.task, 10)  # type: ignore[arg-type]
    assert run.trace.status == "succeeded"
