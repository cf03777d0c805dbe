"""Open runs: workflow runs that grow while they run.

A graph posted with ``"open": true`` is what the app has recorded so far, not the whole
workflow. Its steps run at once; the app reads a value (``await var`` / ``var.get()``),
branches in plain Python, and appends the steps it records next to the same run (Parrot,
OSDI'24: calls are submitted as made, a read blocks only on the value it needs):

* ``POST /v1/workflows/{run_id}/nodes`` ``{"nodes": [...], "awaited": [...]}`` -- new
  nodes, validated with everything the run already holds (duplicate ids, dangling
  references, cycles, unknown models: HTTP 400 listing every problem, nothing running
  disturbed); a node identical to one the run holds is a re-sent flush and is skipped.
  ``awaited`` names the steps the app is blocked on.
* ``POST /v1/workflows/{run_id}/close`` -- no more nodes; the run finishes once every
  node is done. Appending to a closed or finished run: :class:`RunClosed` (HTTP 409).

An append costs what it adds: the run keeps the compiler's state
(:class:`~flowlift.incremental.GrowingPlan`) and grows it by the new nodes alone --
validation, identical calls, prefix groups, costs and remaining critical paths; the
whole report is compiled when read. ``--append-recompile`` keeps the earlier whole-graph
recompile per append (a benchmark baseline).

Events in the run's log (durable like the rest): ``nodes.appended`` ``{nodes, awaited}``
(the new wire nodes only) and ``run.closed``. A restarted proxy rebuilds the graph from
the stored one plus the appended nodes (:func:`stored_graph`) and compiles it once.

Scheduling: a step the app awaits, with every unfinished step it depends on and the
step warming its prefix group, is on the critical path now: it gets interactive
continuation priority (:func:`awaited_priority`), also when it already waits in a
backend's queue (:meth:`PrioritySlots.promote`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Collection, Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from flowlift.compiler import CompileOptions, Plan, compile_graph
from flowlift.dataflow import validate
from flowlift.errors import GraphError, RequestError, RunClosed
from flowlift.graph import Graph, Node
from flowlift.incremental import GrowingPlan
from flowlift.proxy.dispatch.slots.scheduler import CLASS_RANK, Priority
from flowlift.proxy.store.base import StoredRun
from flowlift.proxy.store.events import Event

if TYPE_CHECKING:
    from flowlift.proxy.workflows.runs import Run

APPENDED = "nodes.appended"
CLOSED = "run.closed"
AWAITED_BOOST_MS = 1e9
"""Added to an awaited step's remaining critical path: longer than any real one, so it
sorts before every step nobody waits for (its engine priority saturates at the top)."""


class AppendRequest(BaseModel):
    """Body of ``POST /v1/workflows/{run_id}/nodes``."""

    model_config = ConfigDict(extra="forbid")
    nodes: tuple[Node, ...] = ()
    awaited: tuple[str, ...] = ()


def awaited_priority(base: Priority) -> Priority:
    """``base`` raised to an interactive continuation ahead of the run's other steps."""
    return Priority(CLASS_RANK["interactive"], base.neg_remaining_ms - AWAITED_BOOST_MS,
                    base.slack_ms)


def grown(graph: Graph, nodes: Iterable[Node]) -> Graph:
    """``graph`` with ``nodes`` appended (not validated: see :func:`check_append`)."""
    return graph.model_copy(update={"nodes": (*graph.nodes, *nodes)})


def stored_graph(stored: StoredRun) -> Graph:
    """A stored run's graph as it had grown: the posted graph plus every appended node.

    Raises:
        pydantic.ValidationError: the stored documents do not parse (a corrupt store).
    """
    appended = [n for _, name, data in stored.events if name == APPENDED
                for n in data.get("nodes", ())]
    return Graph.model_validate({**stored.graph, "nodes": [*stored.graph["nodes"], *appended]})


