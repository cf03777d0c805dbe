"""A fake engine with a KV-capacity model, for tests of working-set admission.

Discrete-event simulation (no asyncio, no sockets): agent sessions arrive, each turn
is a call that re-reads the session's whole context and adds ``growth`` tokens; the
engine admits up to ``slots`` calls at once (their KV pinned) and computes one at a
time, first admitted first, a call taking ``per_token_s`` per token it must prefill
(those its session's cached prefix does not cover) plus ``decode_s``;
after a call the session waits ``tool_s`` and comes back. The cache holds
``capacity`` tokens: a running call's context is pinned, the others' prefixes are kept
least recently used first and evicted whole as room is needed (vLLM's prefix cache
frees a finished request's blocks into an LRU free list; a prefix whose first block
went is lost). Admission is the only lever, as on vLLM.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import OrderedDict
from dataclasses import dataclass

from flowlift.proxy.dispatch.slots.working_set import WorkingSet


@dataclass(frozen=True)
class SimSession:
    arrival_s: float
    turns: int
    base: int = 300
    growth: int = 80
    tool_s: float = 1.0


@dataclass
class SimResult:
    mean_s: float
    p90_s: float
    makespan_s: float
    cached_share: float
    held: int


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Sim:
    """The simulation's state; :func:`simulate` runs it."""

    def __init__(self, sessions: list[SimSession], capacity: int, slots: int,
                 per_token_s: float, decode_s: float, working: WorkingSet | None,
                 clock: Clock) -> None:
        self.sessions, self.capacity, self.slots = sessions, capacity, slots
        self.per_token_s, self.decode_s = per_token_s, decode_s
        self.working, self.clock = working, clock
        self.cache: OrderedDict[int, int] = OrderedDict()  # session -> cached prefix
        self.pinned: dict[int, int] = {}
        self.turns = [0] * len(sessions)
        self.ends = [0.0] * len(sessions)
        self.queue: list[int] = []  # sessions whose next call waits, in arrival order
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = itertools.count()
        self.work: list[tuple[int, float]] = []  # admitted calls waiting for compute
        self.busy_until = 0.0
        self.running = self.prompt = self.cached = self.held = 0
        self.ticking = False
        for i, s in enumerate(sessions):
            self.push(s.arrival_s, "ready", i)

    def push(self, at: float, kind: str, i: int) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, i))

    def evict(self) -> None:
        while sum(self.pinned.values()) + sum(self.cache.values()) > self.capacity \
                and self.cache:
            self.cache.popitem(last=False)  # least recently used first

    def start(self, i: int) -> None:
        s = self.sessions[i]
        need = s.base + self.turns[i] * s.growth
        hit = min(self.cache.pop(i, 0), need)
        self.prompt += need
        self.cached += hit
        self.pinned[i] = need + 16
        self.evict()
        self.running += 1
        if self.working is not None:
            self.working.started(str(i))
        self.work.append((i, (need - hit) * self.per_token_s + self.decode_s))
        self.serve()

    def serve(self) -> None:
        if self.work and self.busy_until <= self.clock.now:  # one call computes at a time
            i, t = self.work.pop(0)
            self.busy_until = self.clock.now + t
            self.push(self.busy_until, "done", i)

    def done(self, i: int) -> None:
        self.running -= 1
        total = self.pinned.pop(i)
        self.turns[i] += 1
        if self.working is not None:
            self.working.observed(str(i), total)
            self.working.finished(str(i))
        self.serve()
        if self.turns[i] == self.sessions[i].turns:
            self.ends[i] = self.clock.now
            if self.working is not None:
                self.working.ended(str(i))
            return
        self.cache[i] = total
        self.evict()
        self.push(self.clock.now + self.sessions[i].tool_s, "ready", i)

    def admit(self) -> None:
        for j in list(self.queue):
            if self.running >= self.slots:
                break
            if self.working is not None and not self.working.admits(str(j), self.capacity):
                self.held += 1
                continue
            self.queue.remove(j)
            self.start(j)
        nxt = self.working.next_change_s() if self.working and self.queue else None
        if nxt is not None and not self.ticking:  # a held call looks again when one leaves
            self.ticking = True
            self.push(self.clock.now + nxt + 1e-6, "tick", -1)

    def run(self) -> SimResult:
        while self.events:
            self.clock.now, _, kind, i = heapq.heappop(self.events)
            if kind == "tick":
                self.ticking = False
            elif kind == "ready":
                self.queue.append(i)
                if self.working is not None:
                    self.working.arrived(str(i))
            else:
                self.done(i)
            self.admit()
        times = sorted(self.ends[i] - s.arrival_s for i, s in enumerate(self.sessions))
        return SimResult(statistics.mean(times), times[int(0.9 * (len(times) - 1) + 0.5)],
                         max(self.ends), self.cached / max(1, self.prompt), self.held)


def simulate(sessions: list[SimSession], *, capacity: int, slots: int = 4,
             per_token_s: float = 0.002, decode_s: float = 0.3,
             working: WorkingSet | None = None, clock: Clock | None = None) -> SimResult:
    """Run ``sessions`` to the end; first come, first served among admitted calls
    (``working``: None admits every call)."""
    return _Sim(sessions, capacity, slots, per_token_s, decode_s, working,
                clock or Clock()).run()
