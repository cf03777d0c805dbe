"""The SDK side of the workflow protocol, sync and async.

Protocol (proxy: ``flowlift.proxy.workflows``):

1. ``POST /v1/workflows`` with the graph; the answer is an SSE stream of events:
   ``run.started`` ``{run_id}``, ``step.finished`` ``{step_id, value}``,
   ``step.failed`` ``{step_id, error}``, ``tool.wanted`` ``{step_id, name, args, kwargs}``,
   ``run.finished`` ``{run_id, status, failures, trace}``.
2. For each ``tool.wanted`` the SDK runs the ``@tool`` function and posts
   ``POST /v1/workflows/{run_id}/steps/{step_id}/result`` with ``{"value": ...}`` or
   ``{"error": "..."}``.

The event handling is shared (:func:`_handle`); only the I/O differs. HTTP and
connection errors are translated here, once, into :mod:`flowlift.errors`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse, connect_sse

from flowlift.errors import (
    FlowliftError,
    GraphError,
    ProxyUnavailable,
    RequestError,
    RunError,
)
from flowlift.sdk.workflow import Workflow

_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=60.0)


@dataclass(frozen=True, slots=True)
class ToolCall:
    step_id: str
    args: list[Any]
    kwargs: dict[str, Any]


def _handle(wf: Workflow, sse: ServerSentEvent) -> ToolCall | None:
    if sse.event in ("", "message", "ping") or not sse.data:
        return None
    data = json.loads(sse.data)
    if sse.event == "run.started":
        wf.run_id = data["run_id"]
        wf.status = "running"
    elif sse.event == "step.finished":
        wf.record_output(data["step_id"], data["value"])
    elif sse.event == "step.failed":
        wf.record_failure(data["step_id"], data["error"])
    elif sse.event == "tool.wanted":
        args, kwargs = wf.tool_arguments(data["step_id"], data["args"], data["kwargs"])
        return ToolCall(data["step_id"], args, kwargs)
    elif sse.event == "run.finished":
        for step_id, error in data.get("failures", {}).items():
            wf.failures.setdefault(step_id, error)
        wf.finish(data["run_id"], data["status"], data.get("trace", []))
    return None


def _error_from(response_status: int, body: bytes) -> FlowliftError:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return RunError(f"proxy answered HTTP {response_status}: {body[:500]!r}")
    if err.get("code") == "invalid_graph":
        return GraphError(err.get("problems") or [err.get("message", "")])
    if 400 <= response_status < 500:
        return RequestError(err.get("message", ""), param=err.get("param"))
    return RunError(f"proxy error ({response_status}): {err.get('message')}")


def _result_body(wf: Workflow, call: ToolCall) -> tuple[str, dict[str, Any]]:
    tool = wf.tools[call.step_id]
    url = f"/v1/workflows/{wf.run_id}/steps/{call.step_id}/result"
    try:
        value = tool.fn(*call.args, **call.kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_await(value))
        json.dumps(value)
        return url, {"value": value}
    except Exception as exc:  # the tool's own failure is the step's failure
        return url, {"error": f"{type(exc).__name__}: {exc}"}


async def _await(aw: Any) -> Any:
    return await aw


def run_sync(wf: Workflow) -> None:
    """Ship ``wf``'s graph and drive the run to its end (blocking)."""
    transport = wf.transport if isinstance(wf.transport, httpx.BaseTransport) else None
    body = wf.graph().to_wire()
    try:
        with httpx.Client(base_url=wf.base_url, transport=transport, timeout=_TIMEOUT) as client, \
                ThreadPoolExecutor(max_workers=wf.tool_workers) as pool:

            def run_tool(call: ToolCall) -> None:
                url, result = _result_body(wf, call)
                client.post(url, json=result).raise_for_status()

            with connect_sse(client, "POST", "/v1/workflows", json=body) as source:
                if source.response.status_code != 200:
                    raise _error_from(source.response.status_code, source.response.read())
                futures = []
                for sse in source.iter_sse():
                    call = _handle(wf, sse)
                    if call is not None:
                        futures.append(pool.submit(run_tool, call))
                for fut in futures:
                    fut.result()
    except httpx.TransportError as exc:
        raise ProxyUnavailable(wf.base_url, f"{type(exc).__name__}: {exc}") from exc
    _require_finished(wf)


async def run_async(wf: Workflow) -> None:
    """Ship ``wf``'s graph and drive the run to its end (async)."""
    transport = wf.transport if isinstance(wf.transport, httpx.AsyncBaseTransport) else None
    body = wf.graph().to_wire()
    try:
        async with httpx.AsyncClient(base_url=wf.base_url, transport=transport,
                                     timeout=_TIMEOUT) as client:

            async def run_tool(call: ToolCall) -> None:
                tool = wf.tools[call.step_id]
                url = f"/v1/workflows/{wf.run_id}/steps/{call.step_id}/result"
                try:
                    if inspect.iscoroutinefunction(tool.fn):
                        value = await tool.fn(*call.args, **call.kwargs)
                    else:
                        value = await asyncio.to_thread(tool.fn, *call.args, **call.kwargs)
                    json.dumps(value)
                    result: dict[str, Any] = {"value": value}
                except Exception as exc:
                    result = {"error": f"{type(exc).__name__}: {exc}"}
                (await client.post(url, json=result)).raise_for_status()

            async with aconnect_sse(client, "POST", "/v1/workflows", json=body) as source:
                if source.response.status_code != 200:
                    raise _error_from(source.response.status_code,
                                      await source.response.aread())
                async with asyncio.TaskGroup() as tasks:
                    async for sse in source.aiter_sse():
                        call = _handle(wf, sse)
                        if call is not None:
                            tasks.create_task(run_tool(call))
    except httpx.TransportError as exc:
        raise ProxyUnavailable(wf.base_url, f"{type(exc).__name__}: {exc}") from exc
    _require_finished(wf)


def _require_finished(wf: Workflow) -> None:
    if wf.status not in ("succeeded", "failed"):
        raise RunError(f"the proxy closed the event stream of run {wf.run_id} before it "
                       "finished; see the proxy's log")
