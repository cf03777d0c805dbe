"""The SDK side of the workflow protocol, sync and async.

Protocol (proxy: ``flowlift.proxy.workflows.api``):

1. ``POST /v1/workflows`` with the graph; the answer is an SSE stream of events:
   ``run.started`` ``{run_id, steps, warnings?}`` (the compiler's warnings: issued as
   :class:`~flowlift.errors.PlanWarning`), ``step.finished`` ``{step_id, value}``,
   ``step.failed`` ``{step_id, error, kind, attempts?}`` (``kind``: see
   :func:`flowlift.errors.step_failure`), ``step.skipped`` ``{step_id, reason, value?}``
   (a condition not taken: :mod:`flowlift.sdk.conditions`), ``tool.wanted``
   ``{step_id, name, args, kwargs}``, ``tool.cancelled`` ``{step_id, reason}`` (a call
   out in the app is no longer wanted: a lost ``first``/``quorum`` group, a cancelled
   run, a deadline, the tool's ``timeout_s``; an async tool's task is cancelled, a sync
   tool's thread cannot be stopped: its result is dropped, never posted),
   ``run.finished`` ``{run_id, status, failures, trace}``. (Other events, e.g. an agent
   step's ``agent.turn`` and ``tool.result``, are the proxy's own records.)
2. For each ``tool.wanted`` (an agent step's tool call: with ``agent_step``, and a call id
   as ``step_id``) the SDK runs the ``@tool`` function and posts
   ``POST /v1/workflows/{run_id}/steps/{step_id}/result`` with ``{"value": ...}`` or
   ``{"error": "..."}``.

Several replicas (``Workflow(base_url=[...])``: proxies on one shared run store): the
graph goes to the first that accepts a connection (a replica that refused the
connection was sent nothing, so the next one is tried at once); once the run has an id,
each lost stream moves to the next replica (:meth:`_Session.next_replica`), which
replays the run's events from the store after ``Last-Event-ID`` and follows it wherever
it executes; kept ``@tool`` results are re-posted there (any replica takes them, a second
post is a no-op), so no step is submitted or run twice.

The event handling is shared (:func:`_handle`); only the I/O differs. HTTP and
connection errors are translated here, once, into :mod:`flowlift.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse, connect_sse

import flowlift.errors as errors_module
from flowlift.credentials import HINT
from flowlift.errors import (
    AuthenticationError,
    DeadlineWarning,
    FlowliftError,
    GraphError,
    PlanWarning,
    ProxyUnavailable,
    RequestError,
    RunClosed,
    RunError,
)
from flowlift.graph import DEADLINE_WARNING_HEADER
from flowlift.sdk import progress
from flowlift.sdk.agents import wanted_call
from flowlift.sdk.tracing import current_context, tool_span, workflow_span
from flowlift.sdk.workflow import Workflow

_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=60.0)


_FINAL = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class ToolCall:
    step_id: str
    args: list[Any]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCancelled:
    """The proxy no longer wants the result of the tool call ``step_id`` (``reason``)."""

    step_id: str
    reason: str

    def outcome(self) -> dict[str, Any]:
        """What the call's span records: an error typed ``cancelled``."""
        return {"error": f"cancelled: {self.reason}"}


_STEP_ENDS: dict[str, Callable[[Workflow, dict[str, Any]], None]] = {
    "step.finished": lambda wf, d: wf.record_output(d["step_id"], d["value"]),
    "step.skipped": lambda wf, d: wf.record_skip(d["step_id"], d.get("reason", ""),
                                                 has_value="value" in d,
                                                 value=d.get("value")),
    "step.failed": lambda wf, d: wf.record_failure(d["step_id"], d["error"],
                                                   kind=d.get("kind"),
                                                   attempts=d.get("attempts")),
}
"""How each event that ends a step is recorded on the workflow."""


_OURS = tuple(str(Path(f).parent) + os.sep for f in (__file__, errors_module.__file__))
"""Where flowlift's own frames live (the core and the SDK; the proxy's run elsewhere)."""


