"""Per-backend dispatch: a bounded number of engine slots handed out by priority.

Ready steps wait here, not inside the engine, so flowlift decides the order
(Autellix, 2025: program-level priority by critical path; SAGA, 2026: the workflow as
the scheduling unit). The order is:

1. workflow class: ``interactive`` before ``batch``;
2. remaining critical-path length of the step (longest first);
3. deadline slack (least first);
4. arrival.

``reserved_interactive`` slots are never given to batch work, so an interactive
continuation never waits behind batch work for a free slot. While interactive work is
running (and for ``linger_s`` after, so a chain's next step finds the room), new batch
work is admitted only up to ``batch_cap_when_interactive`` slots: on an engine whose
per-token time grows with the batch (any CPU, a saturated GPU), that is what keeps
interactive latency near its unloaded value. Batch work is also admitted within a
budget of prompt tokens still being prefilled (``batch_prefill_budget``): a burst of
long batch prompts otherwise fills every engine step with prefill for seconds, and an
interactive step's first token waits behind it. With ``preempt`` on, running batch
requests above that cap are preempted when interactive work is granted a slot (chosen by
:func:`~flowlift.proxy.dispatch.preemption.choose_victims`); they give their slots back
and wait again, ahead of batch work not yet started, to resume as continuations
(:mod:`flowlift.proxy.dispatch.resumable`). Without it, running requests are never
preempted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from flowlift.proxy.dispatch.preemption import Preemptible, choose_victims

CLASS_RANK = {"interactive": 0, "batch": 1, "idle": 2}
"""``idle``: deferrable work of the local tier (:mod:`flowlift.tiers`), after all batch
work: it runs when nothing of a higher class waits."""


@dataclass(frozen=True, order=True, slots=True)
class Priority:
    """Sort key of a waiting step (smaller runs first)."""

    class_rank: int = 0
    neg_remaining_ms: float = 0.0
    slack_ms: float = math.inf

    @classmethod
    def of(cls, workflow_class: str, remaining_ms: float = 0.0,
           slack_ms: float | None = None) -> Priority:
        return cls(CLASS_RANK.get(workflow_class, 0), -remaining_ms,
                   math.inf if slack_ms is None else slack_ms)

    @property
    def interactive(self) -> bool:
        return self.class_rank == 0

    def engine_priority(self) -> int:
        """The same order as one integer for vLLM's ``priority`` (lower runs earlier)."""
        return self.class_rank * 1_000_000_000 - int(min(-self.neg_remaining_ms, 999_999_999))


@dataclass(order=True, slots=True)
class _Waiter:
    key: Priority
    seq: int
    future: asyncio.Future[None] = field(compare=False)
    priority: Priority = field(compare=False)
    prefill_tokens: int = field(default=0, compare=False)
    task: asyncio.Task[object] | None = field(default=None, compare=False)
    """The task waiting (what :meth:`PrioritySlots.promote` finds it by)."""


