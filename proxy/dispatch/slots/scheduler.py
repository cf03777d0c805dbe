"""Per-backend dispatch: a bounded number of engine slots handed out by priority.

Ready steps wait here, not inside the engine, so flowlift decides the order
(Autellix, 2025: program-level priority by critical path; SAGA, 2026: the workflow as
the scheduling unit). The order is:

1. workflow class: ``interactive`` before ``batch``;
2. the program's least-attained-service level (:mod:`.programs`: Autellix's PLAS over
   agent sessions, with a starvation bound: a request that waited ``max_wait_s`` goes
   first in its class);
3. remaining critical-path length of the step (longest first);
4. deadline slack (least first);
5. arrival.

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
:func:`~flowlift.proxy.dispatch.slots.preemption.choose_victims`); they give their slots back
and wait again, ahead of batch work not yet started, to resume as continuations
(:mod:`flowlift.proxy.dispatch.slots.resumable`). Without it, running requests are never
preempted.

With a :class:`~flowlift.proxy.dispatch.slots.batch_cap.DynamicCap` (``flowlift serve
--batch-cap-when-interactive auto``) the cap is not a fixed number but a plan made from
the engine's measured step times for the interactive requests running now: how many
batch requests may decode beside them and how many batch prompt tokens may be prefilled
beside them (on a CPU: none), so their steps stay within a slowdown bound. New batch
work waits while it does not fit the plan; with ``preempt`` on, batch requests still in
prefill beyond it are preempted first, then decoding ones above the cap
(:func:`~flowlift.proxy.dispatch.slots.preemption.victims_beside_interactive`). A
:class:`~flowlift.proxy.dispatch.slots.batch_cap.LingerModel` replaces the fixed linger by the
time programs were seen to take to send their next interactive step.

A steady cap (``flowlift serve --batch-cap N|auto``) bounds the batch's slots at all
times, interactive work or not (``auto``: the dynamic plan's decode cap beside one
interactive request, so an interactive step that arrives finds a batch it may run
beside). Decoding batch requests are then never preempted: the arrival of interactive
work changes nothing for them, and there is no churn of preemptions and re-prefills at
each arrival; only batch requests still in prefill are preempted (with ``preempt``) or
held back (beyond the plan's prefill allowance) while interactive work is active.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from flowlift.proxy.dispatch.slots.batch_cap import BatchPlan, DynamicCap, LingerModel
from flowlift.proxy.dispatch.slots.policy import SlotPolicy
from flowlift.proxy.dispatch.slots.preemption import (
    Candidate,
    Preemptible,
    choose_victims,
    victims_beside_interactive,
)
from flowlift.proxy.dispatch.slots.programs import ProgramBook, ProgramConfig
from flowlift.proxy.dispatch.slots.working_set import WorkingSet, WorkingSetConfig

KvUsage = Callable[[], "float | None"]
KvCapacity = Callable[[], "int | None"]
KvBlock = Callable[[], "int | None"]

CLASS_RANK = {"interactive": 0, "batch": 1, "idle": 2}
"""``idle``: deferrable work of the local tier (:mod:`flowlift.tiers`), after all batch
work: it runs when nothing of a higher class waits."""


@dataclass(frozen=True, order=True, slots=True)
class Priority:
    """Sort key of a waiting step (smaller runs first).

    ``program``: the agent session the request belongs to (a run id, or the
    ``X-Flowlift-Session`` / ``X-Flowlift-Workflow`` id of a chat completion), whose
    attained service orders it among programs (:mod:`.programs`); not compared here.
    ``kv_group``: the KV the request re-reads when it is narrower than its program's (a
    run's document chain: :mod:`flowlift.chains`), the session working-set admission
    tracks in place of ``program`` (None: the program); not compared here.
    """

    class_rank: int = 0
    neg_remaining_ms: float = 0.0
    slack_ms: float = math.inf
    program: str | None = field(default=None, compare=False)
    kv_group: str | None = field(default=None, compare=False)

    @classmethod
    def of(cls, workflow_class: str, remaining_ms: float = 0.0,
           slack_ms: float | None = None, program: str | None = None) -> Priority:
        return cls(CLASS_RANK.get(workflow_class, 0), -remaining_ms,
                   math.inf if slack_ms is None else slack_ms, program)

    @property
    def interactive(self) -> bool:
        return self.class_rank == 0

    def engine_priority(self) -> int:
        """The same order as one integer for vLLM's ``priority`` (lower runs earlier)."""
        return self.class_rank * 1_000_000_000 - int(min(-self.neg_remaining_ms, 999_999_999))


