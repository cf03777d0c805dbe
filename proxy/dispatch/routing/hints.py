"""Hints the engines understand: what flowlift's scheduler knows about a workflow step,
written into its upstream request in each engine's own field, for the backends whose
config opts in (``hints = [...]`` on an ``openai`` backend; none by default).

* ``"vllm-priority"``: vLLM's ``priority`` request field (lower is handled earlier;
  honoured by servers started with ``--scheduling-policy priority``; vLLM 0.32 ignores
  it on the others, older releases refused a non-zero value, and other OpenAI-compatible
  servers may refuse a field they do not know, hence opt-in). The value is flowlift's
  own queue order as one integer
  (:meth:`~flowlift.proxy.dispatch.slots.scheduler.Priority.engine_priority`: interactive
  before batch, then the longest remaining critical path), the same number
  the embedded vLLM engine gets.
* ``"sglang-session"``: the top-level ``session_id`` of SGLang (``GenerateReqInput``),
  the run id, on every turn of the run (a drop-in request: its ``X-Flowlift-Session``
  or joined workflow id); the session is opened on each opted-in replica of the route
  with ``POST /open_session`` before its first request there and closed with ``POST
  /close_session`` when the run ends (:class:`SessionBook`; a drop-in session by
  SGLang's own ``timeout``).
* ``"dynamo"``: NVIDIA Dynamo's ``nvext.agent_hints``: ``priority`` (Dynamo's scale:
  *higher* is more important, an i32, so flowlift's order negated), ``osl`` (the
  step's expected output tokens: the plan's learned median, its contract's bound or its
  ``max_tokens``) and ``speculative_prefill`` (true on an agent step's turn: the next
  turn's prefix is this turn's conversation plus its answer, which Dynamo prefills on
  the worker once this turn ends).

The routers in front of a fleet (vllm-router, llm-d, Dynamo's session headers, SGLang's
gateway, vLLM's ``session_id``) have adapters of their own in :mod:`.fleet_hints`, merged
here (:func:`hint_fields`, :func:`hint_headers`).

A field the request already holds is never overridden (a client's own ``priority`` or
``nvext.agent_hints`` key wins). :func:`hint_fields` is pure; :class:`SessionBook` does
the session I/O. Sources: vLLM ``vllm/entrypoints/openai/protocol.py``
(``ChatCompletionRequest.priority``); SGLang ``python/sglang/srt/managers/io_struct.py``
(``OpenSessionReqInput``, ``CloseSessionReqInput``) and ``http_server.py``
(``/open_session``, ``/close_session``); Dynamo "Agent Hints"
(docs.nvidia.com/dynamo/latest/user-guides/agents/agent-hints) and
``lib/llm/src/protocols/openai/nvext.rs`` (``AgentHints``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import orjson
from cachetools import TTLCache

from flowlift.proxy.config import Hint, UpstreamSpec
from flowlift.proxy.dispatch.routing.fleet_hints import (
    StepHints,
    fleet_fields,
    fleet_headers,
    i32,
)
from flowlift.proxy.dispatch.upstream.http import TRANSPORT_ERRORS
from flowlift.proxy.dispatch.upstream.provider import Upstream
from flowlift.tracing import get_logger

log = get_logger("flowlift.proxy.dispatch.routing.hints")

SESSION_CAPACITY_CHARS: Final = 1 << 20
"""``capacity_of_str_len`` of an opened SGLang session (characters of context it may
grow to; SGLang requires the field)."""
SESSION_TIMEOUT_S: Final = 1800.0
"""``timeout`` of an opened SGLang session, so that SGLang closes it on its own should
nobody close it (a drop-in session, a run whose proxy died); read as an idle timeout
(flowlift forgets a session 10% sooner after its last use and opens it again). Servers
older than the field ignore it."""


def hint_fields(spec: UpstreamSpec, hints: StepHints, body: Mapping[str, Any], *,
                session_open: bool = False) -> dict[str, Any]:
    """The body fields ``spec``'s opted-in hints add to ``body`` (empty: none).

    Args:
        spec: the backend the attempt goes to; only its ``hints`` are written.
        hints: what the scheduler knows about the request.
        body: the request body (fields already there win).
        session_open: the SGLang session ``hints.session_id`` is open on this backend.

    Returns:
        Top-level fields to merge into the body (``nvext`` and ``vllm_xargs`` merged
        with the body's own; the routers' fields: :func:`.fleet_hints.fleet_fields`).
    """
    out: dict[str, Any] = {}
    if "vllm-priority" in spec.hints and hints.priority is not None and "priority" not in body:
        out["priority"] = hints.priority
    if ("sglang-session" in spec.hints and session_open and hints.session_id
            and "session_id" not in body):
        out["session_id"] = hints.session_id
    agent = _agent_hints(hints) if "dynamo" in spec.hints else {}
    if agent:
        nvext = body.get("nvext")
        nvext = dict(nvext) if isinstance(nvext, Mapping) else {}
        theirs = nvext.get("agent_hints")
        nvext["agent_hints"] = {**agent, **(theirs if isinstance(theirs, Mapping) else {})}
        out["nvext"] = nvext
    out.update(fleet_fields(spec, hints, {**body, **out}))
    return out


def hint_headers(spec: UpstreamSpec, hints: StepHints) -> dict[str, str]:
    """The request headers ``spec``'s opted-in hints add (:func:`.fleet_hints.fleet_headers`;
    empty: none)."""
    return fleet_headers(spec, hints) if spec.hints else {}


def _agent_hints(hints: StepHints) -> dict[str, Any]:
    """Dynamo's ``agent_hints`` for ``hints`` (its priority scale is flowlift's reversed)."""
    agent: dict[str, Any] = {}
    if hints.priority is not None:
        agent["priority"] = i32(-hints.priority)
    if hints.expected_output_tokens is not None:
        agent["osl"] = max(int(hints.expected_output_tokens), 1)
    if hints.next_turn:
        agent["speculative_prefill"] = True
    return agent


def server_root(base_url: str) -> str:
    """An OpenAI-compatible server's root (``base_url`` less a trailing ``/v1``): where
    SGLang serves ``/open_session`` and ``/close_session``."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


