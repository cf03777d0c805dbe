"""The workflow API.

* ``POST /v1/workflows`` -- a graph in, an SSE stream of run events out (see
  :mod:`flowlift.proxy.workflows.runs`); each event's SSE ``id`` is its number in the run's log.
  An invalid graph is rejected whole before anything runs: HTTP 400, OpenAI error
  shape, ``error.problems`` lists every problem (a proxy tool, ``tools[i].server``, must
  name a ``[tools.*]`` server the tenant reaches and a tool it offers:
  :meth:`~flowlift.proxy.tools.ToolServers.resolve`). A ``deadline_s`` the compiler finds
  infeasible is said in the ``X-Flowlift-Deadline-Warning`` header (the SDK warns), or
  refused (400, ``param: deadline_s``) when the graph asks for ``strict_deadline``.
* ``GET /v1/workflows/{run_id}/events`` -- the same stream again, from the event after
  ``Last-Event-ID`` (header) or ``?after=N``: a client that lost its connection, or a
  proxy that restarted, loses nothing. On a shared store a replica that does not execute
  the run streams it from the store until it finishes. ``?serve=a,b`` (``flowlift.attach``
  sends its tools' names): each waiting ``tool.wanted`` of those tools goes to one such
  follower at a time (:class:`~flowlift.proxy.store.events.EventLog`).
* ``POST /v1/workflows/{run_id}/steps/{step_id}/result`` -- a ``@tool`` step's result,
  ``{"value": ...}`` or ``{"error": "..."}``; on a shared store any replica takes it (202
  when another executes the run) and a second post of a result is a no-op.
* ``POST /v1/workflows/{run_id}/nodes`` -- append ``{"nodes": [...], "awaited": [...]}``
  to an open run (a graph posted with ``"open": true``; ``"awaited"`` may go with it
  too); ``POST /v1/workflows/{run_id}/close`` -- no more nodes
  (:mod:`flowlift.proxy.workflows.open_runs`); on a shared store a replica that does not
  run the run validates them and keeps them for the one that does (202).
* ``GET /v1/workflows`` -- runs, newest first, from the run store (so runs finished
  before a restart too), in OpenAI's list shape ``{"object": "list", "data": [...],
  "first_id", "last_id", "has_more"}``; each item also says its progress, deadline and
  spend so far (``steps``, ``done``, ``failed``, ``deadline_s``, ``deadline_left_s``,
  ``spent``, ``standard_cost``: :func:`~flowlift.proxy.workflows.progress.listing`);
  ``?state=`` (running, succeeded, failed,
  cancelled), ``?name=`` (the graph's name), ``?limit=`` (1-100, default 20), ``?after=``
  (the last id of the previous page), ``?since=`` (epoch s).
* ``GET /v1/workflows/{run_id}`` -- status, outputs, failures, ``skipped`` (step id ->
  why; not failures) and the trace (once finished) of a run, ``prompts`` (step id ->
  the messages its model received),
  ``spend`` (each answer's tier and price: :func:`~flowlift.proxy.workflows.progress.spend`)
  and ``report``: the compiler's report of its graph.
* ``DELETE /v1/workflows/{run_id}`` -- cancel a run (queued steps dropped, engine
  requests aborted); on a shared store any replica takes it (202 when another runs it).
* ``POST /v1/workflows:compile`` -- the compiler's report.

A client that goes away does not cancel its run: it may reconnect. Runs nobody listens
to for a while are cancelled by the registry's sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp_sse import sse_response
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from flowlift.compiler import Plan
from flowlift.dataflow import validate
from flowlift.errors import FlowliftError, GraphError, RequestError
from flowlift.graph import DEADLINE_WARNING_HEADER, Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.http import log, parse_model, read_json
from flowlift.proxy.state import STATE, ProxyState
from flowlift.proxy.store.base import StoredRun
from flowlift.proxy.store.events import FINAL, Event
from flowlift.proxy.tenants import run_key, tenant_of
from flowlift.proxy.workflows import open_runs, progress
from flowlift.proxy.workflows.planning import compile_options, plan
from flowlift.proxy.workflows.registry import ANSWER_WITHIN_S
from flowlift.proxy.workflows.replay import trace_records
from flowlift.proxy.workflows.runs import Run
from flowlift.tracing.spans import extract

if TYPE_CHECKING:
    from flowlift.proxy.workflows.registry import RunRegistry

routes = web.RouteTableDef()


class ToolResult(BaseModel):
    """A ``@tool`` step's result: exactly one of ``value`` (any JSON, ``null`` too) or
    ``error`` (the message of what the tool raised)."""

    model_config = ConfigDict(extra="forbid")
    value: Any = None
    error: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> ToolResult:
        given = self.model_fields_set & {"value", "error"}
        if len(given) != 1:
            raise ValueError("give exactly one of 'value' (the tool's return value, null "
                             "included) or 'error' (what it raised), not "
                             + (" and ".join(sorted(given)) if given else "neither"))
        if "error" in given and self.error is None:
            raise ValueError("'error' is the message of what the tool raised, not null: "
                             "send {\"value\": null} for a tool that returned None")
        return self


def _graph_model(data: Any) -> Graph:
    try:
        return Graph.model_validate(data)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc'])) or '(graph)'}: {e['msg']}"
                    for e in exc.errors(include_url=False)]
        raise GraphError(problems) from None


def parse_graph(data: Any, backends: Backends) -> Graph:
    """Parse and validate a graph document; every problem is reported at once.

    Raises:
        GraphError: HTTP 400 with ``problems``.
    """
    graph = _graph_model(data)
    validate(graph, backends.known())
    return graph


async def submitted_graph(data: Any, state: ProxyState, tenant: str | None) -> Graph:
    """:func:`parse_graph` with its proxy tools described for ``tenant``
    (:meth:`~flowlift.proxy.tools.ToolServers.resolve`); the problems of both listed
    together.

    Raises:
        GraphError: HTTP 400 with ``problems``.
    """
    graph = _graph_model(data)
    problems: list[str] = []
    try:
        validate(graph, state.backends.known())
    except GraphError as exc:
        problems += exc.problems
    try:
        graph = await state.tools.resolve(graph, state.tenants.by_name(tenant))
    except GraphError as exc:
        problems += exc.problems
    if problems:
        raise GraphError(problems)
    return graph


async def _send(request: web.Request, events: AsyncGenerator[Event, None],
                run: Run | None, headers: dict[str, str] | None = None) -> web.StreamResponse:
    async with (sse_response(request, sep="\n", allow_all_methods=True,
                             headers=headers) as resp,
                contextlib.aclosing(events) as stream):  # a closed stream frees its claims
        async for seq, name, data in stream:
            if name == FINAL and run is not None:  # trace on disk before the client hears
                if run.task is not None:  # a run that logs events has been started
                    await asyncio.wait([run.task])
                request.app[STATE].runs.retire(run)
            await resp.send(json.dumps(data), id=str(seq), event=name)
    return resp


def _serves(query: Any) -> frozenset[str] | None:
    """``?serve=a,b``: the tools a follower runs (empty: none); absent: all (see
    :class:`~flowlift.proxy.store.events.EventLog`)."""
    raw = query.get("serve")
    return None if raw is None else frozenset(n for n in raw.split(",") if n)


async def _replay(events: list[Event], after: int) -> AsyncGenerator[Event, None]:
    for event in events:
        if event[0] > after:
            yield event


@routes.post("/v1/workflows")
async def start_workflow(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    data = await read_json(request)
    awaited = data.pop("awaited", None) if isinstance(data, dict) else None
    graph = await submitted_graph(data, state, tenant_of(request))
    awaited = open_runs.awaited_ids(graph.node_map(), awaited)
    run_plan = await asyncio.to_thread(plan, graph, state.backends, state.costs,
                                     state.runs.outcomes, state.prices)
    warning = deadline_warning(graph, run_plan)
    if warning is not None and graph.strict_deadline:
        raise RequestError(f"{warning}; the workflow asked for strict_deadline, so it was "
                           "not started (raise deadline_s, or drop strict_deadline to run "
                           "it anyway)", param="deadline_s")
    tenant = state.tenants.by_name(tenant_of(request))
    run = await state.runs.start(graph, state.backends, state.costs, run_plan,
                           parent=extract(request.headers), tenant=tenant_of(request),
                           tenant_max_active=tenant.max_active_runs if tenant else None)
    run.mark_awaited(awaited)
    log.info("run_started", workflow_id=run.run_id, name=graph.name, steps=len(graph.nodes))
    if warning is not None:
        log.warning("run_deadline_infeasible", workflow_id=run.run_id, detail=warning)
    return await _send(request, run.log.follow(0), run,
                       None if warning is None else {DEADLINE_WARNING_HEADER: warning})


def deadline_warning(graph: Graph, run_plan: Plan) -> str | None:
    """Why the compiler calls ``graph``'s deadline infeasible, or None when it does not
    (or the graph has none)."""
    report = run_plan.report
    if report.deadline_feasible is not False or graph.deadline_s is None:
        return None
    return (f"the deadline of {graph.deadline_s:g} s looks infeasible: the compiler "
            f"estimates at least {report.lower_bound_ms / 1000:.1f} s (critical path "
            f"{report.critical_path_ms / 1000:.1f} s over {len(report.critical_path)} steps)")


MAX_PAGE = 100


def _list_params(query: Any) -> dict[str, Any]:
    """``GET /v1/workflows``'s query, checked.

    Raises:
        RequestError: a ``limit`` that is not 1-100, a ``since`` that is not a number.
    """
    raw_limit = query.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_PAGE:
        raise RequestError(f"limit must be a whole number from 1 to {MAX_PAGE}", param="limit")
    try:
        since = float(query["since"]) if "since" in query else None
    except ValueError:
        raise RequestError("since must be a time in epoch seconds", param="since") from None
    return {"status": query.get("state"), "name": query.get("name"), "limit": int(raw_limit),
            "after": query.get("after"), "since": since}


@routes.get("/v1/workflows")
async def list_runs(request: web.Request) -> web.Response:
    """Runs in the store the request's tenant may see, newest first (see the module
    docstring for the query)."""
    registry, tenant = request.app[STATE].runs, tenant_of(request)
    runs, more = await registry.recent(**_list_params(request.query), tenant=tenant)
    data = [{**r.to_json(), **await _figures(registry, run_key(tenant, r.run_id))}
            for r in runs]
    return web.json_response({"object": "list", "data": data,
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": more})


async def _figures(registry: RunRegistry, key: str) -> dict[str, Any]:
    """A listed run's progress, deadline and spend so far (:func:`progress.listing`):
    from memory while it runs here, else from its stored event log (``key``: the run's,
    :func:`~flowlift.proxy.tenants.run_key`)."""
    run = registry.active.get(key) or registry.finished.get(key)
    if run is not None:
        left = run.clock.left_s() if run.clock is not None and not run.finished else None
        return progress.listing(len(run.trace.steps), run.graph.deadline_s,
                                run.log.history(), left)
    stored = await registry.io.call(registry.store.load, key, within_s=ANSWER_WITHIN_S)
    return {} if stored is None else progress.stored_listing(stored)


@routes.get("/v1/workflows/{run_id}/events")
async def follow_workflow(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    run_id = request.match_info["run_id"]
    raw = request.headers.get("Last-Event-ID") or request.query.get("after") or "0"
    if not raw.isdigit():
        raise RequestError("Last-Event-ID / after must be an event number", param="after")
    after = int(raw)
    tenant = tenant_of(request)
    run = state.runs.live(run_id, tenant)
    if run is not None:
        return await _send(request, run.log.follow(after, _serves(request.query)), run)
    stored = await state.runs.stored(run_id, tenant, within_s=ANSWER_WITHIN_S)
    if stored.status == "running" and state.runs.store.shared:  # another proxy runs it
        return await _send(request, state.runs.tail(stored, after), None)
    return await _send(request, _replay(stored.events, after), None)


@routes.post("/v1/workflows:compile")
async def compile_workflow(request: web.Request) -> web.Response:
    """The compiler's report for a graph, under this proxy's measured cost models."""
    state = request.app[STATE]
    graph = parse_graph(await read_json(request), state.backends)
    run_plan = await asyncio.to_thread(plan, graph, state.backends, state.costs,
                                     state.runs.outcomes, state.prices)
    return web.json_response(run_plan.report.model_dump(mode="json"))


@routes.post("/v1/workflows/{run_id}/steps/{step_id}/result")
async def tool_result(request: web.Request) -> web.Response:
    """A ``@tool`` result, for a run executed here or by another proxy on the same store
    (:meth:`~flowlift.proxy.workflows.registry.RunRegistry.post_tool_result`): 200
    ``{"ok": true, "outcome": "delivered" | "duplicate"}``, or 202 with ``"queued"`` (kept
    in the store for the proxy that executes the run)."""
    body = parse_model(ToolResult, await read_json(request), "tool result")
    outcome = await request.app[STATE].runs.post_tool_result(
        request.match_info["run_id"], request.match_info["step_id"],
        body.model_dump(exclude_none=True), tenant_of(request))
    return web.json_response({"ok": True, "outcome": outcome},
                             status=202 if outcome == "queued" else 200)


@routes.post("/v1/workflows/{run_id}/nodes")
async def append_nodes(request: web.Request) -> web.Response:
    """Append nodes to an open run (:func:`open_runs.append`)."""
    state = request.app[STATE]
    run_id, tenant = request.match_info["run_id"], tenant_of(request)
    data = await state.tools.resolve_appended(await read_json(request),
                                              state.tenants.by_name(tenant))
    if state.runs.live(run_id, tenant) is None and state.runs.store.shared:
        return web.json_response(await state.runs.queue_request(  # another replica runs it
            run_id, "nodes", data, tenant, state.backends.known()), status=202)
    run = state.runs.get(run_id, tenant)
    started = time.perf_counter()
    answer = await open_runs.append(
        run, data, state.backends.known(),
        compile_options(state.backends, state.costs, state.runs.outcomes, state.prices),
        recompile=state.config.append_recompile)
    spent_ms = (time.perf_counter() - started) * 1000
    log.info("run_grown", workflow_id=run.run_id, appended=len(answer["appended"]),
             steps=answer["steps"], append_ms=round(spent_ms, 2))
    return web.json_response(answer, headers={"Server-Timing": f"append;dur={spent_ms:.3f}"})


@routes.post("/v1/workflows/{run_id}/close")
async def close_run(request: web.Request) -> web.Response:
    """No more nodes for an open run; it finishes once every node is done."""
    runs = request.app[STATE].runs
    run_id, tenant = request.match_info["run_id"], tenant_of(request)
    if runs.live(run_id, tenant) is None and runs.store.shared:  # another replica runs it
        return web.json_response(await runs.queue_request(run_id, "close", None, tenant, None),
                                 status=202)
    run = runs.get(run_id, tenant)
    run.close_input()
    return web.json_response({"run_id": run.run_id, "closed": True,
                              "status": run.trace.status})


@routes.get("/v1/workflows/{run_id}")
async def get_run(request: web.Request) -> web.Response:
    """A submitted run (status, outputs, trace), or a workflow inferred from OpenAI
    traffic (its graph and the compiler's report, as for a submitted graph)."""
    state = request.app[STATE]
    runs = state.runs
    run_id = request.match_info["run_id"]
    tenant = tenant_of(request)
    run = runs.live(run_id, tenant)
    if run is None and state.inferred.has(run_id, tenant):
        def report(graph: Graph) -> dict[str, Any]:
            return plan(graph, state.backends, state.costs, state.runs.outcomes,
                        state.prices).report.model_dump(mode="json")
        described = await asyncio.to_thread(state.inferred.describe, run_id, report,
                                            tenant)
        if described is not None:
            return web.json_response(described)
    if run is not None:
        return web.json_response({"run_id": run.run_id, "name": run.graph.name,
                                  "status": run.trace.status,
                                  "open": not run.growth.closed,
                                  "outputs": run.outputs, "failures": run.failures,
                                  "skipped": run.skipped,
                                  "trace": run.trace.records(), "prompts": run.prompts,
                                  "spend": progress.spend(run.log.history()),
                                  "report": await _run_report(state, run.graph, run.plan)})
    stored = await runs.stored(run_id, tenant, within_s=ANSWER_WITHIN_S)
    graph = _stored_graph(stored)
    return web.json_response({"run_id": run_id, "name": stored.graph.get("name"),
                              "status": stored.status,
                              "outputs": stored.outputs(), "failures": stored.failures(),
                              "skipped": stored.skipped(),
                              "trace": trace_records(run_id, _wire(graph), stored.events),
                              "prompts": stored.prompts(),
                              "spend": progress.spend(stored.events),
                              "report": await _run_report(state, graph, None)})


@routes.get("/v1/workflows/{run_id}/graph")
async def get_graph(request: web.Request) -> web.Response:
    """A run's graph as recorded, appended nodes included (wire format): what
    ``flowlift compile --run RUN_ID`` compiles. An unknown run: 404 (OpenAI error shape)."""
    state = request.app[STATE]
    return web.json_response(await recorded_graph(state, request.match_info["run_id"],
                                                  tenant_of(request)))


def _stored_graph(stored: StoredRun) -> Graph | dict[str, Any]:
    """A stored run's graph with its appended nodes (the raw document if it does not
    parse: the report is then left out)."""
    try:
        return open_runs.stored_graph(stored)
    except (ValueError, KeyError):
        return stored.graph


async def recorded_graph(state: ProxyState, run_id: str, tenant: str | None) -> dict[str, Any]:
    """A run's graph as recorded (wire format, appended nodes included).

    Raises:
        RunNotFound: no such run (for this tenant; a RequestError, HTTP 404).
    """
    run = state.runs.live(run_id, tenant)
    if run is not None:
        return run.graph.to_wire()
    return _wire(_stored_graph(await state.runs.stored(run_id, tenant)))


def _wire(graph: Graph | dict[str, Any]) -> dict[str, Any]:
    return graph.to_wire() if isinstance(graph, Graph) else graph


async def _run_report(state: ProxyState, graph: Graph | dict[str, Any],
                      run_plan: Plan | None) -> dict[str, Any] | None:
    """The compiler's report of a run: its own plan, or (a run read back from the store)
    its graph compiled again under today's cost models; None when that fails."""
    if run_plan is not None:  # a growing run's report is compiled when first read
        return await asyncio.to_thread(lambda: run_plan.report.model_dump(mode="json"))
    try:
        g = graph if isinstance(graph, Graph) else Graph.model_validate(graph)
        again = await asyncio.to_thread(plan, g, state.backends, state.costs)
    except (FlowliftError, ValueError, KeyError) as exc:
        log.info("run_report_unavailable", error=str(exc))
        return None
    return again.report.model_dump(mode="json")


@routes.delete("/v1/workflows/{run_id}")
async def cancel_run(request: web.Request) -> web.Response:
    """Cancel a run; on a shared store, one another replica executes is cancelled by it
    (202, the request kept in the store for it)."""
    runs = request.app[STATE].runs
    run_id, tenant = request.match_info["run_id"], tenant_of(request)
    if runs.live(run_id, tenant) is None and runs.store.shared:
        return web.json_response(await runs.queue_request(run_id, "cancel", None, tenant, None),
                                 status=202)
    run = runs.get(run_id, tenant)
    run.cancel()
    return web.json_response({"run_id": run.run_id, "cancelled": not run.finished})
