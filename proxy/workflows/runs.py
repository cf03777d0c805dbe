"""Running one workflow graph: every node starts as soon as its inputs are known.

Pure dataflow execution over Semantic Variables (Parrot, OSDI'24): the graph's edges
come from references, so independent nodes run concurrently and a node that reads
two outputs waits for both (case W1). A failed step fails only the steps downstream
of it; everything else still runs and every finished output is kept.

Events (``Run.log``, numbered) drive the SSE stream of ``POST /v1/workflows``:
``run.started`` (or ``run.resumed``), ``step.finished``, ``step.failed``,
``tool.wanted``, ``run.finished``; an agent step (an llm step with ``tools``) adds
``agent.turn`` and ``tool.result`` (:mod:`flowlift.proxy.workflows.agent`). A run
restored from the store starts with its finished outputs and failures in place and
runs only what is left.

An open run (a graph posted with ``"open": true``) also takes nodes while it runs
(``nodes.appended``) and finishes only once closed (``run.closed``): see
:mod:`flowlift.proxy.workflows.open_runs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import json
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.context import Context

from flowlift.compiler import Plan
from flowlift.costs import CostTracker
from flowlift.errors import FlowliftError, LeaseLost, RequestError, failure_kind
from flowlift.graph import (
    Graph,
    GroupNode,
    Items,
    LLMNode,
    MapNode,
    MessageTemplate,
    Node,
    Ref,
    Template,
    ToolNode,
    default_of,
    node_refs,
    project,
    render_value,
)
from flowlift.local_engine.base import ChatMessage, GenerationRequest, ToolCall
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.dispatch.steps import StepDispatcher
from flowlift.proxy.store.base import StoredRun
from flowlift.proxy.store.events import EventLog, Written
from flowlift.proxy.store.outcomes import StepOutcomes
from flowlift.proxy.tenants import RunKey
from flowlift.proxy.workflows.agent import AgentLoop, ProxyTools, ToolRaised
from flowlift.proxy.workflows.books import AttemptBooks
from flowlift.proxy.workflows.cascade import Attempt, Generated, run_step
from flowlift.proxy.workflows.conditions import (
    SKIPPED,
    PredicateFailed,
    condition_deps,
    kept_items,
    skip_for_condition,
    skip_for_inputs,
)
from flowlift.proxy.workflows.deadline import DeadlineClock
from flowlift.proxy.workflows.fanout import EXPANDED as MAP_EXPANDED
from flowlift.proxy.workflows.fanout import check_items, expand, gathered, item_ids
from flowlift.proxy.workflows.groups import RESOLVED as GROUP_RESOLVED
from flowlift.proxy.workflows.groups import resolve as resolve_group
from flowlift.proxy.workflows.observer import NO_OBSERVER, RunObserver
from flowlift.proxy.workflows.open_runs import APPENDED, CLOSED, Growth, stable_plan
from flowlift.proxy.workflows.planning import calibrate, sent
from flowlift.proxy.workflows.prefills import RunPrefills
from flowlift.proxy.workflows.replay import STEP_ENDS, restore_trace
from flowlift.proxy.workflows.requests import StepRequests
from flowlift.proxy.workflows.tiering import TieredDispatcher, planned_tiers
from flowlift.proxy.workflows.tool_wait import await_app
from flowlift.proxy.workflows.warmup import PrefixWarmup
from flowlift.tracing import AttemptTrace, RunTrace, bind_run, get_logger

log = get_logger("flowlift.runs")


class UpstreamFailed(Exception):
    """A step's input failed, so the step cannot run."""