def awaited_ids(held: Container[str], raw: Any) -> tuple[str, ...]:
    """Check an ``awaited`` list against the ids of the steps the run holds.

    Raises:
        RequestError: not a list of strings, or it names a step the run does not hold.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or not all(isinstance(s, str) for s in raw):
        raise RequestError("`awaited` must be a list of step ids", param="awaited")
    unknown = [s for s in raw if s not in held]
    if unknown:
        raise RequestError(f"`awaited` names steps the run does not hold: {unknown}",
                           param="awaited")
    return tuple(raw)


def check_append(graph: Graph, nodes: tuple[Node, ...],
                 models: Collection[str] | None) -> tuple[tuple[Node, ...], Graph]:
    """The nodes really new (identical re-sends dropped) and the grown graph, validated
    whole.

    Raises:
        GraphError: every problem of the grown graph (duplicate ids, dangling
            references, cycles, unknown models, bad contracts).
    """
    held = graph.node_map()
    fresh = tuple(n for n in nodes if held.get(n.id) != n)
    bigger = grown(graph, fresh)
    validate(bigger, models)
    return fresh, bigger


def stable_plan(old: Plan | None, new: Plan) -> Plan:
    """``new`` with its prefix groups numbered as in ``old`` where they share members, so
    steps already waiting for their group's first prefill keep waiting on the same one."""
    if old is None or not new.prefix_group:
        return new
    fresh = iter(range(max([*old.prefix_group.values(), -1]) + 1, 1 << 62))
    renumber: dict[int, int] = {}
    taken: set[int] = set()
    for step_id, group in sorted(new.prefix_group.items(), key=lambda kv: kv[1]):
        if group in renumber:
            continue
        was = old.prefix_group.get(step_id)
        if was is not None and was not in taken:
            renumber[group] = was
            taken.add(was)
    for group in sorted(set(new.prefix_group.values()) - set(renumber)):
        renumber[group] = next(fresh)
    return dataclasses.replace(
        new, prefix_group={s: renumber[g] for s, g in new.prefix_group.items()},
        group_leader={renumber[g]: s for g, s in new.group_leader.items()})


class Growth:
    """The open-run state of one :class:`~flowlift.proxy.workflows.runs.Run`.

    Args:
        open_: the run's graph was posted open.
        history: the run's stored events (a resumed run: closed? awaited steps?).

    Attributes:
        closed: no more nodes will come (always true for a graph posted whole).
        awaited: steps the app is (or was) blocked on, with what they wait for.
        changed: set when nodes are appended or the run is closed.
        lock: held while an append is validated and compiled (one at a time).
        compiler: the incremental compiler state of the grown graph, made at the first
            append (:class:`~flowlift.incremental.GrowingPlan`).
    """

    def __init__(self, open_: bool, history: Iterable[Event] = ()) -> None:
        self.open = open_
        self.closed = not open_
        self.awaited: set[str] = set()
        for _, name, data in history:
            if name == CLOSED:
                self.closed = True
            elif name == APPENDED:
                self.awaited.update(data.get("awaited", ()))
        self.changed = asyncio.Event()
        self.lock = asyncio.Lock()
        self.compiler: GrowingPlan | None = None

    def priority(self, step_id: str, base: Priority) -> Priority:
        return awaited_priority(base) if step_id in self.awaited else base

    def blocking(self, step_ids: Iterable[str], deps: Mapping[str, Collection[str]],
                 finished: Callable[[str], bool],
                 warmer: Callable[[str], str | None]) -> list[str]:
        """Mark ``step_ids`` awaited, with every unfinished step they wait for (inputs,
        transitively, and the step warming their prefix group); returns those newly
        marked."""
        new: list[str] = []
        stack = list(step_ids)
        while stack:
            sid = stack.pop()
            if sid in self.awaited or finished(sid) or sid not in deps:
                continue
            self.awaited.add(sid)
            new.append(sid)
            stack.extend(deps[sid])
            lead = warmer(sid)
            if lead is not None and lead != sid:
                stack.append(lead)
        return new

    def check_open(self, run_id: str, finished: bool) -> None:
        """Raises RunClosed unless the run still takes nodes."""
        if finished or self.closed:
            why = ("was submitted whole (post it with \"open\": true to append steps)"
                   if not self.open else "has finished" if finished
                   else "is closed (its block ended)")
            raise RunClosed(f"run {run_id} takes no more steps: it {why}", param="run_id")

    async def settled(self, tasks: list[asyncio.Task[None]]) -> None:
        """Wait until the run is closed and every node task (``tasks`` grows as nodes
        are appended) is done; each wake-up waits only for the tasks appended since."""
        waited = 0
        while True:
            self.changed.clear()
            while waited < len(tasks):
                start, waited = waited, len(tasks)
                await asyncio.gather(*tasks[start:waited])
            if self.closed:
                return
            if not self.changed.is_set():
                await self.changed.wait()


