"""One generation on the embedded engine that may be preempted and resumed.

A batch request granted a slot registers with its
:class:`~flowlift.proxy.dispatch.slots.scheduler.PrioritySlots` as it starts; its candidacy
says whether it is still in prefill. Under a fixed batch cap only requests past their
first token are preempted (preempting one in prefill wastes what of the prefill is not
in whole KV blocks); the dynamic plan preempts those in prefill first, since their
prefill is what slows the interactive steps most. When interactive work
arrives and the slots choose it (:func:`~flowlift.proxy.dispatch.slots.preemption.choose_victims`),
:meth:`ResumableGeneration.preempt` aborts its engine request; its stream ends with
``finish_reason="abort"``, it gives its slot back and waits again (ahead of batch work
not yet started), then continues as a new engine request carrying the token ids it has
generated (``GenerationRequest.resume_token_ids``; the engine sends the prompt's tokens
plus these, served from the prefix cache: :mod:`flowlift.local_engine.continuation`).

Its reader sees one stream: every token once, in order, no finish between the parts,
and one usage at the end (prompt tokens once, completion tokens all generated:
:func:`~flowlift.local_engine.continuation.merge_usage`). Only requests the engine can
resume faithfully come here (``capabilities.resume`` and
:func:`~flowlift.local_engine.continuation.not_resumable` is None).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable

from flowlift.local_engine.base import Engine, GenerationChunk, GenerationRequest, Usage
from flowlift.local_engine.continuation import merge_usage
from flowlift.proxy.dispatch.slots.preemption import Candidate
from flowlift.proxy.dispatch.slots.scheduler import Priority, PrioritySlots, Slot


def _nothing() -> None:
    return None


class ResumableGeneration:
    """The chunks of ``request`` on ``engine`` through ``slots``, preemptible while it
    runs at a batch priority.

    Args:
        engine: an engine whose ``capabilities.resume`` is True.
        slots: the engine's slots (their ``preempt`` decides whether it is ever asked).
        request: the request (``model``: the engine's name for it).
        priority: the order of its wait for a slot.
        prefill_tokens: its prompt tokens (the batch prefill budget; a resumption
            counts the tokens it had generated: its prompt is cached).
        started: called when the first slot is granted.

    Attributes:
        resumptions: times it continued after a preemption.
    """

    def __init__(self, engine: Engine, slots: PrioritySlots, request: GenerationRequest,
                 priority: Priority, prefill_tokens: int = 0,
                 started: Callable[[], None] = _nothing) -> None:
        self._engine, self._slots, self._request = engine, slots, request
        self._priority, self._prefill_tokens = priority, prefill_tokens
        self._started = started
        self._generated: list[int] = []
        self._attempt_id = request.request_id
        self._stopping = False
        self._in_prefill = True
        self._aborts: set[asyncio.Task[None]] = set()
        self.resumptions = 0

    def candidate(self) -> Candidate:
        """Its priority and progress (:class:`~.preemption.Preemptible`)."""
        return Candidate(id(self), self._priority, len(self._generated),
                         self._request.sampling.max_tokens, self._in_prefill,
                         self._uncached_tokens())

    def _uncached_tokens(self) -> int:
        """Prompt tokens its next engine request prefills, as the slots count them: the
        prompt's before any token came, else the tokens it generated (the prompt is in
        the prefix cache; at least these are not, in whole blocks)."""
        return len(self._generated) or self._prefill_tokens

    def preempt(self) -> None:
        """Abort the running engine request; the stream resumes it later."""
        self._stopping = True
        task = asyncio.get_running_loop().create_task(self._engine.abort(self._attempt_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def stream(self) -> AsyncGenerator[GenerationChunk, None]:
        """The answer's chunks, as one stream (use it inside ``contextlib.aclosing``).

        Raises:
            FlowliftError: the engine's failures, as :meth:`Engine.generate` raises them.
        """
        slot: Slot | None = self._slots.slot(self._priority, self._prefill_tokens)
        assert slot is not None
        await slot.acquire()
        self._started()
        usages: list[Usage] = []
        try:
            while True:
                assert slot is not None
                self._priority = slot.priority
                done = False
                async with contextlib.aclosing(self._attempt(slot, usages)) as chunks:
                    async for chunk in chunks:
                        done = chunk.finish_reason is not None
                        yield chunk
                if done or not self._stopping:
                    return
                self._slots.unregister(self)
                slot.release()
                slot = None
                # what the prefix cache cannot serve: at least the tokens it decoded
                # (cached only in whole blocks) go through prefill again
                waiting = self._slots.slot(self._priority, self._uncached_tokens(),
                                           resumed=True)
                await waiting.acquire()
                slot = waiting
                self.resumptions += 1
        finally:
            self._slots.unregister(self)
            if slot is not None:
                slot.release()

    async def _attempt(self, slot: Slot, usages: list[Usage],
                       ) -> AsyncGenerator[GenerationChunk, None]:
        """One engine request: its chunks, less the finish of a preempted one."""
        self._stopping = False
        resumed = tuple(self._generated)
        self._attempt_id = (self._request.request_id if not self.resumptions
                            else f"{self._request.request_id}~{self.resumptions}")
        request = dataclasses.replace(self._request, request_id=self._attempt_id,
                                      priority=slot.priority.engine_priority(),
                                      resume_token_ids=resumed)
        self._in_prefill = True
        if not slot.priority.interactive:
            self._slots.register(self)
        async with contextlib.aclosing(self._engine.generate(request)) as chunks:
            async for chunk in chunks:
                self._generated.extend(chunk.token_ids or ())
                if chunk.token_ids or chunk.text:
                    self._in_prefill = False
                if chunk.text:
                    slot.prefilled()
                if chunk.finish_reason is None:
                    yield chunk
                    continue
                usages.append(chunk.usage or Usage(
                    0, len(self._generated) - len(resumed), 0))
                if chunk.finish_reason == "abort" and self._stopping:
                    if chunk.text or chunk.logprobs:
                        yield dataclasses.replace(chunk, finish_reason=None, usage=None)
                    return
                usage = merge_usage(usages, len(resumed)) if chunk.usage else None
                yield dataclasses.replace(chunk, usage=usage)
                return
