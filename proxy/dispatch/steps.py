"""Where one generation of a workflow step runs, decided once, above the engines.

The step's model has a :class:`~flowlift.proxy.dispatch.routing.routing.Route`. A route with
embedded backends only runs on the embedded engine. Otherwise the route's rules choose
(replica affinity by the run id, least load, fallbacks, retries with ``Retry-After``;
:func:`~flowlift.proxy.dispatch.upstream.attempts.open_answer`): an upstream attempt first waits
for a slot of the route's upstream pool, and a choice of the embedded engine -- a
replica, or the fallback after upstream failures -- takes the embedded backend's
priority slots like every other request there (class caps, prefill budget). Either way
the step's priority orders the wait, and the engine or upstream stream is closed on
every exit, cancellation included. A request with ``tools`` (an agent step's turn) is
turned into constrained JSON for the embedded engine (:mod:`.tool_turns`); upstreams
get OpenAI ``tools``. With preemption on (``--scheduling preempt``), a request the
embedded engine can resume runs as a :class:`~.resumable.ResumableGeneration`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable

from flowlift.local_engine.base import GenerationChunk, GenerationRequest
from flowlift.local_engine.continuation import not_resumable
from flowlift.proxy.dispatch.backends import Backends, Local
from flowlift.proxy.dispatch.routing.routing import Route
from flowlift.proxy.dispatch.slots.resumable import ResumableGeneration
from flowlift.proxy.dispatch.slots.scheduler import Priority, Slot
from flowlift.proxy.dispatch.tool_turns import tool_generate
from flowlift.proxy.dispatch.upstream.attempts import Admit, Opened
from flowlift.proxy.dispatch.upstream.engine import UpstreamEngine, open_chat


def _nothing() -> None:
    return None


class StepDispatcher:
    """Runs workflow generations on their model's route.

    Args:
        backends: the proxy's registry of backends and routes.
    """

    def __init__(self, backends: Backends) -> None:
        self.backends = backends

    async def generate(self, request: GenerationRequest, *, priority: Priority,
                       prefill_tokens: int = 0,
                       started: Callable[[], None] = _nothing,
                       ) -> AsyncGenerator[GenerationChunk, None]:
        """The chunks of ``request`` (``model``: a served name; affinity: its
        ``session_id``) from the backend its route chooses. Use it inside
        ``contextlib.aclosing``.

        Args:
            priority: the order of the wait for a slot.
            prefill_tokens: the prompt tokens it will prefill (the batch prefill budget).
            started: called when a slot is granted (again if an upstream attempt
                failed before any output and the next backend grants one).

        Raises:
            ModelNotFound: no route for the model.
            Overloaded: no backend of the route can take it now.
            FlowliftError: the engine's or the upstream's failure (an
                :class:`~flowlift.errors.EngineError` once every attempt failed).
        """
        route = self.backends.route(request.model)
        target: Local | Opened | None = self._embedded_only(route)
        if target is None:
            target = await open_chat(self.backends, route, request,
                                     admit=self._admit(route, priority, prefill_tokens,
                                                       started))
        if isinstance(target, Local):
            chunks = self._local(target, request, priority, prefill_tokens, started)
        else:
            chunks = self._upstream(target, route, request)
        async with contextlib.aclosing(chunks) as stream:
            async for chunk in stream:
                yield chunk

    def _embedded_only(self, route: Route) -> Local | None:
        """The embedded backend of a route that has nothing else (no choice to make)."""
        locals_ = [self.backends.local(name) for name in route.backends]
        return locals_[0] if locals_ and all(locals_) else None

    def _admit(self, route: Route, priority: Priority, prefill_tokens: int,
               started: Callable[[], None]) -> Admit | None:
        pool = self.backends.pool(route)
        if pool is None:
            return None

        async def admit() -> Slot:
            slot = pool.slots.slot(priority, prefill_tokens)
            await slot.acquire()
            started()
            return slot
        return admit

    async def _local(self, target: Local, request: GenerationRequest, priority: Priority,
                     prefill_tokens: int, started: Callable[[], None],
                     ) -> AsyncGenerator[GenerationChunk, None]:
        backend = target.backend
        if (backend.slots.preempt and backend.engine.capabilities.resume
                and not_resumable(request) is None):
            run = ResumableGeneration(backend.engine, backend.slots,
                                      dataclasses.replace(request, model=target.model),
                                      priority, prefill_tokens, started)
            async with contextlib.aclosing(run.stream()) as resumable:
                async for chunk in resumable:
                    yield chunk
            return
        async with backend.slots.slot(priority, prefill_tokens) as slot:
            started()
            # the engine's own queue order follows the priority granted (a step the app
            # began to await while it queued was promoted: runs.Run.mark_awaited)
            engine_priority = (request.priority if self.backends.fcfs
                               else slot.priority.engine_priority())
            stream = tool_generate(backend.engine, dataclasses.replace(
                request, model=target.model, priority=engine_priority))
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    if chunk.text or chunk.finish_reason:
                        slot.prefilled()
                    if chunk.usage is not None:  # the KV its session (chain) holds now
                        backend.slots.observed(slot.priority, chunk.usage.prompt_tokens
                                               + chunk.usage.completion_tokens)
                    yield chunk

    async def _upstream(self, opened: Opened, route: Route, request: GenerationRequest,
                        ) -> AsyncGenerator[GenerationChunk, None]:
        pool = self.backends.pool(route)
        engine = None if pool is None else pool.engine
        if not isinstance(engine, UpstreamEngine):  # never: a route with upstreams has one
            await opened.release()
            raise AssertionError(f"route {route.model!r} has no upstream pool")
        async with contextlib.aclosing(engine.read(opened, request.request_id)) as chunks:
            async for chunk in chunks:
                if chunk.text and opened.slot is not None:
                    opened.slot.prefilled()
                yield chunk