class Run:
    """One execution of a validated graph.

    Attributes:
        run_id: ``wf-`` + random hex (or the graph's own ``id``): what clients see.
        key: the run's :class:`~flowlift.proxy.tenants.RunKey` in the store, engine and
            sessions (:func:`~flowlift.proxy.tenants.run_key`: ids are per tenant;
            default ``run_id``).
        log: the numbered event log (replayable; persisted through ``sink``).
        outputs: step id -> output value, filled as steps finish (a skipped step's
            ``default``, when it has one).
        failures: step id -> error message.
        skipped: step id -> why it was skipped (:mod:`.conditions`; not a failure).
        trace: the run's :class:`RunTrace`.
        tenant: who started it (:mod:`flowlift.proxy.tenants`; None: anonymous; a
            restored run's is the stored one).
        replan: the proxy's compiler for a grown graph (a map's items; None: the
            run keeps its plan).
    """

    def __init__(self, graph: Graph, backends: Backends, plan: Plan | None = None,
                 costs: CostTracker | None = None, *, run_id: str | None = None,
                 sink: Callable[[str, int, str, dict[str, Any]], Written] | None = None,
                 restored: StoredRun | None = None,
                 outcomes: StepOutcomes | None = None,
                 observer: RunObserver = NO_OBSERVER,
                 trace_parent: Context | None = None, key: RunKey | None = None,
                 proxy_tools: ProxyTools | None = None, tenant: str | None = None,
                 replan: Callable[[Graph], Plan] | None = None) -> None:
        self.graph = graph
        self.proxy_tools = proxy_tools
        self.outcomes = outcomes
        self.backends = backends
        self.plan = plan
        self.costs = costs
        self.clock = DeadlineClock(graph.deadline_s) if graph.deadline_s is not None else None
        self.warmup = PrefixWarmup(fcfs=backends.fcfs)
        self.run_id = run_id or graph.id or f"wf-{secrets.token_hex(8)}"
        self.key = key or RunKey(self.run_id)
        self.requests = StepRequests(self.key, fcfs=backends.fcfs)
        self.prefills = RunPrefills(backends, self.key, self.run_id)
        self.log = EventLog(None if sink is None else functools.partial(sink, self.key),
                            restored.events if restored else ())
        self.resumed = restored is not None
        self.parked = self.resumed and not graph.detached  # waits for its client to return
        self.outputs: dict[str, Any] = restored.outputs() if restored else {}
        self.failures: dict[str, str] = restored.failures() if restored else {}
        self.skipped: dict[str, str] = restored.skipped() if restored else {}
        self.detached_since: float | None = None
        self._suspending = False
        self.trace = RunTrace(self.run_id, graph.name, graph.workflow_class)
        self._deps: dict[str, frozenset[str]] = {}
        self._nodes: dict[str, Node] = {}
        self._readers: dict[str, list[str]] = {}  # step id -> the steps reading it
        self._know(graph.nodes)
        self._done = {n.id: asyncio.Event() for n in graph.nodes}
        self._tool_results: dict[str, asyncio.Future[Any]] = {}
        self._late: dict[str, str] = {}  # @tool steps that timed out -> why
        self.growth = Growth(graph.open, restored.events if restored else ())
        self._tasks: list[asyncio.Task[None]] | None = None  # the node tasks, once started
        self._node_tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelling: dict[str, str] = {}  # group members being stopped -> why
        self.replan = replan
        self._context: contextvars.Context | None = None  # where node tasks run
        self.task: asyncio.Task[None] | None = None
        self.observer = observer
        self.trace_parent = trace_parent
        self.deadline_missed = False
        self.tenant = restored.tenant if restored else tenant
        for node in graph.nodes:
            model = node.model if isinstance(node, LLMNode) else None
            self.trace.add_step(node.id, node.kind, getattr(node, "name", ""), model)
        self.prompts: dict[str, list[dict[str, str]]] = restored.prompts() if restored else {}
        if restored:  # steps finished before the restart keep their timings and tokens
            restore_trace(self.trace, restored.events)

    def _emit(self, event: tuple[str, dict[str, Any]]) -> None:
        self.log.emit(*event)

    @property
    def finished(self) -> bool:
        return self.trace.status != "running"

    def start(self) -> asyncio.Task[None]:
        ctx = self.observer.run_started(self)
        self.task = asyncio.create_task(self._fenced(), name=f"run {self.run_id}",
                                        context=ctx)
        return self.task

    async def _fenced(self) -> None:
        """The run, stopped quietly when the store refuses one of its events because
        another proxy took it over (the sink suspended it: see
        :meth:`flowlift.proxy.workflows.registry.RunRegistry.heartbeat`)."""
        try:
            await self._execute()
        except LeaseLost:
            log.info("run_stopped_lease_lost", workflow_id=self.run_id)

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def suspend(self) -> None:
        """Stop without finishing (proxy shutdown): the stored run resumes at next start."""
        self._suspending = True
        self.cancel()

    # -- client-run steps ----------------------------------------------------------
    def waiting_tools(self) -> list[str]:
        """Ids of the ``@tool`` steps and agent tool calls waiting for a result now."""
        return [step for step, fut in self._tool_results.items() if not fut.done()]

    def has_tool_result(self, step_id: str) -> bool:
        """Whether the step (or agent call) ``step_id`` has had its result already."""
        fut = self._tool_results.get(step_id)
        return (step_id in self.outputs or (fut is not None and fut.done())
                or any(n == "tool.result" and d.get("step_id") == step_id
                       for _, n, d in self.log.history()))

    def discard_late_result(self, step_id: str) -> bool:
        """Whether ``step_id`` timed out (:mod:`.tool_wait`): its result, posted now, is
        discarded, its time kept as ``late_result_ms`` in the trace."""
        if step_id not in self._late:
            return False
        st = self.trace.step(step_id)
        if st.late_result_ms is None:
            st.late_result_ms = self.trace.now_ms()
            log.info("tool_result_discarded", step_id=step_id, reason=self._late[step_id])
        return True

    def deliver_tool_result(self, step_id: str, value: Any = None,
                            error: str | None = None) -> None:
        """Hand a ``@tool`` step's result (or error) to the waiting branch.

        Raises:
            RequestError: the step is unknown or not waiting for a result.
        """
        fut = self._tool_results.get(step_id)
        if fut is None or fut.done():
            raise RequestError(f"step {step_id!r} of run {self.run_id} is not waiting for a "
                               "tool result", param="step_id")
        if error is not None:
            fut.set_exception(ToolRaised(step_id, error))
        else:
            fut.set_result(value)

    # -- execution -------------------------------------------------------------------
    async def _execute(self) -> None:
        if self.parked:  # until its client reconnects (or the sweep cancels it)
            try:
                await self.log.listened.wait()
            except asyncio.CancelledError:
                if not self._suspending:
                    self._fail_unfinished([], "run cancelled (its client never came back)",
                                          "cancelled")
                    self._close("cancelled")
                raise
        started: dict[str, Any] = {"run_id": self.run_id,
                                   "steps": [n.id for n in self.graph.nodes],
                                   "started_at": self.trace.started_at}
        if self.plan is not None and self.plan.report.warnings:  # the SDK warns its user
            started["warnings"] = self.plan.report.warnings
        if self.resumed:  # the gap the restart left, labelled on the timeline
            started["restart"] = self.trace.restarted()
        self._emit(("run.resumed" if self.resumed else "run.started", started))
        with bind_run(workflow_id=self.run_id):
            tasks = self._spawn(self.graph.nodes)
            work: asyncio.Future[Any] = self._work(tasks)
            watch: asyncio.Future[Any] = asyncio.ensure_future(
                self.clock.expired() if self.clock else work)
            try:
                await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not work.done():
                    self.deadline_missed = True
                    self._fail_unfinished(tasks, f"deadline of {self.graph.deadline_s} s "
                                          "exceeded", "deadline")
            except asyncio.CancelledError:  # (tools told first: a cancel takes their futures)
                if not self._suspending:
                    self._fail_unfinished(tasks, "run cancelled", "cancelled")
                    self._close("cancelled")
                for task in tasks:
                    task.cancel()
                raise
            finally:
                watch.cancel()
                work.cancel()  # its children's cancellation is no news: not logged as lost
                work.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._close("failed" if self.failures else "succeeded")

    # -- open runs (flowlift.proxy.workflows.open_runs) ---------------------------
    def _spawn(self, nodes: Iterable[Node]) -> list[asyncio.Task[None]]:
        """Start a task per node (in the run's own context); all of them, appended ones
        too, are in the list returned."""
        if self._tasks is None:
            self._tasks, self._context = [], contextvars.copy_context()
        assert self._context is not None
        for node in nodes:
            task = asyncio.create_task(self._node(node), context=self._context.copy())
            self._tasks.append(task)
            self._node_tasks[node.id] = task
        return self._tasks

    def _work(self, tasks: list[asyncio.Task[None]]) -> asyncio.Future[Any]:
        """Done when every node is: at once for a whole graph, after close for an open one."""
        if self.growth.closed:
            return asyncio.gather(*tasks)
        return asyncio.ensure_future(self.growth.settled(tasks))

    def append(self, nodes: Sequence[Node], plan: Plan | None,
               awaited: Sequence[str] = ()) -> None:
        """Add validated nodes to this open run (see
        :func:`flowlift.proxy.workflows.open_runs.append`): logged as ``nodes.appended``,
        started at once (inputs already finished count as ready). ``plan``: the grown
        graph's plan (None: keep the current one); ``awaited``: steps the app is
        blocked on (:meth:`mark_awaited`). Work: the new nodes and their inputs.

        Raises:
            RunClosed: the run is closed or finished.
        """
        self.growth.check_open(self.run_id, self.finished)
        if nodes:
            self.graph = self.graph.model_copy(update={"nodes": (*self.graph.nodes, *nodes)})
            self._know(nodes)
            for node in nodes:
                self._done[node.id] = asyncio.Event()
                model = node.model if isinstance(node, LLMNode) else None
                self.trace.add_step(node.id, node.kind, getattr(node, "name", ""), model)
            self.plan = plan or self.plan
            self._emit((APPENDED, {
                # (pydantic's JSON text, read back: 3x faster than a JSON-mode dump)
                "nodes": [json.loads(n.model_dump_json(by_alias=True)) for n in nodes],
                "awaited": list(awaited)}))
            if self._tasks is not None:  # else a resumed run, parked: all start together
                self._spawn(nodes)
            self.growth.changed.set()
        self.mark_awaited(awaited)

    def _know(self, nodes: Iterable[Node]) -> None:
        """Index new nodes: by id, their inputs, and who reads each output."""
        for node in nodes:
            self._nodes[node.id] = node
            self._deps[node.id] = deps = frozenset(r.ref for r in node_refs(node))
            for d in deps:
                self._readers.setdefault(d, []).append(node.id)

    def mark_awaited(self, step_ids: Iterable[str]) -> None:
        """The app is blocked on ``step_ids``: they (and what they wait for) get
        interactive continuation priority, also where they already wait for a slot."""
        promoted = self.growth.blocking(step_ids, self._deps, self._ended,
                                        functools.partial(self.warmup.warmer, self.plan))
        for step_id in promoted:
            task = self._node_tasks.get(step_id)
            if task is not None and not task.done():
                for backend in self.backends.backends:
                    backend.slots.promote(task, self._priority(step_id))

    def close_input(self) -> bool:
        """No more nodes: the run finishes once every node is done (``run.closed``).
        True when this call closed it; closing again, or a finished or whole run, is a
        no-op."""
        if self.growth.closed or self.finished:
            return False
        self.growth.closed = True
        self._emit((CLOSED, {"steps": len(self.graph.nodes)}))
        if self.plan is not None:
            self.plan = self.plan.closed()
        self.growth.changed.set()
        return True

    def _ended(self, step_id: str) -> bool:
        """The step has its outcome: an output, a failure or a skip."""
        return step_id in self.outputs or step_id in self.failures or step_id in self.skipped

    def _fail_unfinished(self, tasks: list[asyncio.Task[None]], why: str, kind: str) -> None:
        self._cancel_tools(self.waiting_tools(), why)  # before run.finished: the app hears
        for task in tasks:
            task.cancel()
        now = self.trace.now_ms()
        for node in self.graph.nodes:
            if not self._ended(node.id):
                st = self.trace.step(node.id)
                if st.ready_ms is None:
                    spent = " before its inputs were ready"
                elif st.started_ms is None:
                    spent = f": step {node.id!r} spent {now - st.ready_ms:.0f} ms queued"
                else:
                    spent = (f": step {node.id!r} spent {st.started_ms - st.ready_ms:.0f} ms "
                             f"queued and {now - st.started_ms:.0f} ms running")
                self._failed(node.id, f"{why}{spent}", kind)

    def _close(self, status: str) -> None:
        if self._suspending:  # stopped, not finished: the run goes on elsewhere or later
            return
        tiered = self.__dict__.get("_dispatcher")
        if isinstance(tiered, TieredDispatcher):
            tiered.close()
        self.trace.finish(status)
        if self.costs is not None:  # the machine's speed against this run's plan
            calibrate(self.backends, self.costs, self.plan, self.trace.steps,
                      self.graph.workflow_class)
        self.backends.sessions.end(self.key, self.backends.upstreams)  # SGLang's, if any
        self.observer.run_closed(self)  # spans and metrics; never raises
        self._emit(("run.finished", {
            "run_id": self.run_id, "status": status, "failures": self.failures,
            "trace": self.trace.records()}))

    def _failed(self, step_id: str, error: str, kind: str = "error") -> None:
        """Fail a step; its ``step.failed`` event carries the text (``error``), the
        machine-readable ``kind`` (:func:`flowlift.errors.failure_kind`) and the model
        calls it made (``attempts``, when it made any)."""
        if self._suspending:  # the shutdown's doing, not the step's: it runs again on resume
            return
        self.failures[step_id] = error
        self.trace.mark(step_id, "finished", status="failed", error=error)
        event: dict[str, Any] = {"step_id": step_id, "error": error, "kind": kind,
                                 "trace": self.trace.step(step_id).to_record()}
        attempts = len(self.trace.step(step_id).attempts)
        if attempts:
            event["attempts"] = attempts
        self._emit(("step.failed", event))
        self._done[step_id].set()

    def _skip(self, node: Node, reason: str) -> None:
        """Skip a step (:mod:`.conditions`): ``step.skipped``, its default (if any) as
        its value."""
        self.skipped[node.id] = reason
        event: dict[str, Any] = {"step_id": node.id, "reason": reason}
        default = default_of(node)
        if default is not None:
            self.outputs[node.id] = event["value"] = default.value
        self.trace.mark(node.id, "finished", status="skipped", error=reason)
        event["trace"] = self.trace.step(node.id).to_record()
        self._emit((SKIPPED, event))
        self._done[node.id].set()

    async def _inputs(self, node: Node) -> str | None:
        """Wait for ``node``'s inputs, its condition's first; why it is skipped, or None.
        A group waits for its members itself (:mod:`.groups`).

        Raises:
            UpstreamFailed: an input failed.
            PredicateFailed: its condition cannot be evaluated.
        """
        if isinstance(node, GroupNode):
            return None
        first = condition_deps(node)
        for batch in (first, self._deps[node.id] - first):
            for dep in batch:
                await self._done[dep].wait()
                if dep in self.failures:
                    raise UpstreamFailed(f"input {dep!r} failed")
            reason = (skip_for_condition if batch is first else skip_for_inputs)(
                node, self.outputs, self.skipped)
            if reason is not None:
                return reason
        return None

    async def _group(self, node: GroupNode) -> Any:
        """A first-wins or quorum group (:mod:`.groups`): the winner's value; the
        members still going are cancelled (:meth:`_cancel_members`)."""
        def result(m: str) -> tuple[bool, Any]:
            ok = m in self.outputs and m not in self.skipped
            return ok, self.outputs.get(m)

        self.trace.step(node.id).status = "pending"  # it waits for members, not a slot
        won = await resolve_group(node, self._done, result, self._cancel_members)
        self._emit((GROUP_RESOLVED, won.event(node.id)))
        return won.value

    async def _map(self, node: MapNode) -> list[Any]:
        """Dynamic fan-out (:mod:`.fanout`): grow the run by a step per item, wait for
        them, and return their outputs in order."""
        items = check_items(node, self._resolve(node.over))
        ids = item_ids(node, len(items))
        fresh = [n for n in expand(node, items) if n.id not in self._done]
        if fresh:
            await self._grow(fresh)
            self._emit((MAP_EXPANDED, {"step_id": node.id, "items": len(items),
                                       "steps": ids}))
            self._spawn(fresh)
        for step_id in ids:
            await self._done[step_id].wait()
        return gathered(node, ids, self.outputs, self.failures)

    async def _grow(self, nodes: Sequence[Node]) -> None:
        """Add nodes the run made itself (a map's items) to its graph, trace and plan
        (recompiled over the grown graph, when the run has a compiler: ``replan``);
        steps finished before a restart take back their trace records."""
        self.graph = self.graph.model_copy(update={"nodes": (*self.graph.nodes, *nodes)})
        self._know(nodes)
        ids = {n.id for n in nodes}
        for node in nodes:
            self._done[node.id] = asyncio.Event()
            model = node.model if isinstance(node, LLMNode) else None
            self.trace.add_step(node.id, node.kind, getattr(node, "name", ""), model)
        for _, name, data in self.log.history():
            record = data.get("trace")
            if name in STEP_ENDS and data.get("step_id") in ids and isinstance(record, dict):
                self.trace.step(data["step_id"]).restore(record)
        growing = self.growth.compiler  # an open run's incremental plan (open_runs)
        if growing is not None:
            async with self.growth.lock:  # (not while an append grows it)
                growing.add(nodes)
                self.plan = growing.plan(None if self.plan is None
                                         else self.plan.latest_report())
        elif self.replan is not None:
            fresh = await asyncio.to_thread(self.replan, self.graph)
            self.plan = stable_plan(self.plan, fresh)

    def _cancel_members(self, step_ids: Sequence[str], reason: str) -> None:
        """Stop group members still waiting, queued or running: each ends skipped
        (``reason``), a running engine request aborted, its generated tokens kept."""
        for step_id in step_ids:
            task = self._node_tasks.get(step_id)
            if self._ended(step_id) or task is None or task.done():
                continue
            self._cancelling[step_id] = reason
            # a @tool member out in the app, or an agent member's calls: not wanted now
            self._cancel_tools([s for s in self.waiting_tools() if s == step_id
                                or s.startswith(f"{step_id}:call_")], reason)
            task.cancel()

    def _cancel_tools(self, step_ids: Sequence[str], reason: str) -> None:
        """Stop waiting for these tool calls out in the app and tell it
        (``tool.cancelled`` ``{step_id, reason}``; issue 38, items 6 and 14)."""
        for step_id in step_ids:
            fut = self._tool_results.get(step_id)
            if fut is not None and not fut.done():
                fut.cancel()
                self._emit(("tool.cancelled", {"step_id": step_id, "reason": reason}))

    async def _node(self, node: Node) -> None:
        with bind_run(workflow_id=self.run_id, step_id=node.id):
            if self._ended(node.id):  # restored: not re-run
                self.trace.step(node.id).status = (
                    "failed" if node.id in self.failures
                    else "skipped" if node.id in self.skipped else "done")
                self._done[node.id].set()
                return
            try:
                skip = await self._inputs(node)
                if skip is not None:
                    self._skip(node, skip)
                    return
                self.trace.mark(node.id, "ready", status="queued")
                value = await self._value(node)
            except UpstreamFailed as exc:
                self._failed(node.id, f"skipped: {exc}", "skipped")
                return
            except PredicateFailed as exc:
                self._failed(node.id, str(exc))
                return
            except asyncio.CancelledError:
                reason = self._cancelling.pop(node.id, None)
                task = asyncio.current_task()
                if reason is None or task is None:  # the run's cancellation: not ours
                    raise
                task.uncancel()  # a group resolved without it
                self._skip(node, reason)
                return
            except FlowliftError as exc:
                self._failed(node.id, exc.message, failure_kind(exc))
                return
            except Exception as exc:  # one broken step must not take the run down
                log.exception("step_error")
                self._failed(node.id, f"{type(exc).__name__}: {exc}")
                return
            self.outputs[node.id] = value
            self.trace.mark(node.id, "finished", status="done")
            self._emit(("step.finished", {"step_id": node.id, "value": value,
                                          "trace": self.trace.step(node.id).to_record()}))
            self._done[node.id].set()

    async def _value(self, node: Node) -> Any:
        """Compute a ready node's output, by its kind (an identical call's: reused)."""
        same_as = self.plan.merged_into.get(node.id) if self.plan else None
        if same_as is not None:
            return await self._same_as(node.id, same_as)
        if isinstance(node, LLMNode):
            return await self._llm(node)
        if isinstance(node, ToolNode):
            return await self._tool(node)
        if isinstance(node, GroupNode):
            return await self._group(node)
        if isinstance(node, MapNode):
            return await self._map(node)
        return node.value

    async def _same_as(self, step_id: str, rep: str) -> Any:
        """An identical call (same model, prompt, params; deterministic): paid once."""
        await self._done[rep].wait()
        if rep in self.failures:
            raise UpstreamFailed(f"identical step {rep!r} failed")
        self.trace.step(step_id).same_as = rep
        return self.outputs[rep]

    def _priority(self, step_id: str, workflow_class: str | None = None) -> Priority:
        remaining = self.plan.tail_ms.get(step_id, 0.0) if self.plan else 0.0
        slack = None if self.clock is None else self.clock.left_s() * 1000.0 - remaining
        ordered = self.growth.priority(step_id, Priority.of(
            workflow_class or self.graph.workflow_class, remaining, slack))
        # the run is the program of program-level scheduling (dispatch.programs); its
        # document chain the session of working-set admission (flowlift.chains)
        chain = self.plan.chain.get(step_id) if self.plan else None
        return dataclasses.replace(ordered, program=self.key,
                                   kv_group=None if chain is None else f"{self.key}#{chain}")

    def _chain_over(self, step_id: str) -> None:
        """``step_id`` ended: when every step of its document chain has, the chain
        leaves the engines' working sets at once (it will not call again)."""
        chain = self.plan.chain.get(step_id) if self.plan else None
        if chain is None or self.plan is None or not all(
                m == step_id or self._ended(m) for m in self.plan.chain_members[chain]):
            return
        priority = self._priority(step_id)
        for backend in self.backends.backends:
            backend.slots.ended(priority)

    def _resolve(self, ref: Ref) -> Any:
        return project(self.outputs[ref.ref], ref.path)

    def _render(self, parts: tuple[Any, ...]) -> str:
        return "".join(render_value(self._resolve(p)) if isinstance(p, Ref) else p.text
                       for p in parts)

    def _messages(self, templates: tuple[MessageTemplate, ...]) -> list[ChatMessage]:
        return [ChatMessage(t.role, self._render(t.content)) for t in templates]

    async def _llm(self, node: LLMNode) -> Any:
        """Contract check, retries and cascade (:mod:`flowlift.proxy.workflows.cascade`) over
        :meth:`_attempt`, one generation each."""
        messages = self._messages(node.messages)
        self._prompted(node.id, messages)
        record = None if self.outcomes is None else self.outcomes.record
        one = functools.partial(self._attempt, node)
        attempt: Attempt = one
        if node.tools:  # an agent step: turns on the proxy (flowlift.proxy.workflows.agent)
            attempt = AgentLoop(node, turn=one, trace=self.trace,
                                continuation=lambda: self._priority(node.id, "interactive"),
                                emit=self.log.emit, history=self.log.history(),
                                waiting=self._tool_results, clock=self.clock,
                                ahead=functools.partial(self.prefills.ahead, node),
                                proxy_tools=self.proxy_tools)
        try:
            value, model = await run_step(node, messages, attempt, record)
        finally:
            self._chain_over(node.id)
        self.trace.step(node.id).model = self.backends.canonical(model)
        return value

    def _prompted(self, step_id: str, messages: list[ChatMessage]) -> None:
        """Record what the model receives (``step.prompt``: durable, exportable)."""
        self.prompts[step_id] = [{"role": m.role, "content": m.content} for m in messages]
        self._emit(("step.prompt", {"step_id": step_id, "messages": self.prompts[step_id]}))

    @functools.cached_property
    def _dispatcher(self) -> StepDispatcher:
        """The run's dispatcher: tiered (:mod:`.tiering`) when the plan defers a step
        (batch, flex or idle)."""
        tiers = planned_tiers(self.plan.report.tier_plan  # (only a deadline has one)
                              if self.plan and self.graph.deadline_s else None)
        if not {"batch", "flex", "idle"} & set(tiers.values()):
            return StepDispatcher(self.backends)
        return TieredDispatcher(self.backends, run_id=self.run_id, tiers=tiers,
                                slack_s=self._slack_s, emit=self.log.emit,
                                history=self.log.history())

    def _slack_s(self, step_id: str) -> float | None:
        """Seconds ``step_id`` could still wait before its fast-tier path misses the
        deadline (None: no deadline)."""
        if self.clock is None:
            return None
        remaining_ms = self.plan.tail_ms.get(step_id, 0.0) if self.plan else 0.0
        return self.clock.left_s() - remaining_ms / 1000.0

    async def _attempt(self, node: LLMNode, want: str | None,
                       messages: Sequence[ChatMessage], *, logprobs: bool,
                       priority: Priority | None = None,
                       max_tokens: int | None = None,
                       on_call: Callable[[ToolCall], None] | None = None,
                       tools: bool = True) -> Generated:
        """One generation of ``node`` on model ``want``, where its route sends it
        (:class:`~flowlift.proxy.dispatch.steps.StepDispatcher`), at ``priority`` (default:
        the step's own); every try (an agent step's turn) is an :class:`AttemptTrace` in
        the step's ``attempts``; ``on_call`` gets each tool call complete before the
        answer ends (``GenerationChunk.ready_calls``)."""
        model, backend = self.backends.resolve(want)
        st = self.trace.step(node.id)
        st.model = model
        number = len(st.attempts) + 1
        if number == 1:
            await self.warmup.wait(self.plan, node.id)
        priority = priority or self._priority(node.id)
        request = self._request(node, model, messages, number, logprobs=logprobs,
                                priority=priority, max_tokens=max_tokens)
        if not tools:  # an agent step's last turn: asked for the answer
            request = dataclasses.replace(request, tools=())
        books = AttemptBooks(self.trace, node.id, number, want or model)
        tokens = int(self.plan.uncached_tokens.get(node.id, 0)) if self.plan else 0
        busy = [0, 0]  # this machine's engine requests in flight, summed over chunks; chunks
        local = [b.slots for b in self.backends.backends if b.engine in self.backends.engines]
        if backend.engine not in self.backends.engines:
            local = [backend.slots]  # an upstream: its own
        try:
            async with contextlib.aclosing(self._dispatcher.generate(
                    request, priority=priority, prefill_tokens=tokens,
                    started=books.started)) as chunks:
                async for chunk in chunks:
                    busy[0] += sum(slots.in_use for slots in local)
                    busy[1] += 1
                    if books.chunk(chunk):
                        self.warmup.warmed(self.plan, node.id)
                    if on_call is not None:
                        for call in chunk.ready_calls or ():
                            on_call(call)
        except BaseException as exc:
            books.failed(exc)
            raise
        finally:
            self.warmup.warmed(self.plan, node.id)
        attempt = books.finished()
        self._observe(model, attempt, busy[0] / busy[1] if busy[1] else 1.0)
        sent(self.backends, model, messages)  # in its engine's prefix cache now
        return Generated(books.text, attempt, books.logprobs, books.tool_calls)

    def _request(self, node: LLMNode, model: str, messages: Sequence[ChatMessage],
                 number: int, *, logprobs: bool, priority: Priority,
                 max_tokens: int | None = None) -> GenerationRequest:
        """The engine request of try ``number`` of ``node`` (:class:`StepRequests`), with
        the tier and output length this run's plan gives it."""
        return self.requests.build(
            node, model, messages, number, logprobs=logprobs, priority=priority,
            max_tokens=max_tokens,
            service_tier=(self._dispatcher.tier_of(node.id, number)
                          if isinstance(self._dispatcher, TieredDispatcher) else None),
            expected_output_tokens=self._expected_output_tokens(node.id))

    def _expected_output_tokens(self, step_id: str) -> int | None:
        """The plan's output length of ``step_id`` (its learned median, contract bound or
        ``max_tokens``), for the engines' hints; None without a plan."""
        tokens = None if self.plan is None else self.plan.output_tokens.get(step_id)
        return None if tokens is None else round(tokens)

    def _observe(self, model: str, at: AttemptTrace, decoding: float) -> None:
        """A finished try into the cost models (``decoding``: requests the engines of its
        machine had in flight while it streamed, on average: the TPOT line in
        concurrency, as :mod:`flowlift.simulate` plans engines that share a machine)."""
        if self.costs is None or at.first_token_ms is None or at.finished_ms is None:
            return
        self.costs.observe(model, prompt_tokens=at.prompt_tokens,
                           cached_tokens=at.cached_tokens,
                           completion_tokens=at.completion_tokens,
                           prefill_ms=at.first_token_ms - at.started_ms,
                           decode_ms=at.finished_ms - at.first_token_ms,
                           decoding=max(decoding, 1.0))

    async def _tool(self, node: ToolNode) -> Any:
        def arg(a: Any) -> Any:
            if isinstance(a, Ref):
                return self._resolve(a)
            if isinstance(a, Template):
                return self._render(a.template)
            if isinstance(a, Items):  # items skipped without a default are left out
                return [arg(i) for i in kept_items(a.items, self.outputs, self.skipped)]
            return a.value

        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._tool_results[node.id] = fut
        self.trace.mark(node.id, "ready", status="waiting_tool")
        self._emit(("tool.wanted", {
            "step_id": node.id, "name": node.name, "args": [arg(a) for a in node.args],
            "kwargs": {k: arg(v) for k, v in node.kwargs.items()}}))
        self.prefills.after_tool((self._nodes[r] for r in self._readers.get(node.id, ())),
                                 self._nodes, self.plan, self.outputs, self._ended)
        if (late := await await_app(fut, node, self.graph.deadline_s, self.clock)) is None:
            return fut.result()
        self._late[node.id] = late.reason
        self._cancel_tools([node.id], late.reason)
        raise late