Key = tuple[int, int, float, float]
"""(class rank, LAS level, -remaining critical path ms, slack ms)."""
_FCFS_KEY: Key = (0, 0, 0.0, math.inf)


@dataclass(order=True, slots=True)
class _Waiter:
    key: Key
    seq: int
    future: asyncio.Future[None] = field(compare=False)
    priority: Priority = field(compare=False)
    prefill_tokens: int = field(default=0, compare=False)
    task: asyncio.Task[object] | None = field(default=None, compare=False)
    """The task waiting (what :meth:`PrioritySlots.promote` finds it by)."""
    since: float = field(default=0.0, compare=False)
    """When it began to wait (the program book's clock)."""
    level: int = field(default=0, compare=False)
    held: bool = field(default=False, compare=False)
    """Held back, out of the heap, to keep a waiting session's KV (:mod:`.programs`)."""


class PrioritySlots:
    """``capacity`` engine slots, granted by :class:`Priority`.

    Args:
        capacity: requests in flight on the backend.
        policy: how the slots are granted (:class:`~.policy.SlotPolicy`; None: its
            defaults).
        kv_usage: the engine's KV-cache share in use (0 to 1, None: unknown), read
            when a new program's request would start while a session's KV is kept.
        kv_capacity: the engine's KV cache in tokens (None, or returning None:
            unknown, no working-set admission: ``policy.working_set``).
        kv_block: the engine's KV block size in tokens (None: 1).
        timer: the clock of attained service and waits (seconds); tests inject one.
        dynamic: the batch plan beside interactive work from measured step times
            (replaces ``batch_cap_when_interactive``; not with ``fcfs``).
        linger: the learned linger (replaces ``linger_s``; not with ``fcfs``).
        steady: the steady batch cap: batch slots at any time (a number, or the
            ``dynamic``-style plan of this :class:`DynamicCap` beside one interactive
            request); decoding batch requests are then never preempted (not with
            ``fcfs``; None: no steady cap).

    Attributes:
        preemptions: requests asked to stop so far.
        programs: the :class:`~.programs.ProgramBook` of this engine.
        working: the :class:`~.working_set.WorkingSet` of this engine.
    """

    def __init__(self, capacity: int, policy: SlotPolicy | None = None, *,
                 kv_usage: KvUsage | None = None,
                 timer: Callable[[], float] = time.monotonic,
                 dynamic: DynamicCap | None = None,
                 linger: LingerModel | None = None,
                 steady: int | DynamicCap | None = None,
                 kv_capacity: KvCapacity | None = None,
                 kv_block: KvBlock | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        policy = policy or SlotPolicy()
        fcfs, reserved_interactive = policy.fcfs, policy.reserved_interactive
        batch_cap_when_interactive = policy.batch_cap_when_interactive
        linger_s, batch_prefill_budget = policy.linger_s, policy.batch_prefill_budget
        preempt, programs = policy.preempt, policy.programs
        self.capacity = capacity
        self.fcfs = fcfs
        self.reserved = 0 if fcfs else min(max(reserved_interactive, 0), capacity - 1)
        self.batch_cap = (capacity if fcfs else batch_cap_when_interactive
                          or max(1, capacity // 2))
        self.linger_s = linger_s
        self.dynamic = None if fcfs else dynamic
        self.linger = None if fcfs else linger
        self.steady = None if fcfs else steady
        self._interactive_until = 0.0
        self._linger_timer: asyncio.TimerHandle | None = None  # at most one at a time
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
        config = programs or ProgramConfig()
        if fcfs:
            config = dataclasses.replace(config, enabled=False)
        self.programs = ProgramBook(config, timer)
        self._kv_usage = kv_usage
        ws = policy.working_set or WorkingSetConfig(enabled=False)
        self.working = WorkingSet(dataclasses.replace(ws, enabled=ws.enabled and not fcfs),
                                  timer)
        self._kv_capacity = kv_capacity
        self._kv_block = kv_block
        self._arrivals: deque[_Waiter] = deque()  # arrival order, for the wait bound
        self._held: list[_Waiter] = []
        self._hold_timer: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        return sum(1 for w in (*self._heap, *self._held) if not w.future.done())

    def queued_by_class(self) -> dict[str, int]:
        """Waiting requests per workflow class (``interactive``, ``batch``)."""
        out = {"interactive": 0, "batch": 0}
        for w in (*self._heap, *self._held):
            if not w.future.done():
                out["interactive" if w.priority.interactive else "batch"] += 1
        return out

    def interactive_active(self) -> bool:
        return (self.in_use > self.batch_in_use
                or time.monotonic() < self._interactive_until)

    def batch_plan(self) -> BatchPlan:
        """What batch work may do while interactive work is active: the dynamic plan
        for the interactive requests running now, else the fixed cap (and no bound on
        prefill beyond ``batch_prefill_budget``)."""
        if self.dynamic is None:
            return BatchPlan(self.batch_cap, self.prefill_budget)
        return self.dynamic.plan(self.in_use - self.batch_in_use,
                                 self.capacity - self.reserved)

    def steady_cap(self) -> int:
        """Batch slots at any time: the steady cap now (all but the reserved ones when
        there is none)."""
        slots = self.capacity - self.reserved
        if isinstance(self.steady, DynamicCap):
            return max(1, self.steady.plan(1, slots).decode_cap)  # the batch still moves
        return slots if self.steady is None else min(self.steady, slots)

    def plan_snapshot(self) -> dict[str, object] | None:
        """The dynamic plan's state, the steady cap and the linger now (None: fixed caps
        and linger, no steady cap)."""
        if self.dynamic is None and self.linger is None and self.steady is None:
            return None
        out: dict[str, object] = {"linger_s": round(self.linger.linger_s(), 3)
                                  if self.linger is not None else self.linger_s}
        if self.dynamic is not None:
            out.update(self.dynamic.snapshot(self.capacity - self.reserved))
        elif isinstance(self.steady, DynamicCap):
            out.update(self.steady.snapshot(self.capacity - self.reserved))
        if self.steady is not None:
            out["steady_cap"] = self.steady_cap()
        return out

    def _can_take(self, p: Priority, tokens: int = 0) -> bool:
        if self.in_use >= self.capacity:
            return False
        if p.interactive:
            return True
        if (not self.fcfs and self.batch_prefill
                and self.batch_prefill + tokens > self.prefill_budget):
            return False
        limit = self.capacity - self.reserved
        if self.steady is not None:
            limit = self.steady_cap()
        if not self.fcfs and self.interactive_active():
            plan = self.batch_plan()
            limit = min(limit, plan.decode_cap)
            if self.dynamic is not None and self.batch_prefill + tokens > plan.prefill_tokens:
                return False
        return self.batch_in_use < limit

    def _key(self, p: Priority, level: int) -> Key:
        if self.fcfs:
            return _FCFS_KEY
        return (p.class_rank, level, p.neg_remaining_ms, p.slack_ms)

    def _take(self, p: Priority, tokens: int = 0) -> None:
        self.programs.started(p.program)
        self.working.started(self._kv(p))
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
        self.programs.unkeep(priority.program)  # its next call came
        self.working.arrived(self._kv(priority))
        if self.linger is not None and priority.interactive:
            self.linger.acquired(priority.program)
        level = self.programs.level(priority.program)
        seq = next(self._seq)
        waiter = _Waiter(self._key(priority, level), -seq if resumed else seq, fut,
                         priority, prefill_tokens, asyncio.current_task(),
                         self.programs.now(), level)
        heapq.heappush(self._heap, waiter)
        self._arrivals.append(waiter)
        if not self._grant_pending:
            self._grant_pending = True
            loop.call_soon(self._grant)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted just as we were cancelled
                self.release(waiter.priority, prefill_tokens)
            else:
                self.working.left(self._kv(priority))
            raise
        return waiter.priority

    def promote(self, task: asyncio.Task[object], priority: Priority) -> bool:
        """Give the waiting request of ``task`` a new priority (an open run's step the
        app now waits for: :mod:`flowlift.proxy.workflows.open_runs`). Its place in the
        queue follows at once; a request already granted is left alone.

        Returns:
            True when ``task`` was waiting here.
        """
        for w in (*self._heap, *self._held):
            if w.task is task and not w.future.done():
                if priority.program is None:  # the same program, a new place in it
                    priority = dataclasses.replace(priority, program=w.priority.program)
                w.priority = priority
                w.key = self._key(priority, w.level)
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
        self.programs.finished(priority.program)
        self.working.finished(self._kv(priority))
        self.in_use -= 1
        if not priority.interactive:
            self.batch_prefill -= prefill_tokens
        if not priority.interactive:
            self.batch_in_use -= 1
        elif not self.fcfs:
            linger = self.linger_s
            if self.linger is not None:
                self.linger.released(priority.program)
                linger = self.linger.linger_s()
            self._interactive_until = time.monotonic() + linger  # the last release's
            loop = asyncio.get_running_loop()
            timer = self._linger_timer
            if timer is not None and timer.when() > loop.time() + linger + 0.02:
                timer.cancel()  # a learned linger shrank: end the window sooner
                self._linger_timer = None
            if self._linger_timer is None:
                self._linger_timer = loop.call_later(linger + 0.01, self._linger_over)
        self._grant()

    def _linger_over(self) -> None:
        """The linger window may be over: grant what it held back, or wait out the rest
        of a window a later release extended (one timer, however many releases)."""
        left = self._interactive_until - time.monotonic()
        if left > 0:
            self._linger_timer = asyncio.get_running_loop().call_later(left + 0.01,
                                                                       self._linger_over)
            return
        self._linger_timer = None
        self._grant()

    def _grant(self) -> None:
        self._grant_pending = False
        self._unhold()
        while True:
            while self._heap and self._heap[0].future.done():  # granted or cancelled
                heapq.heappop(self._heap)
            if not self._heap:
                return
            best = self._aged() or self._heap[0]
            if self._hold(best):
                continue
            if not self._can_take(best.priority, best.prefill_tokens):
                if best.priority.interactive:
                    self._preempt_batch(blocked=True)
                return
            if best is self._heap[0]:
                heapq.heappop(self._heap)
            else:  # aged: left in the heap, dropped when it reaches the top (done)
                self.programs.aged += 1
            self._take(best.priority, best.prefill_tokens)
            best.future.set_result(None)
            if best.priority.interactive:
                self._preempt_batch()

    # -- program-level scheduling (flowlift.proxy.dispatch.slots.programs) ---------------------
    def _aged(self) -> _Waiter | None:
        """The first waiter (lowest class, then arrival) that has waited ``max_wait_s``,
        when its class is not behind the heap's best; None: none has."""
        if not self.programs.enabled:
            return None
        while self._arrivals and self._arrivals[0].future.done():
            self._arrivals.popleft()
        if len(self._arrivals) > 2 * len(self._heap) + len(self._held) + 64:
            # a long waiter at the front keeps the granted ones behind it: drop them
            self._arrivals = deque(w for w in self._arrivals if not w.future.done())
        bound = self.programs.now() - self.programs.config.max_wait_s
        found: _Waiter | None = None
        for w in self._arrivals:
            if w.since > bound:
                break
            if w.future.done() or w.held:
                continue
            if found is None or w.priority.class_rank < found.priority.class_rank:
                found = w
        if found is None or found.key[0] > self._heap[0].key[0]:
            return None
        return found

    def kv_capacity(self) -> int | None:
        """The engine's KV cache in tokens (None: unknown)."""
        return None if self._kv_capacity is None else self._kv_capacity()

    def observed(self, priority: Priority, tokens: int) -> None:
        """A request of ``priority``'s program ended holding ``tokens`` of KV (prompt
        plus completion): its session's footprint in the working set."""
        self.working.observed(self._kv(priority), tokens)

    def ended(self, priority: Priority) -> None:
        """``priority``'s KV group will not call again (a run's document chain whose
        steps are all over): it leaves the working set at once."""
        if priority.kv_group is not None:
            self.working.ended(self._kv(priority))

    def _kv(self, p: Priority) -> str | None:
        """The session working-set admission tracks for ``p``: its KV group where the
        policy follows chains (:attr:`WorkingSetConfig.chains`), else its program."""
        if p.kv_group is not None and self.working.config.chains:
            return p.kv_group
        return p.program

    def _hold(self, best: _Waiter) -> bool:
        """Hold ``best`` back (out of the heap) when it is outside the working set and
        that would not fit the cache (:meth:`WorkingSet.admits`), or when it is a new
        program's request and a waiting session's KV is kept on a full cache
        (:meth:`ProgramBook.hold_back`)."""
        if self._outside_working_set(best):
            self.working.held += 1
        elif self._holds(best, None if self._kv_usage is None else self._kv_usage()):
            self.programs.held += 1
        else:
            return False
        if best is self._heap[0]:
            heapq.heappop(self._heap)
        else:
            self._heap.remove(best)
            heapq.heapify(self._heap)
        best.held = True
        self._held.append(best)
        self._wake_held()
        return True

    def _outside_working_set(self, w: _Waiter, new: list[bool] | None = None) -> bool:
        """Whether ``w`` waits for the working set to fit (:mod:`.working_set`).
        ``new``: one answer shared by every session the working set does not know yet
        (they all need the same estimate), filled by the first of them asked: a long
        queue of new documents' chains is looked at once per grant, not one by one."""
        if w.future.done() or not self.working.enabled:
            return False
        session = self._kv(w.priority)
        unknown = new is not None and not self.working.knows(session)
        if unknown and new:
            return new[0]
        out = not self.working.admits(session, self.kv_capacity(),
                                      None if self._kv_block is None else self._kv_block())
        if unknown and new is not None:
            new.append(out)
        return out

    def _holds(self, w: _Waiter, kv: float | None) -> bool:
        """Whether ``w`` stays held: never past ``keep_ttl_s`` from its arrival (new
        marks of other sessions cannot hold it for ever), never on an idle engine."""
        if self.in_use == 0 or w.future.done():
            return False
        if self.programs.now() - w.since >= self.programs.config.keep_ttl_s:
            return False
        return self.programs.hold_back(w.priority.program, kv)

    def _wake_held(self) -> None:
        """Grant again when the soonest mark or hold expires."""
        if not self._held or self._hold_timer is not None:
            return
        now, ttl = self.programs.now(), self.programs.config.keep_ttl_s
        waits = [w.since + ttl - now for w in self._held]  # past it: the working set's
        waits = [x for x in waits if x > 0]  # hold, which a release or a leave ends
        for left in (self.programs.next_keep_expiry_s(), self.working.next_change_s()):
            if left is not None:
                waits.append(left)
        if not waits:
            return
        wait = max(0.0, min(waits))
        self._hold_timer = asyncio.get_running_loop().call_later(wait + 0.01,
                                                                 self._hold_expired)

    def _hold_expired(self) -> None:
        self._hold_timer = None
        self._grant()

    def _unhold(self) -> None:
        """Put held requests back in the queue once nothing holds them any more."""
        if not self._held:
            return
        kv = None if self._kv_usage is None else self._kv_usage()
        new: list[bool] = []  # the answer for sessions the working set does not know yet
        keep = [w for w in self._held
                if self._outside_working_set(w, new) or self._holds(w, kv)]
        kept = {id(w) for w in keep}
        for w in self._held:
            if id(w) not in kept and not w.future.done():
                w.held = False
                heapq.heappush(self._heap, w)
        self._held = keep
        self._wake_held()

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
        running: dict[Hashable, Preemptible] = {
            k: r for k, r in self._preemptible.items() if k not in self._preempting}
        candidates = [dataclasses.replace(r.candidate(), key=k) for k, r in running.items()]
        for victim in self._victims(candidates, blocked):
            request = running[victim.key]
            self._preempting.add(id(request))
            self.preemptions += 1
            request.preempt()

    def _victims(self, candidates: list[Candidate], blocked: bool) -> list[Candidate]:
        """Whom to preempt now: down to the fixed cap (requests still in prefill are
        left alone), or to the dynamic plan; under a steady cap, no decoding request
        (only those in prefill beyond the dynamic plan); ``blocked``: at least one more,
        to free a slot for the interactive request that finds none."""
        stopping = len(self._preempting)
        need = self.in_use - stopping - self.capacity + 1 if blocked else 0
        if self.dynamic is None:
            over = (0 if self.steady is not None
                    else self.batch_in_use - stopping - self.batch_cap)
            return choose_victims([c for c in candidates if not c.in_prefill],
                                  max(over, need))
        victims = victims_beside_interactive(candidates, self.batch_plan(),
                                             stop_decoding=self.steady is None)
        if len(victims) < need:
            chosen = {id(v) for v in victims}
            victims += choose_victims([c for c in candidates if id(c) not in chosen],
                                      need - len(victims))
        return victims

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
