"""Runs known to this proxy: the active ones, recently finished ones, and the store.

* ``start`` creates a run (persisted before it starts) and starts it. Run ids are per
  tenant: ``active``, ``finished`` and the store are keyed by
  :func:`~flowlift.proxy.tenants.run_key` (the same client id in two tenants is two runs;
  another tenant's id answers what an unknown id answers), every answer shows the
  client's id.
* ``resume_all`` restarts every run the store holds as unfinished (after a crash or a
  restart): finished steps keep their outputs and are not run again. A resumed run is
  parked until its client reconnects, so orphans never take engine capacity (a
  ``detached`` graph's run is not: it runs on without its client).
* ``heartbeat`` (shared stores: several proxies on one database) renews the leases of
  the runs this proxy executes, stops those another proxy took over, and takes over the
  runs whose proxy stopped renewing (see :mod:`flowlift.proxy.store.postgres`).
* Every event a run writes carries its lease's epoch (fencing): once another proxy has
  taken the run over the store refuses the write (:class:`~flowlift.errors.LeaseLost`)
  and the run stops here at once, before any client sees the event.
* ``post_tool_result`` takes a ``@tool`` result for any run in the store, executed here
  or by another proxy: it is kept in the store first, and ``deliver_posted`` hands kept
  results to the runs here that wait for them (so a result posted to any replica lands
  once, with the run's owner or whoever takes the run over).
* ``tail`` streams a run another proxy executes, from the store; the follow is marked
  in the store so that its owner counts it as a listener (``heartbeat``).
* ``sweep`` cancels runs that nobody has listened to for ``detached_timeout_s`` (their
  client went away and did not come back), so orphans do not wait forever; an open run
  whose app vanished before closing it goes the same way. A ``detached`` graph's run is
  never swept: it is meant to outlive its client.
* Every store call goes through :attr:`RunRegistry.io`, one worker thread in the order
  the calls were made (:mod:`~flowlift.proxy.store.worker`): a slow database
  delays the runs that wait on it, never the event loop and the other requests. Hence
  the methods that read or write the store are coroutines.
* Waiting on another proxy (a tail's next event, results and requests posted for the
  runs here, a released run to take over) goes through :attr:`RunRegistry.wakeups`
  (:mod:`~flowlift.proxy.store.wakeups`): woken by the store's ``NOTIFY`` on
  PostgreSQL, polled every :data:`TAIL_POLL_S` without it (SQLite, or the channel down).
* A store that fails (a restarted, exhausted or unreachable database) is waited out:
  its calls retry inside the store, runs keep their events queued in order and go on
  once it answers (no step runs twice), while :meth:`RunRegistry.unavailable` refuses
  new runs (503, ``Retry-After``) and calls that answer a client wait at most
  :data:`ANSWER_WITHIN_S`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import re
import secrets
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Collection
from pathlib import Path
from typing import Any

from cachetools import TTLCache
from opentelemetry.context import Context

from flowlift.compiler import CompileOptions, Plan
from flowlift.costs import CostTracker
from flowlift.errors import (
    FlowliftError,
    LeaseLost,
    Overloaded,
    RequestError,
    RunClosed,
    RunNotFound,
    StoreUnavailable,
)
from flowlift.graph import Graph, LLMNode, ToolNode
from flowlift.local_engine.residency import Lookahead, lookahead
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.store.base import RunStoreProtocol, RunSummary, StoredRun
from flowlift.proxy.store.events import FINAL, Event
from flowlift.proxy.store.outcomes import StepOutcomes
from flowlift.proxy.store.sqlite import SQLiteRunStore
from flowlift.proxy.store.wakeups import Wakeups
from flowlift.proxy.store.worker import StoreWorker
from flowlift.proxy.tenants import RunKey, client_run_id, run_key, visible
from flowlift.proxy.workflows import open_runs
from flowlift.proxy.workflows.agent import ProxyTools
from flowlift.proxy.workflows.leases import Leases
from flowlift.proxy.workflows.observer import NO_OBSERVER, RunObserver
from flowlift.proxy.workflows.open_runs import CLOSED, stored_graph
from flowlift.proxy.workflows.planning import plan
from flowlift.proxy.workflows.runs import Run
from flowlift.tracing import get_logger

log = get_logger("flowlift.runs")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""A client-chosen run id: no path separators or leading dot, since ``<id>.jsonl`` is the
run's trace file under ``trace_dir`` (``../x`` or ``/tmp/x`` would write outside it)."""
TAIL_POLL_S = 0.2
"""How often :meth:`RunRegistry.tail` reads a run another proxy executes from the store
when nothing announces its events (SQLite, or the store's channel down)."""
ANSWER_WITHIN_S = 3.0
"""How long a request that a client waits on waits for the store before it answers 503
(:class:`~flowlift.errors.StoreUnavailable`)."""


