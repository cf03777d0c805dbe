"""The planned schedule: when each step of a graph starts and ends when its steps share
engines. Pure code over data (no I/O, no clock).

A plan that gives every step the engine to itself is optimistic wherever steps run side
by side: on a 2-core CPU, 21 requests decoding at once each get a fraction of the
machine, and steps beyond the backend's slots wait in its queue (issue 38 item 8: such
a plan was 2.7x short of the measured critical path). :func:`simulate` plays the plan on
a fluid model of continuous batching (as vLLM schedules: Yu et al., Orca, OSDI'22;
Agrawal et al., Sarathi-Serve, OSDI'24):

* each engine has ``capacity`` slots (the proxy's ``max_concurrency`` per backend, less
  the slot kept for interactive work where the run is a batch run); a ready model step
  takes a free slot, highest priority first (the remaining critical path, as the
  proxy's scheduler orders them), else waits; a batch run's steps also wait while the
  prompt tokens of the steps still in prefill would pass ``prefill_budget``
  (``--batch-prefill-budget``; one step is always let in);
* a step first spends ``fixed_ms`` off the engine (time to first token besides prefill,
  tool calls between an agent's turns), then prefills its uncached prompt tokens, then
  decodes its output tokens;
* an engine step computes the prompt tokens waiting (first come first served, at most
  ``budget_tokens`` of them: chunked prefill) and one token for every decoding request,
  and takes ``base_ms + per_request_ms * decoding + prefill_token_ms * prompt tokens``
  with the machine to itself; engines that share a machine's cores (``host``: the
  embedded ones) take turns on them, so while ``k`` engines of a host are busy each
  step takes ``k`` times as long (on the example pipeline's 2-core machine, a 1.5B and
  a 0.5B engine each ran at about half speed while both had work: bench/RESULTS.md,
  "Honest plans (issue 38 item 8)").
  Between two events (a step admitted, a prefill or a decode done) the rates are
  constant, so the simulation jumps from event to event: O(events x engines).

A cascade step (FrugalGPT: the items the first model does not deliver go on to the next)
is a chain of :class:`Work`, one per model, each on its model's engine, its figures the
expected ones (scaled by the share of items that reach that model).

Steps that are no model calls take ``fixed_ms`` (a tool's expected time; a constant or
a group take none). A group (``first``/``quorum``) ends when ``k`` of its members have;
members still running then are cancelled (their slot freed), as the proxy does.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flowlift.costs import CostModel

PREFILL_BUDGET_TOKENS = 2048  # vLLM's max_num_batched_tokens default (CPU and GPU)
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Work:
    """What one step asks of its engine.

    Attributes:
        engine: the engine it runs on (None: no engine: a tool, a constant, a group).
        fixed_ms: time it takes off the engine (ms).
        prefill_tokens: uncached prompt tokens to compute.
        decode_tokens: output tokens decoded after the first (which comes with the
            prefill).
        then: what the step does next, once this is done (a cascade's next model, on
            its own engine: the step frees this slot and waits for one there); None:
            it ends.
    """

    engine: str | None = None
    fixed_ms: float = 0.0
    prefill_tokens: float = 0.0
    decode_tokens: float = 0.0
    then: Work | None = None


@dataclass(frozen=True, slots=True)
class EngineModel:
    """One engine's step time (ms): ``base_ms + per_request_ms * decoding +
    prefill_token_ms * prompt_tokens``, and the slots in front of it."""

    base_ms: float
    per_request_ms: float
    prefill_token_ms: float
    capacity: int
    budget_tokens: int = PREFILL_BUDGET_TOKENS
    prefill_budget: float = math.inf
    host: str | None = None

    @classmethod
    def of(cls, cost: CostModel, capacity: int, prefill_budget: float = math.inf,
           host: str | None = None) -> EngineModel:
        """The engine of a model's :class:`CostModel` (its TPOT is a step of one
        decoding request)."""
        slope = min(max(cost.per_request_ms, 0.0), cost.tpot_ms)
        return cls(base_ms=cost.tpot_ms - slope, per_request_ms=slope,
                   prefill_token_ms=1000.0 / cost.prefill_tps if cost.prefill_tps > 0
                   else 0.0, capacity=max(capacity, 1), prefill_budget=prefill_budget,
                   host=host)


@dataclass(frozen=True, slots=True)
class Schedule:
    """The simulated schedule (ms from the run's start).

    Attributes:
        ready_ms: when each step's inputs were all there.
        start_ms: when it got its slot (a step without an engine: when ready).
        finish_ms: when it ended (a cancelled group member: when its group resolved).
        cancelled: group members cancelled when their group resolved.
    """

    ready_ms: dict[str, float]
    start_ms: dict[str, float]
    finish_ms: dict[str, float]
    cancelled: frozenset[str]


class _Engine:
    """One engine's state in the simulation: its slots, prefill queue and decoders."""

    def __init__(self, model: EngineModel) -> None:
        self.m = model
        self.in_use = 0
        self.admitted_prefill = 0.0  # prompt tokens of admitted steps not yet prefilled
        self.admitted: dict[str, float] = {}  # those steps and their tokens
        self.ready: list[tuple[float, int, str]] = []  # (-priority, order, step)
        self.prefill: deque[list[object]] = deque()  # [step, tokens left], FCFS
        self.prefill_left = 0.0
        self.decoders: list[tuple[float, str]] = []  # (clock when done, step)
        self.decoding: set[str] = set()
        self.clock = 0.0  # tokens each decoding request has decoded so far

    @property
    def busy(self) -> bool:
        """Whether it has a prefill or a decode to run."""
        return bool(self.decoding) or self.prefill_left > 0

    def step_ms(self, crowd: int = 0) -> tuple[float, float]:
        """``(the step's time in ms, prompt tokens in it)`` at the current state;
        ``crowd``: the other engines of its host that are busy (it gets ``1 / (1 +
        crowd)`` of the host's cores)."""
        tokens = min(float(self.m.budget_tokens), self.prefill_left)
        busy = bool(self.decoding) or tokens > 0
        ms = (self.m.base_ms + self.m.per_request_ms * len(self.decoding)
              + self.m.prefill_token_ms * tokens) * (1 + crowd) if busy else 0.0
        return ms, tokens

    def next_event_ms(self, crowd: int = 0) -> float:
        """ms until its next prefill or decode ends (inf: none running)."""
        ms, tokens = self.step_ms(crowd)
        best = math.inf
        while self.decoders and self.decoders[0][1] not in self.decoding:
            heapq.heappop(self.decoders)  # cancelled
        if self.decoders:
            best = max(self.decoders[0][0] - self.clock, 0.0) * ms
        if self.prefill and tokens > 0:
            left = float(self.prefill[0][1])  # type: ignore[arg-type]
            best = min(best, left * ms / tokens)
        return best

    def advance(self, dt: float, crowd: int = 0) -> tuple[list[str], list[str]]:
        """Run ``dt`` ms; returns (steps whose prefill ended, steps whose decode ended)."""
        ms, tokens = self.step_ms(crowd)
        if ms <= 0:  # an engine that costs nothing: whatever runs is done at once
            done = [str(entry[0]) for entry in self.prefill]
            self.prefill.clear()
            self.prefill_left = 0.0
            ended = sorted(self.decoding)
            self.decoding.clear()
            self.decoders.clear()
            return done, ended
        steps = dt / ms
        self.clock += steps
        done_prefill: list[str] = []
        budget = tokens * steps
        while self.prefill and budget > _EPS:
            head = self.prefill[0]
            left = float(head[1])  # type: ignore[arg-type]
            use = min(left, budget)
            head[1] = left - use
            self.prefill_left -= use
            budget -= use
            if left - use <= _EPS * max(1.0, left):
                self.prefill.popleft()
                done_prefill.append(str(head[0]))
        if self.prefill and float(self.prefill[0][1]) <= _EPS:  # type: ignore[arg-type]
            done_prefill.append(str(self.prefill.popleft()[0]))
        if not self.prefill:
            self.prefill_left = 0.0
        done_decode: list[str] = []
        while self.decoders and self.decoders[0][0] <= self.clock + _EPS:
            _, sid = heapq.heappop(self.decoders)
            if sid in self.decoding:
                self.decoding.discard(sid)
                done_decode.append(sid)
        return done_prefill, done_decode

    def admit(self, sid: str, tokens: float) -> None:
        """A step got a slot: its prompt tokens count against the prefill budget."""
        if tokens > 0:
            self.admitted[sid] = tokens
            self.admitted_prefill += tokens

    def prefilled(self, sid: str) -> None:
        """A step's prompt is in (or it was cancelled): its tokens leave the budget."""
        self.admitted_prefill = max(self.admitted_prefill - self.admitted.pop(sid, 0.0), 0.0)

    def drop(self, sid: str) -> None:
        """Take a cancelled step off the engine (its slot is freed by the caller)."""
        self.prefilled(sid)
        self.decoding.discard(sid)
        for entry in self.prefill:
            if entry[0] == sid:
                self.prefill_left -= float(entry[1])  # type: ignore[arg-type]
                self.prefill.remove(entry)
                break


class _Sim:
    """The event loop of :func:`simulate` (one instance per call)."""

    def __init__(self, order: Sequence[str], deps: Mapping[str, frozenset[str]],
                 work: Mapping[str, Work], engines: Mapping[str, EngineModel],
                 priority: Mapping[str, float], groups: Mapping[str, tuple[int, Sequence[str]]]
                 ) -> None:
        self.order = order
        self.pos = {n: i for i, n in enumerate(order)}
        self.deps = deps
        self.work = dict(work)  # a cascade step's entry moves on to its next model's
        self.priority = priority
        self.groups = groups
        self.engines = {name: _Engine(m) for name, m in engines.items()}
        self.children: dict[str, list[str]] = {n: [] for n in order}
        for nid in order:
            for d in deps[nid]:
                self.children[d].append(nid)
        self.waiting = {n: len(deps[n]) for n in order}
        self.got = dict.fromkeys(groups, 0)
        self.timers: list[tuple[float, int, str, str]] = []  # (at, order, kind, step)
        self.now = 0.0
        self.ready_ms: dict[str, float] = {}
        self.start_ms: dict[str, float] = {}
        self.finish_ms: dict[str, float] = {}
        self.cancelled: set[str] = set()
        self.holding: dict[str, str] = {}  # step -> the engine whose slot it holds

    def run(self) -> Schedule:
        for nid in self.order:
            if self.waiting[nid] == 0:
                self._ready(nid)
        while True:
            self._admit_all()
            crowd = self._crowds()
            t_timer = self.timers[0][0] if self.timers else math.inf
            t_engine = min((self.now + e.next_event_ms(crowd[k])
                            for k, e in self.engines.items()), default=math.inf)
            t = min(t_timer, t_engine)
            if math.isinf(t):
                break
            dt = max(t - self.now, 0.0)
            ended: list[tuple[str, str]] = []
            for k, e in self.engines.items():
                pre, dec = e.advance(dt, crowd[k])
                ended += [("prefilled", s) for s in pre] + [("decoded", s) for s in dec]
            self.now = max(t, self.now)
            while self.timers and self.timers[0][0] <= self.now + _EPS:
                _, _, kind, sid = heapq.heappop(self.timers)
                ended.append((kind, sid))
            for kind, sid in ended:
                self._on(kind, sid)
        for nid in self.order:  # never reached (a cycle cannot be; inputs cancelled)
            t0 = self.ready_ms.setdefault(nid, self.now)
            self.start_ms.setdefault(nid, t0)
            self.finish_ms.setdefault(nid, t0)
        return Schedule(self.ready_ms, self.start_ms, self.finish_ms,
                        frozenset(self.cancelled))

    def _crowds(self) -> dict[str, int]:
        """Per engine: the other engines of its host that are busy (sharing its cores)."""
        on_host: dict[str, int] = {}
        for e in self.engines.values():
            if e.m.host is not None and e.busy:
                on_host[e.m.host] = on_host.get(e.m.host, 0) + 1
        return {k: max(on_host.get(e.m.host, 0) - e.busy, 0) if e.m.host is not None
                else 0 for k, e in self.engines.items()}

    def _ready(self, nid: str) -> None:
        if nid in self.ready_ms or nid in self.cancelled:
            return
        self.ready_ms[nid] = self.now
        self._enqueue(nid)

    def _enqueue(self, nid: str) -> None:
        """``nid``'s (current) work waits for a slot on its engine, or runs off any."""
        w = self.work.get(nid, Work())
        engine = self.engines.get(w.engine) if w.engine is not None else None
        if engine is None:
            self.start_ms.setdefault(nid, self.now)
            self._timer(self.now + w.fixed_ms, "done", nid)
        else:
            heapq.heappush(engine.ready, (-self.priority.get(nid, 0.0), self.pos[nid], nid))

    def _timer(self, at: float, kind: str, nid: str) -> None:
        heapq.heappush(self.timers, (at, self.pos[nid], kind, nid))

    def _admit_all(self) -> None:
        for name, engine in self.engines.items():
            while engine.ready and engine.in_use < engine.m.capacity:
                nid = engine.ready[0][2]
                tokens = self.work[nid].prefill_tokens
                if nid not in self.cancelled and engine.admitted_prefill > 0 and \
                        engine.admitted_prefill + tokens > engine.m.prefill_budget:
                    break
                heapq.heappop(engine.ready)
                if nid in self.cancelled:
                    continue
                engine.in_use += 1
                self.holding[nid] = name
                engine.admit(nid, tokens)
                self.start_ms.setdefault(nid, self.now)
                self._timer(self.now + self.work[nid].fixed_ms, "fixed", nid)

    def _on(self, kind: str, nid: str) -> None:
        if nid in self.finish_ms:
            return  # cancelled meanwhile
        w = self.work.get(nid, Work())
        engine = self.engines.get(w.engine) if w.engine is not None else None
        if engine is not None and kind == "prefilled":
            engine.prefilled(nid)
        if kind == "fixed" and engine is not None and w.prefill_tokens > 0:
            engine.prefill.append([nid, float(w.prefill_tokens)])
            engine.prefill_left += float(w.prefill_tokens)
        elif kind in ("fixed", "prefilled") and engine is not None and w.decode_tokens > 0:
            engine.decoding.add(nid)
            heapq.heappush(engine.decoders, (engine.clock + w.decode_tokens, nid))
        else:
            self._finish(nid)

    def _finish(self, nid: str) -> None:
        w = self.work.get(nid, Work())
        if nid in self.holding:
            self.engines[self.holding.pop(nid)].in_use -= 1
        if w.then is not None:  # on to the cascade's next model, in its engine's queue
            self.work[nid] = w.then
            self._enqueue(nid)
            return
        self.finish_ms[nid] = self.now
        for child in self.children[nid]:
            if child in self.groups:
                self.got[child] += 1
                if self.got[child] == self.groups[child][0]:
                    self._resolve(child)
            else:
                self.waiting[child] -= 1
                if self.waiting[child] == 0:
                    self._ready(child)

    def _resolve(self, group: str) -> None:
        """A group has its ``k``-th member: it is ready (and done: it takes no time);
        the members still going are cancelled."""
        for m in self.groups[group][1]:
            if m in self.finish_ms:
                continue
            self.cancelled.add(m)
            w = self.work.get(m, Work())
            engine = self.engines.get(w.engine) if w.engine is not None else None
            if engine is not None:
                engine.drop(m)
            if m in self.holding:
                self.engines[self.holding.pop(m)].in_use -= 1
            self.ready_ms.setdefault(m, self.now)
            self.start_ms.setdefault(m, self.now)
            self.finish_ms[m] = self.now
        self.waiting[group] = 0
        self._ready(group)


def simulate(order: Sequence[str], deps: Mapping[str, frozenset[str]],
             work: Mapping[str, Work], engines: Mapping[str, EngineModel],
             priority: Mapping[str, float] | None = None,
             groups: Mapping[str, tuple[int, Sequence[str]]] | None = None) -> Schedule:
    """The schedule of a graph's steps on shared engines (the module's model).

    Args:
        order: step ids, each after its inputs.
        deps: each step's inputs (a group's: its members).
        work: each step's :class:`Work` (absent: none).
        engines: engine name -> :class:`EngineModel`.
        priority: each step's rank in a slot queue, higher first (the remaining
            critical path, ms); ties in ``order``.
        groups: group id -> ``(k, members)``: it resolves when ``k`` members ended.

    Returns:
        The :class:`Schedule`.
    """
    return _Sim(order, deps, work, engines, priority or {}, groups or {}).run()


def critical_chain(order: Sequence[str], deps: Mapping[str, frozenset[str]],
                   schedule: Schedule, groups: Mapping[str, tuple[int, Sequence[str]]]
                   ) -> list[str]:
    """The chain that set the schedule's end, first to last: from the step that ends
    last, back through the input that ended last (a group: through the member that
    resolved it), as :func:`flowlift.tracing.timeline.measured_critical_path` walks a
    run's trace -- so the two compare."""
    if not order:
        return []
    finish = schedule.finish_ms
    pos = {n: i for i, n in enumerate(order)}
    cur = max(order, key=lambda n: (finish[n], pos[n]))
    path = [cur]
    while True:
        preds = [d for d in deps[cur] if d not in schedule.cancelled] if cur in groups \
            else list(deps[cur])
        if not preds:
            break
        cur = max(preds, key=lambda n: (finish[n], pos[n]))
        path.append(cur)
    return path[::-1]


def remaining_ms(order: Sequence[str], deps: Mapping[str, frozenset[str]],
                 schedule: Schedule) -> dict[str, float]:
    """Each step's time from its start to the end of the last step that waits on it
    (itself included): on the critical chain, the schedule's end minus its start."""
    end = dict(schedule.finish_ms)
    for nid in reversed(order):
        for d in deps[nid]:
            if d not in schedule.cancelled:
                end[d] = max(end[d], end[nid])
    return {n: end[n] - schedule.start_ms[n] for n in order}


__all__ = ["PREFILL_BUDGET_TOKENS", "EngineModel", "Schedule", "Work", "critical_chain",
           "remaining_ms", "simulate"]
