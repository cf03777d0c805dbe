"""Open runs: reading a value inside the ``with workflow(...)`` block.

::

    async with workflow("agent") as wf:
        answer = think(question)
        while "DONE" not in (text := await answer):   # ships think_1, waits for it
            answer = think(f"{question}\\n{text}")     # joins the same run

Nothing waits until a value is read (``await var`` in ``async with``, ``var.get()`` in
``with``). The first read starts the run with every step recorded so far
(``POST /v1/workflows`` with ``"open": true``; the SDK then follows its event stream in
the background, running ``@tool`` steps as usual); each later read ships the steps
recorded since the last one in one request (``POST /v1/workflows/{run_id}/nodes``), so
the proxy sees everything the app wrote before any value is needed (Parrot, OSDI'24).
Each read names the step it waits for (``"awaited"``): the proxy runs it ahead of the
rest. At the block's end what is left is shipped, the run is closed
(``POST .../close``) and the SDK waits for it to finish, as for a run shipped whole.

A workflow with no read inside its block never opens: one ``POST`` at the end, as always.

The sync form follows the stream in a thread of its own (the app's code runs between
reads); the async form in a task on the app's event loop. A flush that meets a lost
connection or a restarting proxy (5xx, 429) is sent again for ``reconnect_s`` seconds;
the proxy skips nodes it already holds, so a re-sent flush appends nothing twice. With
several replicas (``base_url=[...]``) a flush goes where the event stream is followed
now; a replica that does not run the run keeps it for the one that does.

Errors raised by a read:
    GraphError: the proxy rejected the steps of this flush (every problem listed); the
        run goes on without them: they count as failed steps (reading one raises
        StepFailed, the block's end WorkflowFailed). The first flush alike: a refused
        graph starts no run, its steps fail, and the next read starts the run with the
        steps recorded since; a block whose every step was refused raises that
        GraphError again at its end.
    RunClosed: the run ended already (cancelled, deadline passed).
    StepFailed: the step read (or one it depends on) failed.
    ProxyUnavailable: the proxy could not be reached for ``reconnect_s`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

import httpx

from flowlift.errors import GraphError, ProxyUnavailable, RunError
from flowlift.sdk import progress
from flowlift.sdk.client import (
    _FINAL,
    _TIMEOUT,
    _AsyncDriver,
    _error_from,
    _require_finished,
    _retryable,
    _run_sync,
    _Session,
)
from flowlift.sdk.tracing import OpenWorkflowSpan

if TYPE_CHECKING:
    from flowlift.sdk.variables import SemanticVariable
    from flowlift.sdk.workflow import Workflow

_STARTED_WAIT_S = 5.0  # how long an abandoned block waits for its run's id, to cancel it


class _Flushes:
    """What the proxy has not seen yet (no I/O): the steps recorded since the last flush."""

    def __init__(self, wf: Workflow) -> None:
        self.wf = wf
        self.shipped = 0
        self.refusal: GraphError | None = None  # the proxy's last, while no run started

    def first(self, awaited: list[str]) -> tuple[dict[str, Any], int]:
        """The body of ``POST /v1/workflows``: the graph so far, open (the steps of a
        refused first flush left out), and how many steps it ships (count them with
        :meth:`sent` once the run started).

        Raises:
            GraphError: nothing left to ship: every step recorded was refused (the
                proxy's last refusal again: the workflow is wholly invalid).
        """
        nodes = tuple(self.wf.nodes[self.shipped:])
        if not nodes and self.refusal is not None:
            raise self.refusal
        body = self.wf.graph().model_copy(update={"nodes": nodes, "open": True}).to_wire()
        if awaited:
            body["awaited"] = awaited
        return body, len(nodes)

    def next(self, awaited: list[str]) -> tuple[dict[str, Any] | None, int]:
        """The body of the next ``POST .../nodes`` (None: nothing to send) and how many
        steps it ships (count them with :meth:`sent` once the proxy took them)."""
        nodes = self.wf.nodes[self.shipped:]
        if not nodes and not awaited:
            return None, 0
        return {"nodes": [n.model_dump(mode="json", by_alias=True) for n in nodes],
                "awaited": awaited}, len(nodes)

    def sent(self, count: int) -> None:
        self.shipped += count

    def rejected(self, count: int, error: GraphError) -> None:
        """The proxy refused the next ``count`` steps: they fail here (reading one raises
        StepFailed; the block's end, WorkflowFailed) and are never sent again."""
        for node in self.wf.nodes[self.shipped:self.shipped + count]:
            self.wf.record_failure(node.id, f"rejected by the proxy: {error.message}")
        self.shipped += count
        if self.wf.run_id is None:
            self.refusal = error


class _Backoff:
    """When to send a refused or lost flush again; gives up after ``reconnect_s``."""

    def __init__(self, wf: Workflow) -> None:
        self.wf = wf
        self.since: float | None = None

    def wait_s(self, response: httpx.Response | None, exc: Exception | None) -> float:
        """Seconds to wait before sending again.

        Raises:
            FlowliftError: the proxy's final answer (a 4xx but 429: the request is wrong).
            ProxyUnavailable: no answer worth having for ``reconnect_s`` seconds.
        """
        if response is not None and not _retryable(response.status_code):
            raise _error_from(response.status_code, response.content)
        now = time.monotonic()
        self.since = self.since or now
        if now - self.since > self.wf.reconnect_s:
            why = (f"{type(exc).__name__}: {exc}" if exc is not None else
                   f"it answered {response.status_code if response else '?'}")
            raise ProxyUnavailable(self.wf.base_url, f"run {self.wf.run_id}: {why}")
        return min(0.25 * 2.0 ** min(int(now - self.since), 4), 2.0)


def _aim(client: httpx.Client | httpx.AsyncClient, wf: Workflow) -> None:
    """Send to the replica the run's event stream follows now (``wf.base_url`` moves on
    when a stream is lost: :meth:`flowlift.sdk.client._Session.next_replica`); any
    replica on the shared store takes an append or a close."""
    if str(client.base_url).rstrip("/") != wf.base_url:
        client.base_url = httpx.URL(wf.base_url)


def _ok(response: httpx.Response | None) -> bool:
    return response is not None and response.status_code < 400


class SyncOpenRun:
    """The open run of a ``with workflow(...)`` block; the event stream is followed in a
    daemon thread (:func:`flowlift.sdk.client._run_sync`)."""

    def __init__(self, wf: Workflow) -> None:
        self.wf = wf
        self.flushes = _Flushes(wf)
        self.span = OpenWorkflowSpan(wf)
        self.changed = threading.Condition()
        self.lock = threading.Lock()  # one flush at a time, in order
        self.error: BaseException | None = None
        self.sess = _Session(wf, trace_headers=self.span.headers, on_event=self._notify)
        self.thread: threading.Thread | None = None
        transport = wf.transport if isinstance(wf.transport, httpx.BaseTransport) else None
        self.client = httpx.Client(base_url=wf.base_url, transport=transport, timeout=_TIMEOUT,
                                   headers={**wf.http_headers(), **self.span.headers})

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def _follow(self) -> None:
        try:
            _run_sync(self.wf, self.span.headers, self.span.context, self.sess)
        except BaseException as exc:  # handed to the reader (and the block's exit)
            self.error = exc
        finally:
            self._notify()

    def _check(self, var: SemanticVariable | None = None) -> None:
        """Raise what ended the run's stream, if it ended without ``var``."""
        if self.error is not None:
            raise self.error
        over = self.thread is None or not self.thread.is_alive() or self.wf.status in _FINAL
        if over and (var is None or not var.ready):
            raise RunError(f"run {self.wf.run_id} of workflow {self.wf.name!r} ended "
                           f"({self.wf.status})" + (f" before step {var.step_id!r} had an "
                                                    "output" if var is not None else ""))

    def _wait(self, ready: Any, var: SemanticVariable | None = None) -> None:
        with self.changed:
            while not ready():
                self._check(var)
                self.changed.wait(timeout=0.5)

    def read(self, var: SemanticVariable) -> Any:
        """Flush, wait for ``var``'s step, return its value (parsed like ``.value``)."""
        self.flush([] if var.ready else [var.step_id])
        self._wait(lambda: var.ready, var)
        return var.value

    def flush(self, awaited: list[str]) -> None:
        """Ship the steps the proxy has not seen (starting the run on the first call)."""
        with self.lock:
            if self.thread is None:
                self._start(awaited)
                return
            self._wait(lambda: self.wf.run_id is not None)
            body, count = self.flushes.next(awaited)
            if body is not None:
                try:
                    self._post(f"/v1/workflows/{self.wf.run_id}/nodes", body)
                except GraphError as exc:
                    self.flushes.rejected(count, exc)
                    raise
                self.flushes.sent(count)

    def _start(self, awaited: list[str]) -> None:
        """Start the run with the steps so far. A graph the proxy refuses starts nothing:
        its steps fail as a rejected later flush's do, and the next flush starts the
        run with the steps recorded since."""
        self.sess.first_body, count = self.flushes.first(awaited)
        self.error = None
        self.thread = threading.Thread(target=self._follow, daemon=True,
                                       name=f"flowlift run {self.wf.name}")
        self.thread.start()
        try:
            self._wait(lambda: self.wf.run_id is not None)
        except GraphError as exc:
            if self.wf.run_id is not None:
                raise
            self.thread.join()
            self.thread, self.error = None, None
            self.flushes.rejected(count, exc)
            raise
        self.flushes.sent(count)

    def _post(self, url: str, body: dict[str, Any]) -> None:
        backoff = _Backoff(self.wf)
        while True:
            response, error = None, None
            try:
                _aim(self.client, self.wf)
                response = self.client.post(url, json=body)
            except httpx.TransportError as exc:
                error = exc
            if _ok(response):
                return
            time.sleep(backoff.wait_s(response, error))

    def finish(self) -> None:
        """At the block's end: ship what is left, close the run, wait for it to finish.

        Raises:
            FlowliftError: what ended the run's stream, or a rejected last flush.
        """
        try:
            self.flush([])
            self._post(f"/v1/workflows/{self.wf.run_id}/close", {})
        except BaseException as exc:  # the run cannot end well: cancel it, stop following
            self.abandon(exc)
            raise
        try:
            assert self.thread is not None
            self.thread.join()
            self._check_error()
            _require_finished(self.wf)
        except BaseException as exc:
            self.span.end(exc)
            raise
        else:
            self.span.end()
        finally:
            self.client.close()

    def _check_error(self) -> None:
        if self.error is not None:
            raise self.error

    def abandon(self, exc: BaseException | None) -> None:
        """The block raised: cancel the run (best effort) and stop following it."""
        self.sess.stopped = True
        with self.changed:
            self.changed.wait_for(lambda: self.wf.run_id is not None or self.thread is None
                                  or not self.thread.is_alive(), timeout=_STARTED_WAIT_S)
        if self.wf.run_id is not None and self.wf.status not in _FINAL:
            with contextlib.suppress(httpx.HTTPError):
                self.client.delete(f"/v1/workflows/{self.wf.run_id}")
        if self.thread is not None:
            self.thread.join(timeout=_STARTED_WAIT_S)
        self.client.close()
        self.span.end(exc)


class AsyncOpenRun:
    """The open run of an ``async with workflow(...)`` block; the event stream is
    followed by a task on the app's event loop (:class:`flowlift.sdk.client._AsyncDriver`)."""

    def __init__(self, wf: Workflow) -> None:
        self.wf = wf
        self.flushes = _Flushes(wf)
        self.span = OpenWorkflowSpan(wf)
        self.changed = asyncio.Event()
        self.lock = asyncio.Lock()  # one flush at a time, in order
        self.sess = _Session(wf, trace_headers=self.span.headers, on_event=self.changed.set)
        self.task: asyncio.Task[None] | None = None
        transport = (wf.transport if isinstance(wf.transport, httpx.AsyncBaseTransport)
                     else None)
        self.client = httpx.AsyncClient(base_url=wf.base_url, transport=transport,
                                        timeout=_TIMEOUT,
                                        headers={**wf.http_headers(), **self.span.headers})

    async def _follow(self) -> None:
        try:
            async with progress.tracking(self.wf, self.client):
                await _AsyncDriver(self.wf, self.client, sess=self.sess).run()
        finally:
            self.changed.set()

    def _check(self, var: SemanticVariable | None = None) -> None:
        if self.task is not None and self.task.done() and not self.task.cancelled():
            error = self.task.exception()
            if error is not None:
                raise error
        over = self.task is None or self.task.done() or self.wf.status in _FINAL
        if over and (var is None or not var.ready):
            raise RunError(f"run {self.wf.run_id} of workflow {self.wf.name!r} ended "
                           f"({self.wf.status})" + (f" before step {var.step_id!r} had an "
                                                    "output" if var is not None else ""))

    async def _wait(self, ready: Any, var: SemanticVariable | None = None) -> None:
        while True:
            self.changed.clear()
            if ready():
                return
            self._check(var)
            waiter = asyncio.ensure_future(self.changed.wait())
            try:
                assert self.task is not None
                await asyncio.wait({waiter, self.task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()

    async def read(self, var: SemanticVariable) -> Any:
        """Flush, wait for ``var``'s step, return its value (parsed like ``.value``)."""
        await self.flush([] if var.ready else [var.step_id])
        await self._wait(lambda: var.ready, var)
        return var.value

    async def flush(self, awaited: list[str]) -> None:
        """Ship the steps the proxy has not seen (starting the run on the first call)."""
        async with self.lock:
            if self.task is None:
                await self._start(awaited)
                return
            await self._wait(lambda: self.wf.run_id is not None)
            body, count = self.flushes.next(awaited)
            if body is not None:
                try:
                    await self._post(f"/v1/workflows/{self.wf.run_id}/nodes", body)
                except GraphError as exc:
                    self.flushes.rejected(count, exc)
                    raise
                self.flushes.sent(count)

    async def _start(self, awaited: list[str]) -> None:
        """As :meth:`SyncOpenRun._start`: a refused first graph starts nothing."""
        self.sess.first_body, count = self.flushes.first(awaited)
        self.task = asyncio.create_task(self._follow(), name=f"flowlift run {self.wf.name}")
        try:
            await self._wait(lambda: self.wf.run_id is not None)
        except GraphError as exc:
            if self.wf.run_id is not None:
                raise
            self.task = None
            self.flushes.rejected(count, exc)
            raise
        self.flushes.sent(count)

    async def _post(self, url: str, body: dict[str, Any]) -> None:
        backoff = _Backoff(self.wf)
        while True:
            response, error = None, None
            try:
                _aim(self.client, self.wf)
                response = await self.client.post(url, json=body)
            except httpx.TransportError as exc:
                error = exc
            if _ok(response):
                return
            await asyncio.sleep(backoff.wait_s(response, error))

    async def finish(self) -> None:
        """At the block's end: ship what is left, close the run, wait for it to finish.

        Raises:
            FlowliftError: what ended the run's stream, or a rejected last flush.
        """
        try:
            await self.flush([])
            await self._post(f"/v1/workflows/{self.wf.run_id}/close", {})
        except BaseException as exc:  # the run cannot end well: cancel it, stop following
            await self.abandon(exc)
            raise
        try:
            assert self.task is not None
            await self.task
            _require_finished(self.wf)
        except BaseException as exc:
            self.span.end(exc)
            raise
        else:
            self.span.end()
        finally:
            await self.client.aclose()

    async def abandon(self, exc: BaseException | None) -> None:
        """The block raised: cancel the run (best effort) and stop following it."""
        self.sess.stopped = True
        if self.wf.run_id is not None and self.wf.status not in _FINAL:
            with contextlib.suppress(httpx.HTTPError):
                await self.client.delete(f"/v1/workflows/{self.wf.run_id}")
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task})
        await self.client.aclose()
        self.span.end(exc)
