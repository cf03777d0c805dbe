"""Program-level scheduling: least attained service over programs, starvation bounded.

A *program* is everything one agent session sends the engine: the turns of a workflow
run's steps (agent-step turns, open-run steps; the program is the run id) or the chat
completions of one ``X-Flowlift-Session`` / ``X-Flowlift-Workflow`` (the same id the
proxy routes by for affinity). Autellix (Luo et al., 2025, "Autellix: An Efficient
Serving Engine for LLM Agents as General Programs", §4.2 PLAS) orders an engine's calls
by their program's *attained service*: the engine time of all its finished and running
calls so far, lower first. Short sessions then finish without queueing behind the
turns of long ones, although no session's length is known ahead (least attained
service is the blind policy that approximates shortest-remaining-first when sessions
arrive over time).

How it combines with the existing order (:class:`~.scheduler.Priority`); the slot
queue's sort key is::

    (class rank, LAS level, -remaining critical path, slack, arrival)

* **class first**: ``interactive`` before ``batch`` before ``idle`` always holds, as
  before; program scheduling only reorders work *within* a class;
* **LAS level**: as in Autellix's multilevel queues, attained service is discretized:
  level 0 below ``quantum_s`` engine-seconds, then one level per doubling
  (``1 + floor(log2(attained / quantum_s))``, capped at ``max_level``). The level is
  fixed when the call starts waiting;
* **inside a level**: the old order (critical path longest first, least slack,
  arrival), so a workflow's own critical-path order survives among programs that have
  had about the same service.

**Starvation bound.** A waiter that has waited ``max_wait_s`` goes before every
waiter of its class regardless of LAS level and critical path (Autellix bounds
starvation with a wait-to-service ratio that promotes a call to the top queue; a wall
clock bound is simpler to state and to test). Its grant then waits only for a free
slot: the wait of any call is at most ``max_wait_s`` plus the time until a slot frees,
among calls of its class (the class order itself is not aged: batch work still yields
to interactive work, as before).

**Memory bound.** The table keeps at most ``max_programs`` programs, each forgotten
``ttl_s`` after its last call started or ended (a :class:`cachetools.TTLCache`: the
least recently used goes first when full); a program that comes back after that starts
again at level 0.

**Keeping a waiting session's KV** (issue 24 §2). While an agent step's tool calls are
out, its next turn is known to come: :meth:`ProgramBook.keep` marks the program for
``keep_ttl_s`` (Continuum, 2025: a TTL on the KV of a program whose tool is running).
A session-tagged chat completion whose answer calls tools is marked the same way (its
next turn is likely, not known: the TTL bounds a guess that is wrong).
While any such mark is live and the engine's KV cache is fuller than
``keep_kv_usage`` (``Engine.kv_cache_usage``: on vLLM, the share the unfinished
requests' prompts plus ``max_tokens`` may take), the slot queue does not start a call
of a program with *no* attained service (a new session's first prefill, the largest
allocation that would push a waiting session's freed prefix blocks out of vLLM's LRU
free list); calls of sessions already served go on. A mark ends when the program's
next call starts waiting or its TTL runs out, and a held call waits at most
``keep_ttl_s`` from its arrival, however many marks follow. When the engine has room,
its prefill-ahead (:mod:`.prefill_ahead`) re-warms the prefix during the same window.
What it does *not* guarantee on vLLM: the cached blocks of a finished request are free
blocks that any allocation may evict (vLLM has no pin for them), so running sessions'
growth can still evict a waiting session's prefix; the mark only holds back the new
sessions' prefills.

Pure bookkeeping; no I/O. The clock is injected (``timer``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachetools import TTLCache

Timer = Callable[[], float]


@dataclass(frozen=True, slots=True)
class ProgramConfig:
    """Settings of program-level scheduling (``flowlift serve --program-scheduling``).

    Attributes:
        enabled: False: no LAS level, no aging, no keep (every program at level 0).
        quantum_s: engine-seconds of attained service below which a program is level 0.
        max_level: the highest LAS level.
        max_wait_s: a call waiting this long goes first in its class (starvation bound).
        max_programs: programs kept in the table (least recently used go first).
        ttl_s: a program is forgotten this long after its last call ended.
        keep_ttl_s: how long a program whose tool is out holds back new sessions.
        keep_kv_usage: KV-cache share (0 to 1) above which new sessions are held back
            while a kept program waits.
    """

    enabled: bool = True
    quantum_s: float = 1.0
    max_level: int = 16
    max_wait_s: float = 30.0
    max_programs: int = 10_000
    ttl_s: float = 600.0
    keep_ttl_s: float = 10.0
    keep_kv_usage: float = 0.8

    def __post_init__(self) -> None:
        if self.quantum_s <= 0 or self.max_wait_s <= 0 or self.ttl_s <= 0:
            raise ValueError("quantum_s, max_wait_s and ttl_s must be > 0")
        if self.max_programs < 1 or self.max_level < 0 or self.keep_ttl_s < 0:
            raise ValueError("max_programs must be >= 1, max_level and keep_ttl_s >= 0")
        if not 0.0 <= self.keep_kv_usage <= 1.0:
            raise ValueError("keep_kv_usage must be between 0 and 1")


@dataclass(slots=True)
class Program:
    """One program's service: finished calls' engine time and the running calls'
    start times (``timer`` seconds)."""

    service_s: float = 0.0
    running: list[float] = field(default_factory=list)
    calls: int = 0

    def attained_s(self, now: float) -> float:
        return self.service_s + sum(now - t for t in self.running)


class ProgramBook:
    """Attained service per program, bounded in count and age.

    Args:
        config: the settings.
        timer: the clock (seconds, monotonic); inject one in tests.
    """

    def __init__(self, config: ProgramConfig | None = None,
                 timer: Timer = time.monotonic) -> None:
        self.config = config or ProgramConfig()
        self._timer = timer
        self._table: TTLCache[str, Program] = TTLCache(
            self.config.max_programs, self.config.ttl_s, timer=timer)
        self._keep: TTLCache[str, float] = TTLCache(
            self.config.max_programs, max(self.config.keep_ttl_s, 1e-9), timer=timer)
        self.aged = 0
        """Calls granted ahead of their LAS order because they waited ``max_wait_s``."""
        self.held = 0
        """Times a new program's call was held back to keep a waiting session's KV."""
        self.marks = 0
        """Times a program was marked as waiting for its tool (:meth:`keep`)."""

    def __len__(self) -> int:
        self._table.expire()
        return len(self._table)

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def now(self) -> float:
        return self._timer()

    def attained_s(self, program: str | None) -> float:
        """Engine-seconds of ``program``'s finished and running calls (0: unknown)."""
        entry = None if program is None else self._table.get(program)
        return 0.0 if entry is None else entry.attained_s(self._timer())

    def known(self, program: str | None) -> bool:
        """True when ``program`` has had (or has) a call on this engine."""
        return program is not None and program in self._table

    def level(self, program: str | None) -> int:
        """The LAS level of ``program`` now (0: least served; see the module doc)."""
        if not self.config.enabled:
            return 0
        return las_level(self.attained_s(program), self.config.quantum_s,
                         self.config.max_level)

    def started(self, program: str | None) -> None:
        """A call of ``program`` got an engine slot."""
        if program is None or not self.config.enabled:
            return
        entry = self._table.get(program) or Program()
        entry.running.append(self._timer())
        entry.calls += 1
        self._table[program] = entry  # (re)insert: the TTL restarts

    def finished(self, program: str | None) -> None:
        """A call of ``program`` gave its slot back: its engine time joins the service
        (the oldest running start is closed: the sum is the same whichever ended)."""
        if program is None or not self.config.enabled:
            return
        entry = self._table.get(program)
        if entry is None or not entry.running:
            return
        entry.service_s += self._timer() - entry.running.pop(0)
        self._table[program] = entry

    # -- keeping a waiting session's KV ------------------------------------------------
    def keep(self, program: str | None) -> None:
        """``program``'s next call is known to come (its tool is out): hold back new
        programs for ``keep_ttl_s`` while the KV cache is full."""
        if program is not None and self.config.enabled and self.config.keep_ttl_s > 0:
            self._keep[program] = self._timer() + self.config.keep_ttl_s
            self.marks += 1

    def unkeep(self, program: str | None) -> None:
        """``program``'s next call came."""
        if program is not None:
            self._keep.pop(program, None)

    def keeping(self) -> int:
        """Programs whose next call is awaited (marks not yet expired)."""
        self._keep.expire()
        return len(self._keep)

    def next_keep_expiry_s(self) -> float | None:
        """Seconds until the soonest keep mark expires (None: none)."""
        self._keep.expire()
        if not self._keep:
            return None
        return max(0.0, min(self._keep.values()) - self._timer())

    def hold_back(self, program: str | None, kv_usage: float | None) -> bool:
        """True when a call of ``program`` should not start now: it is a new program,
        a waiting session's KV is kept and the cache is fuller than ``keep_kv_usage``."""
        if (not self.config.enabled or kv_usage is None
                or kv_usage <= self.config.keep_kv_usage or self.known(program)):
            return False
        return self.keeping() > 0

    def snapshot(self) -> dict[str, Any]:
        """What ``/readyz`` shows: programs tracked, kept, aged and held counts."""
        return {"enabled": self.config.enabled, "programs": len(self),
                "max_programs": self.config.max_programs, "keeping": self.keeping(),
                "aged_grants": self.aged, "held_back": self.held, "keep_marks": self.marks}


def las_level(attained_s: float, quantum_s: float, max_level: int) -> int:
    """Autellix's discretized attained service: 0 below ``quantum_s``, then one level
    per doubling, at most ``max_level``."""
    if attained_s < quantum_s:
        return 0
    return min(max_level, 1 + math.floor(math.log2(attained_s / quantum_s)))