class PrioritySlots:
    """``capacity`` engine slots, granted by :class:`Priority`.

    Args:
        capacity: requests in flight on the backend.
        reserved_interactive: slots batch work may never take (at most capacity - 1).
        batch_cap_when_interactive: batch slots while interactive work is active
            (default: half the capacity).
        linger_s: how long interactive work counts as active after its last release.
        batch_prefill_budget: prompt tokens of batch work that may be in prefill at once
            (a single larger prompt still goes alone).
        fcfs: ignore priorities and reserve nothing: first come, first served (the
            baseline the benchmarks compare against).
        preempt: when interactive work is granted a slot, preempt running batch requests
            (those registered with :meth:`register`) down to the batch cap (not with
            ``fcfs``).

    Attributes:
        preemptions: requests asked to stop so far.
    """

    def __init__(self, capacity: int, reserved_interactive: int = 1, fcfs: bool = False,
                 batch_cap_when_interactive: int | None = None,
                 linger_s: float = 1.0, batch_prefill_budget: int = 1024,
                 preempt: bool = False) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.fcfs = fcfs
        self.reserved = 0 if fcfs else min(max(reserved_interactive, 0), capacity - 1)
        self.batch_cap = (capacity if fcfs else batch_cap_when_interactive
                          or max(1, capacity // 2))
        self.linger_s = linger_s
        self._interactive_until = 0.0
        self.prefill_budget = batch_prefill_budget
        self.batch_prefill = 0
        self.in_use = 0
        self.batch_in_use = 0
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self._grant_pending = False
        self.preempt = preempt and not fcfs
        self.preemptions = 0
        self._preemptible: dict[int, Preemptible] = {}
        self._preempting: set[int] = set()

    @property
    def queued(self) -> int:
        return sum(1 for w in self._heap if not w.future.done())

    def queued_by_class(self) -> dict[str, int]:
        """Waiting requests per workflow class (``interactive``, ``batch``)."""
        out = {"interactive": 0, "batch": 0}
        for w in self._heap:
            if not w.future.done():
                out["interactive" if w.priority.interactive else "batch"] += 1
        return out

    def interactive_active(self) -> bool:
        return (self.in_use > self.batch_in_use
                or time.monotonic() < self._interactive_until)

    def _can_take(self, p: Priority, tokens: int = 0) -> bool:
        if self.in_use >= self.capacity:
            return False
        if p.interactive:
            return True
        if (not self.fcfs and self.batch_prefill
                and self.batch_prefill + tokens > self.prefill_budget):
            return False
        limit = self.capacity - self.reserved
        if not self.fcfs and self.interactive_active():
            limit = min(limit, self.batch_cap)
        return self.batch_in_use < limit

    def _take(self, p: Priority, tokens: int = 0) -> None:
        self.in_use += 1
        if not p.interactive:
            self.batch_in_use += 1
            self.batch_prefill += tokens

    async def acquire(self, priority: Priority, prefill_tokens: int = 0,
                      resumed: bool = False) -> Priority:
        """Wait for a slot. Cancelling the wait gives nothing up and leaks nothing.

        Grants happen in a callback after the current loop iteration, so steps that
        become ready together are ordered by priority, not by who asked first.
        ``resumed``: a preempted request waiting to resume goes before others of its
        priority (its prompt is still in the prefix cache).

        Returns:
            The priority the slot was granted at: ``priority``, or the one given to
            :meth:`promote` while waiting (release the slot with this one).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        key = Priority() if self.fcfs else priority
        seq = next(self._seq)
        waiter = _Waiter(key, -seq if resumed else seq, fut, priority, prefill_tokens,
                         asyncio.current_task())
        heapq.heappush(self._heap, waiter)
        if not self._grant_pending:
            self._grant_pending = True
            loop.call_soon(self._grant)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted just as we were cancelled
                self.release(waiter.priority, prefill_tokens)
            raise
        return waiter.priority

    def promote(self, task: asyncio.Task[object], priority: Priority) -> bool:
        """Give the waiting request of ``task`` a new priority (an open run's step the
        app now waits for: :mod:`flowlift.proxy.workflows.open_runs`). Its place in the
        queue follows at once; a request already granted is left alone.

        Returns:
            True when ``task`` was waiting here.
        """
        for w in self._heap:
            if w.task is task and not w.future.done():
                w.priority = priority
                w.key = Priority() if self.fcfs else priority
                heapq.heapify(self._heap)
                if not self._grant_pending:
                    self._grant_pending = True
                    asyncio.get_running_loop().call_soon(self._grant)
                return True
        return False

    def prefilled(self, priority: Priority, prefill_tokens: int) -> None:
        """A granted request produced its first token: its prompt left the budget."""
        if not priority.interactive:
            self.batch_prefill -= prefill_tokens
            self._grant()

    def release(self, priority: Priority, prefill_tokens: int = 0) -> None:
        """Give the slot back (``prefill_tokens``: still counted, if never prefilled)."""
        self.in_use -= 1
        if not priority.interactive:
            self.batch_prefill -= prefill_tokens
        if not priority.interactive:
            self.batch_in_use -= 1
        elif not self.fcfs:
            self._interactive_until = time.monotonic() + self.linger_s
            asyncio.get_running_loop().call_later(self.linger_s + 0.01, self._grant)
        self._grant()

    def _grant(self) -> None:
        self._grant_pending = False
        while self._heap:
            best = self._heap[0]
            if best.future.done():  # cancelled while waiting
                heapq.heappop(self._heap)
                continue
            if not self._can_take(best.priority, best.prefill_tokens):
                if best.priority.interactive:
                    self._preempt_batch(blocked=True)
                return
            heapq.heappop(self._heap)
            self._take(best.priority, best.prefill_tokens)
            best.future.set_result(None)
            if best.priority.interactive:
                self._preempt_batch()

    # -- preemption -------------------------------------------------------------------
    def register(self, request: Preemptible) -> None:
        """A granted batch request that may be preempted while it runs."""
        self._preemptible[id(request)] = request

    def unregister(self, request: Preemptible) -> None:
        """It finished, or stopped after :meth:`Preemptible.preempt`."""
        self._preemptible.pop(id(request), None)
        self._preempting.discard(id(request))

    def _preempt_batch(self, blocked: bool = False) -> None:
        """Bring the running batch down to the batch cap (``blocked``: also free one
        slot for the interactive request that finds none)."""
        if not self.preempt:
            return
        stopping = len(self._preempting)
        excess = self.batch_in_use - stopping - self.batch_cap
        if blocked:
            excess = max(excess, self.in_use - stopping - self.capacity + 1)
        if excess <= 0:
            return
        running: dict[Hashable, Preemptible] = {
            k: r for k, r in self._preemptible.items() if k not in self._preempting}
        candidates = [dataclasses.replace(r.candidate(), key=k) for k, r in running.items()]
        for victim in choose_victims(candidates, excess):
            request = running[victim.key]
            self._preempting.add(id(request))
            self.preemptions += 1
            request.preempt()

    def slot(self, priority: Priority, prefill_tokens: int = 0,
             resumed: bool = False) -> Slot:
        """``async with slots.slot(priority, tokens) as slot:`` -- acquire, then release
        on exit; call ``slot.prefilled()`` at the first token (``resumed``: see
        :meth:`acquire`)."""
        return Slot(self, priority, prefill_tokens, resumed)


class Slot:
    """One granted engine slot (an async context manager)."""

    def __init__(self, slots: PrioritySlots, priority: Priority, prefill_tokens: int,
                 resumed: bool = False) -> None:
        self._slots, self._priority = slots, priority
        self._tokens = max(int(prefill_tokens), 0)
        self._resumed = resumed

    @property
    def priority(self) -> Priority:
        """The priority the slot was (or will be) granted at: a queued request promoted
        while it waited (:meth:`PrioritySlots.promote`) holds the promoted one."""
        return self._priority

    def prefilled(self) -> None:
        if self._tokens:
            self._slots.prefilled(self._priority, self._tokens)
            self._tokens = 0

    async def acquire(self) -> None:
        """Wait for the slot (cancelling the wait leaks nothing)."""
        self._priority = await self._slots.acquire(self._priority, self._tokens,
                                                   self._resumed)

    def release(self) -> None:
        """Give the slot back; call it once per granted :meth:`acquire`."""
        self._slots.release(self._priority, self._tokens)
        self._tokens = 0

    async def __aenter__(self) -> Slot:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