def _exists(run_id: str) -> RequestError:
    return RequestError(f"a run with id {run_id!r} exists; omit `id` to get a fresh one",
                        param="id")


def _not_waiting(run_id: str, step_id: str, why: str = "") -> RequestError:
    return RequestError(f"step {step_id!r} of run {run_id} is not waiting for a tool result"
                        f"{why}", param="step_id")


def _check_tool_step(graph: Graph, run_id: str, step_id: str) -> None:
    """Refuse a result for ``step_id`` unless it names a ``@tool`` step of ``graph`` or a
    call of one of its agent steps (``<step id>:call_<n>``).

    Raises:
        RequestError: no such step (``param: step_id``), or not one that takes a result.
    """
    nodes = {n.id: n for n in graph.nodes}
    agent, sep, _ = step_id.rpartition(":call_")
    node = nodes.get(agent) if sep else nodes.get(step_id)
    if node is None:
        raise _not_waiting(run_id, step_id, ": no such step")
    if not (isinstance(node, ToolNode) if not sep
            else isinstance(node, LLMNode) and bool(node.tools)):
        raise _not_waiting(run_id, step_id, f": it is a {node.kind} step, not a @tool step")


def log_end(run: Run) -> None:
    """One log line as a run ends: ``run_finished`` (succeeded or cancelled),
    ``run_failed`` (naming its failed steps) or ``run_deadline_missed``."""
    event = ("run_deadline_missed" if run.deadline_missed
             else "run_failed" if run.trace.status == "failed" else "run_finished")
    wall_s = None if run.trace.finished_ms is None else round(run.trace.finished_ms / 1000, 3)
    fields: dict[str, Any] = {"workflow_id": run.run_id, "name": run.graph.name,
                              "status": run.trace.status,
                              "wall_s": wall_s, "steps": len(run.graph.nodes),
                              "failed": len(run.failures)}
    if run.failures:
        fields["failed_steps"] = sorted(run.failures)[:10]
    if run.trace.status == "failed" or run.deadline_missed:
        log.warning(event, **fields)
    else:
        log.info(event, **fields)


def learn_lengths(run: Run, outcomes: StepOutcomes) -> None:
    """Record the output length of each llm step the run delivered (its accepted, last
    attempt; steps reusing an identical call's output add nothing), and each agent step's
    turns, for the compiler's next estimates of the same (step name, model)."""
    nodes = run.graph.node_map()
    for st in run.trace.steps.values():
        if st.kind != "llm" or st.status != "done" or not st.attempts or st.same_as:
            continue
        last = st.attempts[-1]
        outcomes.record_output(st.name or st.step_id, last.model, last.completion_tokens)
        node = nodes.get(st.step_id)
        if isinstance(node, LLMNode) and node.tools:  # an agent: each turn an attempt
            outcomes.record_turns(st.name or st.step_id, last.model, len(st.attempts))