def warn_at_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside flowlift: the user's
    ``with workflow(...)`` line, not this module (issue 38, item 6). Frames are walked up
    from here; on a thread flowlift started (an open run's driver) it ends at that
    thread's start."""
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _handle(wf: Workflow, sse: ServerSentEvent) -> ToolCall | ToolCancelled | None:
    if sse.event in ("", "message", "ping") or not sse.data:
        return None
    data = json.loads(sse.data)
    if sse.event in ("run.started", "run.resumed"):
        wf.run_id = data["run_id"]
        wf.status = "running"
        for text in data.get("warnings", ()):  # the compiler's, once per run start
            warn_at_user(f"workflow {wf.name!r}: {text}", PlanWarning)
    elif sse.event in _STEP_ENDS:
        _STEP_ENDS[sse.event](wf, data)
    elif sse.event == "tool.cancelled":
        return ToolCancelled(data["step_id"], str(data.get("reason", "")))
    elif sse.event == "tool.wanted" and "agent_step" in data:
        return ToolCall(data["step_id"], [], wanted_call(wf, data))
    elif sse.event == "tool.wanted" and data["step_id"] not in wf.tools \
            and not wf.adopt_tool(data["step_id"], data.get("name")):
        return None  # an attached run without that function: the step waits for a script
    elif sse.event == "tool.wanted":
        args, kwargs = wf.tool_arguments(data["step_id"], data["args"], data["kwargs"])
        return ToolCall(data["step_id"], args, kwargs)
    elif sse.event == "run.finished":
        for step_id, error in data.get("failures", {}).items():
            if step_id not in wf.failures:
                wf.record_failure(step_id, error)
        wf.finish(data["run_id"], data["status"], data.get("trace", []))
    return None


def _error_from(response_status: int, body: bytes) -> FlowliftError:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        err = None
    if response_status == 401:  # also from a gateway in front answering without JSON
        message = (err or {}).get("message") if isinstance(err, dict) else None
        return AuthenticationError(f"the proxy refused the request (HTTP 401: "
                                   f"{message or 'missing or invalid API key'}); {HINT}",
                                   param="api_key")
    if not isinstance(err, dict):
        return RunError(f"proxy answered HTTP {response_status}: {body[:500]!r}")
    if err.get("code") == "invalid_graph":
        return GraphError(err.get("problems") or [err.get("message", "")])
    if err.get("code") == "run_closed":
        return RunClosed(err.get("message", ""), param=err.get("param"))
    if 400 <= response_status < 500:
        return RequestError(err.get("message", ""), param=err.get("param"))
    return RunError(f"proxy error ({response_status}): {err.get('message')}")


@dataclass(slots=True)
class _Session:
    """Protocol state shared by the sync and async drivers (no I/O here).

    It knows where to (re)connect: ``POST /v1/workflows`` first, then
    ``GET /v1/workflows/{id}/events`` with ``Last-Event-ID`` after a lost connection or
    a proxy restart. Each ``@tool`` step runs once: its result is kept and re-posted if
    the proxy asks again (a resumed run), never recomputed.
    """

    wf: Workflow
    last_id: str | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    lost_at: float | None = None
    trace_headers: dict[str, str] = field(default_factory=dict)  # W3C traceparent
    refused: tuple[int, str, float | None] | None = None
    """The proxy's last 429/503 to the graph itself: status, message, Retry-After (s)."""
    first_body: dict[str, Any] | None = None
    """What to post first instead of the whole graph (an open run's first flush:
    :mod:`flowlift.sdk.open_run`)."""
    on_event: Callable[[], None] | None = None
    """Called after each event is handled (an open run's readers wait on it)."""
    stopped: bool = False
    """Set to stop following the run (an open run abandoned by its block)."""
    tried: int = 0
    """Replicas the graph moved on from because they refused the connection."""
    cancelled: dict[str, ToolCancelled] = field(default_factory=dict)
    """Tool calls the proxy no longer wants (``tool.cancelled``): not run if not
    started, their results never posted."""

    def next_replica(self, exc: Exception | None) -> bool:
        """Move ``wf.base_url`` to the next of ``wf.base_urls`` after a lost connection or
        stream: always once the run has an id (any replica follows it from the shared
        store); before that only when the connection was never made (``ConnectError``:
        nothing was sent), each replica once.

        Returns:
            Whether it moved (the caller points its HTTP client there).
        """
        urls = self.wf.base_urls
        if len(urls) < 2:
            return False
        if self.wf.run_id is None:
            if not isinstance(exc, httpx.ConnectError) or self.tried >= len(urls) - 1:
                return False
            self.tried += 1
        self.wf.base_url = urls[(urls.index(self.wf.base_url) + 1) % len(urls)]
        return True

    def admit(self, status: int, headers: Any, body: Any) -> bool:
        """True for a 200 stream; False to wait and try again (a 5xx or 429, e.g. the
        engine still loading, the proxy overloaded or draining); raises a final error.

        Args:
            body: a callable returning the answer's bytes (read only when not 200).

        Raises:
            FlowliftError: a 4xx, or a 5xx other than 503 to the graph itself (nothing
                was started, and trying again would get the same answer).
        """
        if status == 200:
            self.refused = None
            warning = headers.get(DEADLINE_WARNING_HEADER)
            if warning:  # only the answer to the graph itself carries it
                warn_at_user(warning, DeadlineWarning)
            return True
        if not _retryable(status) or (self.wf.run_id is None and status not in (429, 503)):
            raise _error_from(status, body())
        if self.wf.run_id is None:
            raw = body()
            try:
                message = str(json.loads(raw)["error"]["message"])
            except (ValueError, KeyError, TypeError):
                message = raw[:200].decode(errors="replace")
            try:
                retry_after: float | None = float(headers.get("Retry-After", ""))
            except ValueError:
                retry_after = None
            self.refused = (status, message, retry_after)
        return False

    def request(self) -> tuple[str, str, dict[str, Any]]:
        if self.wf.run_id is None:
            body = self.first_body if self.first_body is not None else self.wf.graph().to_wire()
            return "POST", "/v1/workflows", {"json": body, "headers": self.trace_headers}
        headers = {"Last-Event-ID": self.last_id} if self.last_id else {}
        kwargs: dict[str, Any] = {"headers": {**self.trace_headers, **headers}}
        if self.wf.attached:  # the proxy hands each tool call to one attacher serving it
            kwargs["params"] = {"serve": ",".join(sorted(self.wf.served_tools))}
        return "GET", f"/v1/workflows/{self.wf.run_id}/events", kwargs

    def result_url(self, step_id: str) -> str:
        return f"/v1/workflows/{self.wf.run_id}/steps/{step_id}/result"

    def handle(self, sse: ServerSentEvent) -> ToolCall | ToolCancelled | str | None:
        """A new tool call to run, one to cancel, a step id whose kept result to
        re-post, or None."""
        if sse.id:
            self.last_id = sse.id
        self.lost_at = None
        call = _handle(self.wf, sse)
        if self.on_event is not None:
            self.on_event()
        if isinstance(call, ToolCancelled):
            self.cancelled[call.step_id] = call
            return call
        if call is None or call.step_id in self.cancelled:
            return None
        if call.step_id in self.results:
            return call.step_id
        if call.step_id in self.started:
            return None
        self.started.add(call.step_id)
        return call

    def pending_results(self) -> list[str]:
        """Kept results of tool steps the run has not finished (re-post after a loss)."""
        return [s for s in self.results if not self.wf.has_output(s)]

    @property
    def done(self) -> bool:
        return self.wf.status in _FINAL or self.stopped

    def lost(self, exc: Exception | None) -> float:
        """Seconds to wait before reconnecting; raises when giving up."""
        now = time.monotonic()
        if self.wf.run_id is None:  # the graph was not accepted (yet)
            if exc is not None or self.refused is None:
                raise ProxyUnavailable(self.wf.base_url, f"{type(exc).__name__}: {exc}")
            status, message, retry_after = self.refused
            self.lost_at = self.lost_at or now
            waited = now - self.lost_at
            if waited >= self.wf.reconnect_s:
                raise ProxyUnavailable(self.wf.base_url, f"it answered {status} to the "
                                       f"workflow for {waited:.1f} s: {message}")
            wait = retry_after if retry_after is not None else 1.0
            return max(0.05, min(wait, 5.0, self.wf.reconnect_s - waited))
        self.lost_at = self.lost_at or now
        if now - self.lost_at > self.wf.reconnect_s:
            raise ProxyUnavailable(self.wf.base_url, f"lost the event stream of run "
                                   f"{self.wf.run_id} for {self.wf.reconnect_s:.0f} s")
        return min(0.25 * 2.0 ** min(int(now - self.lost_at), 4), 2.0)


def _tool_result(fn: Any, call: ToolCall) -> dict[str, Any]:
    try:
        value = fn(*call.args, **call.kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_await(value))
        json.dumps(value)
        return {"value": value}
    except Exception as exc:  # the tool's own failure is the step's failure
        return {"error": f"{type(exc).__name__}: {exc}"}


async def _await(aw: Any) -> Any:
    return await aw


def _retryable(status: int) -> bool:
    return status >= 500 or status == 429


def run_sync(wf: Workflow) -> None:
    """Ship ``wf``'s graph and drive the run to its end (blocking), reconnecting when
    the event stream is lost; in an ``invoke_workflow`` span (:mod:`flowlift.sdk.tracing`)."""
    with workflow_span(wf) as trace_headers:
        _run_sync(wf, trace_headers, current_context())


def _run_sync(wf: Workflow, trace_headers: dict[str, str], ctx: Any,
              sess: _Session | None = None) -> None:
    transport = wf.transport if isinstance(wf.transport, httpx.BaseTransport) else None
    sess = sess or _Session(wf, trace_headers=trace_headers)
    with httpx.Client(base_url=wf.base_url, transport=transport, timeout=_TIMEOUT,
                      headers=wf.http_headers()) as client, \
            ThreadPoolExecutor(max_workers=wf.tool_workers) as pool, \
            progress.showing(wf, client):  # a no-op unless progress is wanted

        def post(step_id: str) -> None:
            with contextlib.suppress(httpx.TransportError):  # kept; re-posted on reconnect
                client.post(sess.result_url(step_id), json=sess.results[step_id])

        def dispatch(action: ToolCall | ToolCancelled | str | None) -> None:
            if isinstance(action, ToolCancelled):
                return  # _sync_tool drops its result
            if isinstance(action, ToolCall):
                pool.submit(_sync_tool, sess, action, ctx, post)
            elif action is not None:
                pool.submit(post, action)

        while not sess.done:
            method, url, kwargs = sess.request()
            try:
                with connect_sse(client, method, url, **kwargs) as source:
                    resp = source.response
                    if sess.admit(resp.status_code, resp.headers, resp.read):
                        for step_id in sess.pending_results():
                            dispatch(step_id)
                        _follow(source, sess, dispatch)
            except httpx.TransportError as exc:
                if _moved(sess, client, exc) and wf.run_id is None:
                    continue  # a replica never reached: the next one at once
                time.sleep(sess.lost(exc))
                continue
            if not sess.done:
                _moved(sess, client, None)
                time.sleep(sess.lost(None))
    _require_finished(wf)


def _sync_tool(sess: _Session, call: ToolCall, ctx: Any, post: Callable[[str], None]) -> None:
    """One ``@tool`` call on a worker thread, its result posted unless the proxy
    cancelled the call meanwhile (a thread cannot be stopped: its result is dropped)."""
    if call.step_id in sess.cancelled:  # cancelled before its thread started
        return
    tool = sess.wf.tools[call.step_id]
    with tool_span(sess.wf, call.step_id, tool.name, ctx) as outcome:
        result = _tool_result(tool.fn, call)
        cancelled = sess.cancelled.get(call.step_id)
        outcome(result if cancelled is None else cancelled.outcome())
    if cancelled is None:
        sess.results[call.step_id] = result
        post(call.step_id)


def _moved(sess: _Session, client: httpx.Client | httpx.AsyncClient,
           exc: Exception | None) -> bool:
    """Follow the run on the next replica (:meth:`_Session.next_replica`), if any."""
    if not sess.next_replica(exc):
        return False
    client.base_url = httpx.URL(sess.wf.base_url)
    return True


def _follow(source: Any, sess: _Session, dispatch: Callable[[Any], None]) -> None:
    """Handle one event stream's events until it ends (or the session is stopped)."""
    for sse in source.iter_sse():
        dispatch(sess.handle(sse))
        if sess.stopped:
            return


class _AsyncDriver:
    """The async side of the protocol: one event stream, tool calls as tasks."""

    def __init__(self, wf: Workflow, client: httpx.AsyncClient,
                 trace_headers: dict[str, str] | None = None,
                 sess: _Session | None = None) -> None:
        self.sess = sess or _Session(wf, trace_headers=trace_headers or {})
        self.client = client
        self.pending: set[asyncio.Task[None]] = set()
        self.running: dict[str, asyncio.Task[None]] = {}  # tool calls out, by step id

    async def post(self, step_id: str) -> None:
        with contextlib.suppress(httpx.TransportError):  # kept; re-posted on reconnect
            await self.client.post(self.sess.result_url(step_id),
                                   json=self.sess.results[step_id])

    async def run_tool(self, call: ToolCall) -> None:
        tool = self.sess.wf.tools[call.step_id]
        fn = tool.fn
        with tool_span(self.sess.wf, call.step_id, tool.name) as outcome:
            try:
                if inspect.iscoroutinefunction(fn):
                    result = await _atool_result(fn, call)
                else:
                    result = await asyncio.to_thread(_tool_result, fn, call)
            except asyncio.CancelledError:
                cancelled = self.sess.cancelled.get(call.step_id)
                if cancelled is None:  # the driver is stopping: not the proxy's cancel
                    raise
                outcome(cancelled.outcome())  # the proxy's tool.cancelled: dropped
                return
            finally:
                self.running.pop(call.step_id, None)
            outcome(result)
        self.sess.results[call.step_id] = result
        await self.post(call.step_id)

    def dispatch(self, action: ToolCall | ToolCancelled | str | None) -> None:
        if action is None:
            return
        if isinstance(action, ToolCancelled):
            running = self.running.get(action.step_id)
            if running is not None:
                running.cancel()  # an async tool stops at its next await
            return
        task = asyncio.create_task(self.run_tool(action) if isinstance(action, ToolCall)
                                   else self.post(action))
        if isinstance(action, ToolCall):
            self.running[action.step_id] = task
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def attempt(self) -> None:
        method, url, kwargs = self.sess.request()
        async with aconnect_sse(self.client, method, url, **kwargs) as source:
            resp = source.response
            body = b"" if resp.status_code == 200 else await resp.aread()
            if self.sess.admit(resp.status_code, resp.headers, lambda: body):
                for step_id in self.sess.pending_results():
                    self.dispatch(step_id)
                async for sse in source.aiter_sse():
                    self.dispatch(self.sess.handle(sse))

    async def run(self) -> None:
        try:
            while not self.sess.done:
                try:
                    await self.attempt()
                except httpx.TransportError as exc:
                    if _moved(self.sess, self.client, exc) and self.sess.wf.run_id is None:
                        continue  # a replica never reached: the next one at once
                    await asyncio.sleep(self.sess.lost(exc))
                    continue
                if not self.sess.done:
                    _moved(self.sess, self.client, None)
                    await asyncio.sleep(self.sess.lost(None))
        finally:
            for task in self.pending:
                task.cancel()


async def run_async(wf: Workflow) -> None:
    """Ship ``wf``'s graph and drive the run to its end (async), reconnecting when the
    event stream is lost."""
    transport = wf.transport if isinstance(wf.transport, httpx.AsyncBaseTransport) else None
    with workflow_span(wf) as trace_headers:
        async with httpx.AsyncClient(base_url=wf.base_url, transport=transport,
                                     timeout=_TIMEOUT, headers=wf.http_headers()) as client, \
                progress.tracking(wf, client):
            await _AsyncDriver(wf, client, trace_headers).run()
    _require_finished(wf)


async def _atool_result(fn: Any, call: ToolCall) -> dict[str, Any]:
    try:
        value = await fn(*call.args, **call.kwargs)
        json.dumps(value)
        return {"value": value}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _require_finished(wf: Workflow) -> None:
    if wf.status not in _FINAL:
        raise RunError(f"the proxy closed the event stream of run {wf.run_id} before it "
                       "finished; see the proxy's log")