async def append(run: Run, data: Any, models: Collection[str] | None,
                 options: CompileOptions, *, recompile: bool = False) -> dict[str, Any]:
    """Handle ``POST /v1/workflows/{run_id}/nodes`` for ``run``.

    The run's compiler state grows by the new nodes alone
    (:class:`~flowlift.incremental.GrowingPlan`: work bounded by what they touch; the
    state is made at the first append, in a worker thread); the report is compiled
    whole only when read.

    Args:
        data: the request's JSON body (:class:`AppendRequest`).
        models: model names served (for validation).
        options: this proxy's compile options
            (:func:`flowlift.proxy.workflows.planning.compile_options`).
        recompile: validate and compile the whole grown graph instead (in a worker
            thread), as before issue 24: a baseline for ``bench/append_cost.py``.

    Returns:
        ``{"run_id", "appended": [ids], "steps": total}``.

    Raises:
        GraphError: the body or the grown graph is invalid (every problem listed).
        RequestError: ``awaited`` names unknown steps.
        RunClosed: the run is closed or finished.
    """
    body = parse_append(data)
    async with run.growth.lock:
        run.growth.check_open(run.run_id, run.finished)
        if recompile:
            fresh, plan = await _recompiled(run, body, models, options)
        else:
            state = run.growth.compiler
            if state is None:
                state = run.growth.compiler = await asyncio.to_thread(
                    GrowingPlan, run.graph, options,
                    lambda s: s in run.outputs or s in run.failures)
            run.growth.check_open(run.run_id, run.finished)  # it may have ended meanwhile
            fresh = tuple(n for n in body.nodes if state.nodes.get(n.id) != n)
            state.check(fresh, models)
            awaited_ids(_Held(state.nodes, fresh), list(body.awaited))
            plan = None
            if fresh:
                state.add(fresh)
                plan = state.plan(None if run.plan is None else run.plan.latest_report())
        run.append(fresh, plan, body.awaited)
    return {"run_id": run.run_id, "appended": [n.id for n in fresh],
            "steps": len(run.graph.nodes)}


class _Held(Container[str]):
    """The ids of held nodes and of those an append brings (no copy of either)."""

    def __init__(self, held: Container[str], fresh: Iterable[Node]) -> None:
        self.held, self.fresh = held, {n.id for n in fresh}

    def __contains__(self, step_id: object) -> bool:
        return step_id in self.fresh or step_id in self.held


async def _recompiled(run: Run, body: AppendRequest, models: Collection[str] | None,
                      options: CompileOptions) -> tuple[tuple[Node, ...], Plan | None]:
    """An append validated and compiled with the whole grown graph (the baseline)."""
    fresh, bigger = check_append(run.graph, body.nodes, models)
    awaited_ids(bigger.node_map(), list(body.awaited))
    new_plan = await asyncio.to_thread(compile_graph, bigger, options) if fresh else None
    run.growth.check_open(run.run_id, run.finished)  # it may have ended meanwhile
    return fresh, None if new_plan is None else stable_plan(run.plan, new_plan)


def parse_append(data: Any) -> AppendRequest:
    """The body of ``POST .../nodes``, parsed.

    Raises:
        GraphError: every problem of the body.
    """
    try:
        return AppendRequest.model_validate(data)
    except ValidationError as exc:
        raise GraphError([f"{'.'.join(map(str, e['loc'])) or '(body)'}: {e['msg']}"
                          for e in exc.errors(include_url=False)]) from None


def check_queued(graph: Graph, queued: Iterable[Any], data: Any,
                 models: Collection[str] | None) -> tuple[list[str], int]:
    """Validate an append for a run another proxy executes (a shared store), against
    ``graph`` (the stored run's, :func:`stored_graph`) grown by the appends still
    ``queued`` for its owner (their bodies, in order); nothing is changed.

    Returns:
        The ids of the nodes it adds, and how many steps the run then holds.

    Raises:
        GraphError: the body or the grown graph is invalid (every problem listed).
        RequestError: ``awaited`` names unknown steps.
    """
    for earlier in queued:
        held = graph.node_map()
        graph = grown(graph, (n for n in parse_append(earlier).nodes if n.id not in held))
    body = parse_append(data)
    fresh, bigger = check_append(graph, body.nodes, models)
    awaited_ids(bigger.node_map(), list(body.awaited))
    return [n.id for n in fresh], len(bigger.nodes)
