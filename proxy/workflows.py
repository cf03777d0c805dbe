"""The workflow API.

* ``POST /v1/workflows`` -- a graph in, an SSE stream of run events out (see
  :mod:`flowlift.proxy.runs`). An invalid graph is rejected whole before anything runs:
  HTTP 400, OpenAI error shape, ``error.problems`` lists every problem.
* ``POST /v1/workflows/{run_id}/steps/{step_id}/result`` -- a ``@tool`` step's result,
  ``{"value": ...}`` or ``{"error": "..."}``.
* ``GET /v1/workflows/{run_id}`` -- status, outputs, failures and trace of a run that is
  running or finished recently.
* ``DELETE /v1/workflows/{run_id}`` -- cancel a run (queued steps dropped, engine
  requests aborted).

If the client that started a run goes away, the run is cancelled: nobody could run its
``@tool`` steps or receive its results.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp_sse import sse_response
from cachetools import TTLCache
from pydantic import BaseModel, ConfigDict, ValidationError

from flowlift.dataflow import validate
from flowlift.errors import GraphError, RequestError
from flowlift.graph import Graph
from flowlift.proxy.backends import Backends
from flowlift.proxy.http import log, parse_model, read_json
from flowlift.proxy.planning import plan
from flowlift.proxy.runs import Run
from flowlift.proxy.state import STATE

routes = web.RouteTableDef()


class ToolResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: Any = None
    error: str | None = None


class RunRegistry:
    """Active runs, plus finished ones for ``ttl_s`` (bounded, so unique ids never grow it)."""

    def __init__(self, trace_dir: Path | None = None, keep: int = 1024,
                 ttl_s: float = 3600.0) -> None:
        self.active: dict[str, Run] = {}
        self.finished: TTLCache[str, Run] = TTLCache(maxsize=keep, ttl=ttl_s)
        self.trace_dir = trace_dir

    def get(self, run_id: str) -> Run:
        run = self.active.get(run_id) or self.finished.get(run_id)
        if run is None:
            raise RequestError(f"no workflow run {run_id!r} (finished runs are kept for an "
                               "hour)", param="run_id")
        return run

    def add(self, run: Run) -> None:
        if run.run_id in self.active or run.run_id in self.finished:
            raise RequestError(f"a run with id {run.run_id!r} exists; omit `id` to get a "
                               "fresh one", param="id")
        self.active[run.run_id] = run

    def retire(self, run: Run) -> None:
        """Move a finished run to the finished table and write its trace (once)."""
        if self.active.pop(run.run_id, None) is None:
            return
        self.finished[run.run_id] = run
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            path = self.trace_dir / f"{run.run_id}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in run.trace.records()))


def parse_graph(data: Any, backends: Backends) -> Graph:
    """Parse and validate a graph document; every problem is reported at once.

    Raises:
        GraphError: HTTP 400 with ``problems``.
    """
    try:
        graph = Graph.model_validate(data)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc'])) or '(graph)'}: {e['msg']}"
                    for e in exc.errors(include_url=False)]
        raise GraphError(problems) from None
    validate(graph, backends.known())
    return graph


@routes.post("/v1/workflows")
async def start_workflow(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    graph = parse_graph(await read_json(request), state.backends)
    run_plan = await asyncio.to_thread(plan, graph, state.backends, state.costs)
    run = Run(graph, state.backends, run_plan, state.costs)
    state.runs.add(run)
    run.start()
    log.info("run_started", workflow_id=run.run_id, name=graph.name, steps=len(graph.nodes))
    try:
        async with sse_response(request, sep="\n", allow_all_methods=True) as resp:
            while True:
                event, data = await run.events.get()
                if event == "run.finished":  # trace on disk before the client hears of it
                    await asyncio.wait([run.task])  # type: ignore[list-item]
                    state.runs.retire(run)
                await resp.send(json.dumps(data), event=event)
                if event == "run.finished":
                    break
    except (ConnectionResetError, asyncio.CancelledError):
        log.warning("client_gone", workflow_id=run.run_id)
        run.cancel()
        raise
    finally:
        assert run.task is not None
        run.task.add_done_callback(lambda _: state.runs.retire(run))
    log.info("run_finished", workflow_id=run.run_id, status=run.trace.status)
    return resp


@routes.post("/v1/workflows:compile")
async def compile_workflow(request: web.Request) -> web.Response:
    """The compiler's report for a graph, under this proxy's measured cost models."""
    state = request.app[STATE]
    graph = parse_graph(await read_json(request), state.backends)
    run_plan = await asyncio.to_thread(plan, graph, state.backends, state.costs)
    return web.json_response(run_plan.report.model_dump(mode="json"))


@routes.post("/v1/workflows/{run_id}/steps/{step_id}/result")
async def tool_result(request: web.Request) -> web.Response:
    run = request.app[STATE].runs.get(request.match_info["run_id"])
    body = parse_model(ToolResult, await read_json(request), "tool result")
    run.deliver_tool_result(request.match_info["step_id"], body.value, body.error)
    return web.json_response({"ok": True})


@routes.get("/v1/workflows/{run_id}")
async def get_run(request: web.Request) -> web.Response:
    run = request.app[STATE].runs.get(request.match_info["run_id"])
    return web.json_response({"run_id": run.run_id, "status": run.trace.status,
                              "outputs": run.outputs, "failures": run.failures,
                              "trace": run.trace.records()})


@routes.delete("/v1/workflows/{run_id}")
async def cancel_run(request: web.Request) -> web.Response:
    run = request.app[STATE].runs.get(request.match_info["run_id"])
    run.cancel()
    return web.json_response({"run_id": run.run_id, "cancelled": not run.finished})