class SessionBook:
    """The SGLang sessions flowlift opened: per session id, the backends it is open on.

    Args:
        max_sessions: (backend, session) pairs remembered at most (least recent go).
        timer: the clock of the entries' lifetime (tests).

    Opening is once per (backend, session), shared by concurrent steps; a backend that
    fails to open one (an older server, an error) gets no ``session_id`` for it, and the
    request goes on without the hint. Every call here logs its failures and never
    raises: a hint is never worth a failed step.
    """

    def __init__(self, max_sessions: int = 100_000,
                 timer: Callable[[], float] = time.monotonic) -> None:
        # bounded: drop-in sessions are never ended here (SGLang's timeout closes them);
        # an entry lives a little less than that timeout after its last use
        self._opening: TTLCache[tuple[str, str], asyncio.Task[bool]] = TTLCache(
            maxsize=max_sessions, ttl=SESSION_TIMEOUT_S * 0.9, timer=timer)
        self._closing: set[asyncio.Task[None]] = set()

    async def open(self, upstreams: Iterable[Upstream], session_id: str) -> None:
        """Open ``session_id`` on each of ``upstreams`` that opts in to
        ``"sglang-session"`` and has not opened it yet (concurrently)."""
        waits = []
        for up in upstreams:  # no await unless one opts in: the drop-in hot path
            if "sglang-session" not in up.spec.hints:
                continue
            key = (up.name, session_id)
            task = self._opening.get(key)
            if task is None:
                task = asyncio.ensure_future(_open(up, session_id))
            self._opening[key] = task  # (again: a use restarts the entry's time)
            waits.append(task)
        if waits:
            await asyncio.gather(*(asyncio.shield(t) for t in waits))

    def is_open(self, upstream: str, session_id: str | None) -> bool:
        """Whether ``session_id`` is open on backend ``upstream``."""
        if session_id is None:
            return False
        task = self._opening.get((upstream, session_id))
        return task is not None and task.done() and not task.cancelled() and task.result()

    def end(self, session_id: str, upstreams: Mapping[str, Upstream]) -> None:
        """Close ``session_id`` wherever it was opened (in the background; see
        :meth:`aclose`). Unknown ids are ignored."""
        for key in [k for k in list(self._opening) if k[1] == session_id]:
            task = self._opening.pop(key, None)
            if task is None:
                continue
            up = upstreams.get(key[0])
            if up is None:
                continue
            closing = asyncio.ensure_future(_close_after(task, up, session_id))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """Wait for the closes under way (the proxy is stopping)."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


async def _post(up: Upstream, path: str, doc: dict[str, Any]) -> int:
    """The HTTP status of a POST of ``doc`` to ``path`` on ``up``'s server (its body
    read and dropped, so the connection goes back to the pool)."""
    async with asyncio.timeout(up.spec.first_token_timeout_s):
        response = await up.post_at(server_root(up.spec.base_url) + path, orjson.dumps(doc))
        try:
            await response.read()
        finally:
            await response.aclose()
    return response.status


async def _open(up: Upstream, session_id: str) -> bool:
    try:
        status = await _post(up, "/open_session", {
            "capacity_of_str_len": SESSION_CAPACITY_CHARS, "session_id": session_id,
            "timeout": SESSION_TIMEOUT_S})
    except TRANSPORT_ERRORS as exc:
        log.warning("sglang_session_open_failed", backend=up.name, session_id=session_id,
                    error=type(exc).__name__)
        return False
    if status != 200:
        log.warning("sglang_session_open_failed", backend=up.name, session_id=session_id,
                    status=status)
        return False
    return True


async def _close_after(opening: asyncio.Task[bool], up: Upstream, session_id: str) -> None:
    try:
        if not await opening:
            return
        status = await _post(up, "/close_session", {"session_id": session_id})
    except TRANSPORT_ERRORS as exc:
        log.warning("sglang_session_close_failed", backend=up.name, session_id=session_id,
                    error=type(exc).__name__)
        return
    if status != 200:
        log.warning("sglang_session_close_failed", backend=up.name, session_id=session_id,
                    status=status)


__all__ = ["SESSION_CAPACITY_CHARS", "SESSION_TIMEOUT_S", "Hint", "SessionBook", "StepHints",
           "hint_fields", "hint_headers", "server_root"]