class RunRegistry:
    """Active runs, plus finished ones for ``ttl_s`` (bounded, so unique ids never grow it).

    The store keeps finished runs (their events replay after a restart) for
    ``store_ttl_s`` and at most the ``store_keep`` most recent; each :meth:`sweep`
    forgets the rest, so the store is bounded too (disk, or memory for ``:memory:``).
    """

    def __init__(self, store: RunStoreProtocol | None = None, trace_dir: Path | None = None,
                 keep: int = 1024, ttl_s: float = 3600.0,
                 detached_timeout_s: float = 300.0,
                 outcomes: StepOutcomes | None = None, store_keep: int = 10_000,
                 store_ttl_s: float = 7 * 24 * 3600, max_active: int = 4096,
                 observer: RunObserver = NO_OBSERVER, lease_ttl_s: float = 15.0,
                 proxy_tools: ProxyTools | None = None,
                 wakeups: Wakeups | None = None) -> None:
        self.store = store or SQLiteRunStore(":memory:")
        self.io = StoreWorker()  # every store call, in order, off the event loop
        self.wakeups = wakeups or self.store.listener()  # (started with the app)
        self._starting: set[str] = set()  # keys being created (their ids are taken)
        self.leases = Leases(self.store, lease_ttl_s)  # this proxy's, on its runs
        self.outcomes = outcomes or StepOutcomes(":memory:")
        self.active: dict[str, Run] = {}  # run key (tenants.run_key) -> run
        self.tailed: Counter[str] = Counter()  # run key -> clients tailing it from here
        self.finished: TTLCache[str, Run] = TTLCache(maxsize=keep, ttl=ttl_s)
        self.trace_dir = trace_dir
        self.detached_timeout_s = detached_timeout_s
        self.observer = observer
        self.proxy_tools = proxy_tools  # the [tools.*] servers every run's agent steps use
        self.store_keep, self.store_ttl_s = store_keep, store_ttl_s
        self.max_active = max_active
        self.store.prune(older_than_s=store_ttl_s, keep=store_keep)

    @property
    def owner(self) -> str:
        """This proxy's name in the store's leases (:attr:`Leases.owner`)."""
        return self.leases.owner

    @property
    def lease_ttl_s(self) -> float:
        """Seconds a run's lease lasts unrenewed (:attr:`Leases.ttl_s`)."""
        return self.leases.ttl_s

    def live(self, run_id: str, tenant: str | None = None) -> Run | None:
        """The active or recently finished run ``run_id`` when ``tenant`` may see it
        (:func:`~flowlift.proxy.tenants.visible`), else None."""
        key = run_key(tenant, run_id)
        run = self.active.get(key) or self.finished.get(key)
        return run if run is not None and visible(run.tenant, tenant) else None

    def get(self, run_id: str, tenant: str | None = None) -> Run:
        """The active or recently finished run ``run_id``, as ``tenant`` may see it.

        Raises:
            RunNotFound: no such run in memory, or another tenant's (HTTP 404, the same
                answer for both).
        """
        run = self.live(run_id, tenant)
        if run is None:
            raise RunNotFound(run_id)
        return run

    def unavailable(self) -> str | None:
        """Why the store cannot take new work now (far behind, a call stalled, its
        database failing), or None."""
        trouble = self.store.trouble
        return self.io.behind() or (None if trouble is None else
                                    f"the run store {self.store.path} is unavailable "
                                    f"({trouble}); retry shortly")

    async def stored(self, run_id: str, tenant: str | None = None,
                     within_s: float | None = None) -> StoredRun:
        """The run ``run_id`` as the store holds it, as ``tenant`` may see it
        (``within_s``: see :meth:`StoreWorker.call`).

        Raises:
            RunNotFound: the store has no such run, or it is another tenant's (HTTP 404).
            StoreUnavailable: not read within ``within_s`` (HTTP 503).
        """
        stored = await self.io.call(self.store.load, run_key(tenant, run_id),
                                    within_s=within_s)
        if stored is None or not visible(stored.tenant, tenant):
            raise RunNotFound(run_id)
        return stored

    async def recent(self, *, tenant: str | None = None, after: str | None = None,
                     **filters: Any) -> tuple[list[RunSummary], bool]:
        """:meth:`RunStoreProtocol.recent` as ``tenant`` sees it: ``after`` and the runs'
        ids are its clients' ids (:func:`~flowlift.proxy.tenants.client_run_id`)."""
        runs, more = await self.io.call(functools.partial(
            self.store.recent, tenant=tenant,
            after=None if after is None else run_key(tenant, after), **filters),
            within_s=ANSWER_WITHIN_S)
        return [dataclasses.replace(r, run_id=client_run_id(r.run_id, tenant))
                for r in runs], more

    def active_of(self, tenant: str) -> int:
        """How many active runs ``tenant`` has."""
        return sum(1 for run in self.active.values() if run.tenant == tenant)

    async def start(self, graph: Graph, backends: Backends, costs: CostTracker,
                    run_plan: Plan, *, parent: Context | None = None,
                    tenant: str | None = None, tenant_max_active: int | None = None) -> Run:
        """Create, persist and start a run of a validated, compiled graph (``parent``:
        the caller's OpenTelemetry context, from its ``traceparent``; ``tenant``: whose
        run it is, who may have ``tenant_max_active`` runs active at once).

        Raises:
            RequestError: the graph's ``id`` names a run that exists, or is not a safe
                name (:data:`_RUN_ID`: it becomes a file name under ``trace_dir``).
            Overloaded: ``max_active`` runs are running already, or ``tenant_max_active``
                of the tenant's (429, ``Retry-After``).
            StoreUnavailable: the store is far behind, stalled or failing
                (:meth:`unavailable`), or did not create the run within
                :data:`ANSWER_WITHIN_S` (503, ``Retry-After``).
        """
        if graph.id is not None and not _RUN_ID.fullmatch(graph.id):
            raise RequestError(f"run id {graph.id[:80]!r} must be 1-128 letters, digits, "
                               "'.', '_', ':' or '-', starting with a letter or digit (it "
                               "names the run's URL and trace file)", param="id")
        if len(self.active) >= self.max_active:
            raise Overloaded(f"{len(self.active)} workflow runs are active, the most this "
                             "proxy takes (--max-runs); retry shortly", retry_after_s=1.0,
                             status=429)
        if (tenant is not None and tenant_max_active is not None
                and self.active_of(tenant) >= tenant_max_active):
            raise Overloaded(f"tenant {tenant!r} has {tenant_max_active} workflow runs "
                             "active, its max_active_runs; retry when one finishes",
                             retry_after_s=1.0, status=429)
        why = self.unavailable()
        if why is not None:
            raise StoreUnavailable(why, retry_after_s=1.0)
        run_id = graph.id or f"wf-{secrets.token_hex(8)}"
        key = run_key(tenant, run_id)  # (ids are per tenant: another's is not looked at)
        if key in self.active or key in self._starting:
            raise _exists(run_id)
        self._starting.add(key)
        try:
            # (a create that lands after the 503 leaves a run nobody follows: this
            # proxy's heartbeat resumes it parked and the sweep cancels it)
            epoch = await self.io.call(self._create, key, graph.to_wire(), tenant,
                                       graph.id is not None, within_s=ANSWER_WITHIN_S)
        finally:
            self._starting.discard(key)
        run = Run(graph, backends, run_plan, costs, run_id=run_id, key=key,
                  sink=self._append, outcomes=self.outcomes, observer=self.observer,
                  trace_parent=parent, proxy_tools=self.proxy_tools, tenant=tenant,
                  replan=self._replan(backends, costs))
        if epoch is not None:  # (None: a stranger's lease on a fresh id; its writes fail)
            self.leases.epochs[key] = epoch
        self._activate(run)
        return run

    def _replan(self, backends: Backends, costs: CostTracker) -> Callable[[Graph], Plan]:
        """The compiler a run plans its grown graph with (a map's items)."""
        return functools.partial(plan, backends=backends, costs=costs, outcomes=self.outcomes)

    def _create(self, key: str, wire: dict[str, Any], tenant: str | None,
                chosen: bool) -> int | None:
        """On the store's worker: create the run ``key`` and claim it (its lease epoch).

        Raises:
            RequestError: ``chosen`` (a client's id) and the store holds the run.
        """
        if chosen and self.store.exists(key):
            raise _exists(client_run_id(key, tenant))
        return self.leases.create(key, wire, tenant)

    async def resume_all(self, backends: Backends, costs: CostTracker) -> list[Run]:
        """Restart every unfinished run in the store that no other live proxy holds (an
        open run with the nodes appended to it, still open unless it was closed)."""
        resumed = []
        for epoch, stored in await self.io.call(self.leases.claim_orphans, set(self.active)):
            run_id = stored.run_id
            if run_id in self.active:  # (started here meanwhile)
                continue
            self.leases.epochs[run_id] = epoch
            graph = stored_graph(stored)
            run = Run(graph, backends, plan(graph, backends, costs, self.outcomes), costs,
                      run_id=client_run_id(run_id, stored.tenant), key=RunKey(run_id),
                      sink=self._append, restored=stored, outcomes=self.outcomes,
                      observer=self.observer, proxy_tools=self.proxy_tools,
                      replan=self._replan(backends, costs))
            self._activate(run)
            resumed.append(run)
            self.wakeups.notify("posted", run_id)  # results kept for it meanwhile
            self.wakeups.notify("event", run_id)  # tails here follow its own log now
            log.info("run_resumed", workflow_id=run.run_id, done=len(run.outputs),
                     steps=len(graph.nodes))
        return resumed

    async def heartbeat(self, backends: Backends, costs: CostTracker) -> list[Run]:
        """Renew this proxy's leases (shared stores), suspend the runs another proxy took
        over (their lease expired unrenewed), and take over the runs whose lease expired.

        Returns:
            The runs taken over (parked until their client reconnects, as at start).
        """
        asked = list(self.active)
        held = await self.io.call(self.leases.renew, asked)
        for run_id in asked:
            run = self.active.get(run_id)
            if run is not None and run_id not in held and not run.finished:
                self._lost(run_id)
        self.io.submit(self.store.mark_followed, list(self.tailed))
        quiet = [rid for rid, run in self.active.items() if not run.log.listeners]
        for run_id in await self.io.call(self.store.followed, quiet, self.lease_ttl_s):
            followed = self.active.get(run_id)  # a client follows it through another proxy
            if followed is not None:
                followed.log.listened.set()  # (a parked run starts)
                followed.detached_since = None  # (the sweep leaves it alone)
        return await self.resume_all(backends, costs)

    def _append(self, run_id: str, seq: int, name: str,
                data: dict[str, Any]) -> asyncio.Future[None]:
        """The runs' event sink: the store's append on the store's worker, fenced by this
        proxy's lease epoch (followers get the event once it landed: see EventLog).

        Returns:
            The write's future; when it fails (:class:`LeaseLost`: another proxy holds the
            run now; or the database failed) the run stops here, resumable from the log.
        """
        # (no epoch known: 0, which no lease has; the write is refused: fail closed)
        written = self.io.later(functools.partial(
            self.store.append, run_id, seq, name, data, epoch=self.leases.epoch(run_id)))
        written.add_done_callback(functools.partial(self._written, run_id, seq))
        return written

    def _written(self, run_id: str, seq: int, written: asyncio.Future[None]) -> None:
        if written.cancelled() or (error := written.exception()) is None:
            return
        if not isinstance(error, LeaseLost):
            log.error("run_event_not_stored", workflow_id=run_id, seq=seq, error=str(error))
        self._lost(run_id)

    def _lost(self, run_id: str) -> None:
        """Another proxy took ``run_id`` over (or the store refused its event): stop it
        here without another event and end its followers' streams (they reconnect and
        follow it where it runs now, or once this proxy resumes it)."""
        self.leases.epochs.pop(run_id, None)
        run = self.active.pop(run_id, None)
        if run is None:  # (it ended here before its refused write came back: not ours)
            retired = self.finished.pop(run_id, None)
            if retired is not None:
                retired.log.end()
            return
        log.warning("run_lease_lost", workflow_id=run_id)
        run.suspend()
        run.log.end()

    # -- tool results and followers across proxies (shared stores) --------------------
    async def post_tool_result(self, run_id: str, step_id: str, body: dict[str, Any],
                               tenant: str | None = None) -> str:
        """Take a ``@tool`` step's result (``{"value"}`` or ``{"error"}``) for a run
        executed here or by another proxy; the store keeps it first.

        Returns:
            ``"delivered"`` (to the run, here), ``"queued"`` (kept for the proxy that
            executes the run: it takes it within :data:`TAIL_POLL_S`), ``"duplicate"``
            (the step had its result: nothing changes) or ``"discarded"`` (the step
            timed out before it came: recorded in the trace, nothing else changes).

        Raises:
            RunNotFound: no such run (or another tenant's).
            RequestError: the step is not waiting for a result (unknown, not a ``@tool``
                step or agent call, failed, or the run has finished), here or elsewhere.
        """
        run = self.live(run_id, tenant)
        if run is not None:  # executed here (or finished here lately)
            _check_tool_step(run.graph, run_id, step_id)
            if run.discard_late_result(step_id):  # it timed out: too late, traced
                return "discarded"
            if run.has_tool_result(step_id):
                return "duplicate"
            if step_id not in run.waiting_tools():
                raise _not_waiting(run_id, step_id)
            # durable before it counts
            await self.io.call(self.store.put_tool_result, run.key, step_id, body)
            if run.has_tool_result(step_id):  # (delivered meanwhile)
                return "duplicate"
            run.deliver_tool_result(step_id, body.get("value"), body.get("error"))
            return "delivered"
        stored = await self.stored(run_id, tenant)
        _check_tool_step(stored_graph(stored), run_id, step_id)  # as the owner checks it
        logged = {d.get("step_id") for _, n, d in stored.events
                  if n in ("step.finished", "tool.result")}
        if step_id in logged:
            return "duplicate"
        if stored.status != "running":
            raise _not_waiting(run_id, step_id, f": the run has {stored.status}")
        queued = await self.io.call(self.store.put_tool_result, stored.run_id, step_id, body)
        return "queued" if queued else "duplicate"

    def _posted(self, waiting: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
        """On the store's worker: run key -> the kept results of its ``waiting`` steps."""
        return {key: found for key, steps in waiting.items()
                if (found := self.store.tool_results(key, steps))}

    async def deliver_posted(self) -> int:
        """Hand the results kept in the store (posted to any proxy) to the runs here that
        wait for them.

        Returns:
            How many were delivered.
        """
        waiting = {key: sorted(steps) for key, run in self.active.items()
                   if (steps := run.waiting_tools())}
        delivered = 0
        for key, found in (await self.io.call(self._posted, waiting) if waiting else {}).items():
            run = self.active.get(key)
            for step_id, body in found.items():
                if run is not None and step_id in run.waiting_tools():  # (still, here)
                    run.deliver_tool_result(step_id, body.get("value"), body.get("error"))
                    delivered += 1
        return delivered

    async def queue_request(self, run_id: str, kind: str, data: Any, tenant: str | None,
                            models: Collection[str] | None) -> dict[str, Any]:
        """An open run's append (``kind`` ``"nodes"``, body ``data``) or close
        (``"close"``), or a cancel (``"cancel"``), for a run another proxy executes:
        validated against what the store holds and the requests still queued, then kept
        for the owner (:meth:`apply_requests`).

        Returns:
            The answer: ``{"run_id", "appended", "steps", "queued": true}`` (nodes),
            ``{"run_id", "closed": true, "status"}`` (close) or ``{"run_id", "cancelled",
            "queued": true}`` (cancel; ``cancelled``: whether it was still running).

        Raises:
            RunNotFound: no such run (or another tenant's).
            RunClosed: the run was posted whole, is closed or has finished (nodes).
            GraphError: the append is invalid (every problem listed).
            RequestError: ``awaited`` names unknown steps.
        """
        stored = await self.stored(run_id, tenant)
        key = stored.run_id
        if kind == "cancel":
            running = stored.status == "running"
            if running:
                await self.io.call(self.store.put_request, key, "cancel", {})
            return {"run_id": run_id, "cancelled": running, "queued": True}
        queued = await self.io.call(self.store.requests, [key])
        # read again after the requests: the owner writes an append's nodes before it
        # drops the request, so one it carried out since the first read is in this one
        stored = await self.stored(run_id, tenant)
        graph = stored_graph(stored)
        closed = (not graph.open or stored.status != "running"
                  or any(n == CLOSED for _, n, _ in stored.events)
                  or any(k == "close" for _, _, k, _ in queued))
        if kind == "close":
            if not closed:
                await self.io.call(self.store.put_request, key, "close", {})
            return {"run_id": run_id, "closed": True, "status": stored.status}
        if closed:
            raise RunClosed(f"run {run_id} takes no more steps: it was posted whole, is "
                            "closed or has finished", param="run_id")
        appended, steps = open_runs.check_queued(
            graph, [body for _, _, k, body in queued if k == "nodes"], data, models)
        await self.io.call(self.store.put_request, key, "nodes", data)
        return {"run_id": run_id, "appended": appended, "steps": steps, "queued": True}

    async def apply_requests(self, models: Collection[str] | None, options: CompileOptions,
                             *, recompile: bool = False) -> int:
        """Carry out the appends, closes and cancels other proxies kept for the runs here,
        in order, and drop them (applying one twice is harmless: held nodes are skipped,
        a second close or cancel is a no-op).

        Returns:
            How many were carried out.
        """
        done: list[int] = []
        kept = await self.io.call(self.store.requests, list(self.active)) if self.active else []
        for request_id, run_id, kind, body in kept:
            run = self.active.get(run_id)
            if run is None:  # (lost meanwhile: the request waits for the new owner)
                continue
            try:
                if kind == "cancel":
                    run.cancel()
                elif kind == "close":
                    run.close_input()
                else:
                    await open_runs.append(run, body, models, options, recompile=recompile)
            except LeaseLost:
                continue
            except FlowliftError as exc:  # validated when queued; the run may have ended
                log.warning("run_request_dropped", workflow_id=run_id, kind=kind,
                            error=exc.message)
            done.append(request_id)
        if done:
            await self.io.call(self.store.drop_requests, done)
        return len(done)

    async def tail(self, stored: StoredRun, after: int = 0) -> AsyncGenerator[Event, None]:
        """The events of a run another proxy executes (``stored``: as read now): those
        after ``after``, then new ones from the store as they are announced (or polled:
        :attr:`wakeups`) until ``run.finished``; follows the run's own log once this
        proxy takes it over. The follow is marked in the store meanwhile
        (:meth:`heartbeat`)."""
        run_id = stored.run_id
        self.tailed[run_id] += 1
        self.io.submit(self.store.mark_followed, [run_id])
        try:
            current: StoredRun | None = stored
            with self.wakeups.watch(event={run_id}) as woken:
                while current is not None:
                    for event in current.events:
                        if event[0] > after:
                            after = event[0]
                            yield event
                            if event[1] == FINAL:
                                return
                    if current.status != "running":
                        return
                    if run_id in self.active:  # taken over here: its own log from now on
                        async for event in self.active[run_id].log.follow(after):
                            yield event
                        return
                    await woken.wait()
                    woken.clear()  # (before the read: what is written during it wakes us)
                    current = await self.io.call(self.store.load, run_id)
        finally:
            self.tailed[run_id] -= 1
            if not self.tailed[run_id]:
                del self.tailed[run_id]

    async def watch_posted(self, models: Callable[[], Collection[str] | None],
                           options: Callable[[], CompileOptions], *,
                           recompile: bool = False) -> None:
        """Forever: hand the results, appends, closes and cancels kept in the store for
        the runs here to them (:meth:`deliver_posted`, :meth:`apply_requests`) as they
        are announced, or polled (:attr:`wakeups`); a failing store is tried again at
        the next round. ``models``, ``options``: the served models and the compile
        options of appends, read each round."""
        with self.wakeups.watch(posted=self.active.keys()) as woken:
            while True:
                await woken.wait()
                woken.clear()
                try:
                    await self.deliver_posted()
                    await self.apply_requests(models(), options(), recompile=recompile)
                except Exception:  # a database hiccup: the next round tries again
                    log.exception("run_tool_results_failed")

    async def keep_leases(self, backends: Backends, costs: CostTracker) -> None:
        """Forever, on a shared store: :meth:`heartbeat` every third of ``lease_ttl_s``,
        and at once when a run's lease is released elsewhere (take it over) or one of
        the runs here is claimed by another proxy (stop it here)."""
        with self.wakeups.watch(released=None, claimed=self.active.keys()) as woken:
            while True:
                await woken.wait(max(self.lease_ttl_s / 3, 0.1))
                woken.clear()
                try:
                    await self.heartbeat(backends, costs)
                except Exception:  # a database hiccup: the next beat tries again
                    log.exception("run_heartbeat_failed")

    def close(self, grace_s: float = 10.0) -> None:
        """Stop listening, let the writes submitted land (for up to ``grace_s``: a store
        still failing by then gives them up, and their runs resume from their logs at
        the next start), close the store and the worker."""
        self.wakeups.close()
        drained = self.io.drain(grace_s)
        if not drained:
            log.warning("run_store_not_drained", backlog=self.io.backlog, grace_s=grace_s)
        self.store.close()  # (calls still retrying give up at once)
        self.io.close(wait=drained)

    def _activate(self, run: Run) -> None:
        self.active[run.key] = run
        run.detached_since = time.monotonic()
        run.start().add_done_callback(lambda _: self.retire(run))

    def retire(self, run: Run) -> None:
        """Move a finished run to the finished table and write its trace (once)."""
        if self.active.pop(run.key, None) is None:
            return
        self.leases.epochs.pop(run.key, None)
        # (suspended: another proxy may take it; after the run's last event, in order)
        self.io.submit(self.leases.release, run.key)
        self.finished[run.key] = run
        log_end(run)
        learn_lengths(run, self.outcomes)
        if self.trace_dir is not None and _RUN_ID.fullmatch(run.run_id):  # (older stores)
            path = self.trace_dir / f"{run.key}.jsonl"  # (a tenant's: in its own folder)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in run.trace.records()))

    def lookahead(self, canonical: Callable[[str | None], str]) -> Lookahead:
        """What the active runs need next, for the residency manager: each run's residency
        plan (compiled windows, relative to the run's elapsed time) with the models of its
        queued llm steps pinned; ``canonical`` maps a graph's model name to the served one."""
        ahead = Lookahead()
        for run in self.active.values():
            report = None if run.plan is None else run.plan.latest_report()  # never compiles
            windows = [] if report is None else [
                w.model_copy(update={"model": canonical(w.model)}) for w in report.residency]
            queued = {canonical(st.model) for st in run.trace.steps.values()
                      if st.kind == "llm" and st.status == "queued"}
            ahead = ahead.merge(lookahead(windows, run.trace.now_ms(), queued))
        return ahead

    async def sweep(self) -> None:
        """Cancel runs without a listener for longer than ``detached_timeout_s``, and
        prune the store (see the class docstring)."""
        await self.io.call(self.store.prune, self.store_ttl_s, self.store_keep)
        now = time.monotonic()
        for run in list(self.active.values()):
            if run.log.listeners or run.graph.detached:
                run.detached_since = None
            elif run.detached_since is None:
                run.detached_since = now
            elif now - run.detached_since > self.detached_timeout_s:
                log.warning("run_orphaned", workflow_id=run.run_id)
                run.cancel()
