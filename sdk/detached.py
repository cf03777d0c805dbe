"""Detached runs: submit a graph and leave; follow a run later from anywhere.

* :func:`submit_detached` (``workflow(..., detach=True)`` at block exit) posts the
  graph with ``"detached": true`` and returns once the proxy has started the run: the
  proxy never cancels it for want of a listener and runs it on after a restart.
* :func:`attach` / :func:`aattach` follow a run by id (its events replayed from the
  start, ``GET /v1/workflows/{run_id}/events``) and return a :class:`Workflow` whose
  ``.outputs`` and ``.value(step_id)`` hold the results; a failed run raises
  :class:`~flowlift.errors.WorkflowFailed` as a normal run does.

``@tool`` steps of a detached run need a client that has the functions: they wait (the
run's trace marks them ``waiting_tool``) until a script runs them. ``attach(run_id,
tools=[fn, ...])`` serves them: a ``tool.wanted`` event names the tool, the function of
that name runs (one attacher gets each call: the proxy hands it to the first serving
that tool and offers it to the next if that one's stream ends unanswered) with its JSON
arguments parsed by its annotations
(:meth:`~flowlift.sdk.steps.Tool.parse_arguments`: a dict into the pydantic model it
asks for), and its result is posted as a normal run's is. Steps already finished when
the attach starts (read from ``GET /v1/workflows/{run_id}`` first) are never run again.
Without ``tools`` an attached object leaves them waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx
from httpx_sse import aconnect_sse, connect_sse

from flowlift.sdk.client import (
    _TIMEOUT,
    _AsyncDriver,
    _error_from,
    _moved,
    _require_finished,
    _run_sync,
    _Session,
)
from flowlift.sdk.steps import Tool
from flowlift.sdk.workflow import Workflow


def submit_detached(wf: Workflow) -> str:
    """Post ``wf``'s graph (detached) and return its run id as soon as the run started.

    Raises:
        RequestError, GraphError, AuthenticationError: the proxy refused the graph.
        RunError: no run started within ``wf.reconnect_s`` seconds.
    """
    transport = wf.transport if isinstance(wf.transport, httpx.BaseTransport) else None
    sess = _Session(wf)
    with httpx.Client(base_url=wf.base_url, transport=transport, timeout=_TIMEOUT,
                      headers=wf.http_headers()) as client:
        while wf.run_id is None:
            method, url, kwargs = sess.request()
            try:
                with connect_sse(client, method, url, **kwargs) as source:
                    resp = source.response
                    if sess.admit(resp.status_code, resp.headers, resp.read):
                        for sse in source.iter_sse():
                            sess.handle(sse)
                            if wf.run_id is not None:
                                break
            except httpx.TransportError as exc:
                if not _moved(sess, client, exc):  # (a replica never reached: the next one)
                    time.sleep(sess.lost(exc))
                continue
            if wf.run_id is None:
                time.sleep(sess.lost(None))
    return wf.run_id


async def asubmit_detached(wf: Workflow) -> str:
    """:func:`submit_detached` for async code."""
    transport = (wf.transport if isinstance(wf.transport, httpx.AsyncBaseTransport)
                 else None)
    sess = _Session(wf)
    async with httpx.AsyncClient(base_url=wf.base_url, transport=transport,
                                 timeout=_TIMEOUT, headers=wf.http_headers()) as client:
        while wf.run_id is None:
            method, url, kwargs = sess.request()
            try:
                async with aconnect_sse(client, method, url, **kwargs) as source:
                    resp = source.response
                    body = b"" if resp.status_code == 200 else await resp.aread()
                    if sess.admit(resp.status_code, resp.headers, lambda b=body: b):
                        async for sse in source.aiter_sse():
                            sess.handle(sse)
                            if wf.run_id is not None:
                                break
            except httpx.TransportError as exc:
                if not _moved(sess, client, exc):  # (a replica never reached: the next one)
                    await asyncio.sleep(sess.lost(exc))
                continue
            if wf.run_id is None:
                await asyncio.sleep(sess.lost(None))
    return wf.run_id


def _attached(run_id: str, base_url: str | Sequence[str] | None, api_key: str | None,
              transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None,
              reconnect_s: float, tools: Sequence[Tool[Any, Any]] = ()) -> Workflow:
    wf = Workflow(run_id, base_url=base_url, api_key=api_key, transport=transport,
                  submit=False, reconnect_s=reconnect_s, progress=False)
    wf.run_id, wf.status = run_id, "running"
    wf.served_tools = {t.name: t for t in tools}
    wf.attached = True
    return wf


def _settled(wf: Workflow, response: httpx.Response) -> None:
    """Record the outputs and failures ``GET /v1/workflows/{id}`` answered, so the
    replayed ``tool.wanted`` of a step already done is not run again.

    Raises:
        RequestError: no such run (HTTP 404), or another refusal.
    """
    if response.status_code != 200:
        raise _error_from(response.status_code, response.content)
    doc = response.json()
    for step_id, value in (doc.get("outputs") or {}).items():
        wf.record_output(step_id, value)
    for step_id, error in (doc.get("failures") or {}).items():
        wf.record_failure(step_id, error)
    for step_id, reason in (doc.get("skipped") or {}).items():
        wf.record_skip(step_id, reason)


def attach(run_id: str, *, base_url: str | Sequence[str] | None = None,
           api_key: str | None = None,
           transport: httpx.BaseTransport | None = None,
           reconnect_s: float = 300.0, tools: Sequence[Tool[Any, Any]] = ()) -> Workflow:
    """Follow run ``run_id`` to its end (blocking) and return it with its outputs.

    Args:
        run_id: the run's id (``wf.run_id`` of the detached workflow, ``flowlift runs``).
        base_url: the proxy (default ``$FLOWLIFT_BASE_URL`` or ``http://127.0.0.1:8470``),
            or several replicas on one shared run store (a list: a lost stream moves to
            the next, which follows the run from the store).
        api_key: the proxy's API key (default ``$FLOWLIFT_API_KEY``).
        transport: an ``httpx`` transport (tests inject one).
        reconnect_s: how long to keep reconnecting after a lost event stream.
        tools: ``@tool`` functions to serve the run's tool steps with, matched by name
            (see the module docstring); empty: they keep waiting.

    Returns:
        The finished run: ``.outputs`` ({step_id: raw value}), ``.value(step_id)``,
        ``.status``, ``.trace``.

    Raises:
        RequestError: no such run (HTTP 404).
        WorkflowFailed: some step failed (``.failures`` says which and why).
        RunError: the event stream ended before the run did.
    """
    wf = _attached(run_id, base_url, api_key, transport, reconnect_s, tools)
    if tools:
        with httpx.Client(base_url=wf.base_url, transport=transport, timeout=_TIMEOUT,
                          headers=wf.http_headers()) as client:
            _settled(wf, client.get(f"/v1/workflows/{run_id}"))
    _run_sync(wf, {}, None)
    wf._check_failed()
    return wf


async def aattach(run_id: str, *, base_url: str | Sequence[str] | None = None,
                  api_key: str | None = None,
                  transport: httpx.AsyncBaseTransport | None = None,
                  reconnect_s: float = 300.0,
                  tools: Sequence[Tool[Any, Any]] = ()) -> Workflow:
    """:func:`attach` for async code (same arguments, result and errors)."""
    wf = _attached(run_id, base_url, api_key, transport, reconnect_s, tools)
    async with httpx.AsyncClient(base_url=wf.base_url, transport=transport,
                                 timeout=_TIMEOUT, headers=wf.http_headers()) as client:
        if tools:
            _settled(wf, await client.get(f"/v1/workflows/{run_id}"))
        await _AsyncDriver(wf, client).run()
    _require_finished(wf)
    wf._check_failed()
    return wf
