"""Working-set admission: start a new session only while the KV of the sessions
expected back soon still fits the engine's cache.

An agent session (a program: :mod:`.programs`) re-reads, at its next turn, everything
its last turn read and wrote: the last prompt plus the answer (and a little more, the
tool's result). Between turns its KV blocks are *free* blocks in vLLM's prefix cache,
which any allocation may evict (least recently used first). When the sessions running
and the sessions out on a tool together need more KV than the cache holds, each new
session's prefill evicts a waiting session's prefix, that session re-prefills it when
its tool returns and evicts another's: the cache thrashes (stock vLLM at 32 agent
sessions on a 23k-token cache served 15% of prompt tokens from cache; bench/RESULTS.md,
issue 35). Holding new sessions at the door until the working set fits stops that
(MARS, 2025: admission control over inference and tool execution; Continuum, 2025:
program-level admission with a TTL on a tool-calling program's KV; Denning's working
set, 1968, is the same idea for pages).

What flowlift knows per session (no I/O here; the scheduler feeds it):

* its KV footprint: the last call's prompt plus completion tokens (from the engine's
  usage, :meth:`WorkingSet.observed`), plus the growth seen between its last two calls
  (its next turn adds about as much);
* whether it runs (a call holds a slot) or is away (on a tool) since when;
* when it should come back: the gaps between a call's end and the same session's next
  call are learned (all sessions together, the latest ``window`` gaps); a session away
  longer than ``horizon_factor`` times their ``quantile`` (clamped to
  ``[min_horizon_s, max_horizon_s]``) is taken to be done and leaves the working set
  (a session that ends early and one whose tool hangs both stop holding others back);
  :meth:`WorkingSet.ended` drops it at once when the end is known (an agent step's last
  turn).

The rule (:meth:`WorkingSet.admits`): the sessions of the working set are ordered by
when they were admitted, and a call of one of them starts only when its own need plus
the needs of the sessions admitted before it fit ``target`` of the cache's capacity
(the oldest always starts: one session larger than the cache still runs). A new
session (or one that came back after it was dropped) goes last. Sessions are admitted
while they are small, so fitting them at the door is not enough: as the admitted ones
grow, the newest fall over the line and their next call waits (their prefix, idle
longest, is what vLLM's LRU evicts first) until older sessions end or leave, and then
re-prefills once instead of evicting the older sessions' prefixes at every turn. This
is a cap on active sessions (a plain semaphore at the door made stock vLLM 3.5x faster
at 32 sessions, issue 35's probe) that follows the sessions' sizes and the cache's
capacity instead of a number tuned per workload.

What it does not do: vLLM (0.32, CPU build) offers no per-request pin, priority or
eviction call on cached blocks (see docs/working_set.md), so admission and order are
the only levers: a running session that grows can still evict a waiting one's blocks.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

Timer = Callable[[], float]


@dataclass(frozen=True, slots=True)
class WorkingSetConfig:
    """Settings of working-set admission (``flowlift serve --working-set`` turns it
    on in the server; off by default there).

    Attributes:
        enabled: False: every call is admitted (vLLM's own LRU alone decides).
        target: share of the KV capacity (0 to 1) the working set may fill.
        new_session_tokens: a new session's footprint before any is learned (tokens).
        quantile: which quantile of the learned tool gaps sets the horizon (0 to 1).
        horizon_factor: how many of those a session may stay away and still count.
        min_horizon_s, max_horizon_s: bounds of the horizon (seconds).
        default_gap_s: the gap assumed before any is learned (seconds).
        window: learned gaps kept (the latest).
        max_sessions: sessions tracked (least recently seen forgotten first).
        chains: a workflow run's document chains (:mod:`flowlift.chains`: steps that
            re-read one prompt prefix) are sessions of their own, so a new document
            starts only while the documents started still fit the cache; False: a run
            is one session (its steps are never held against each other).
    """

    enabled: bool = True
    target: float = 0.9
    new_session_tokens: int = 512
    quantile: float = 0.9
    horizon_factor: float = 2.0
    min_horizon_s: float = 2.0
    max_horizon_s: float = 60.0
    default_gap_s: float = 5.0
    window: int = 256
    max_sessions: int = 10_000
    chains: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 1.0 or not 0.0 <= self.quantile <= 1.0:
            raise ValueError("target must be in (0, 1] and quantile in [0, 1]")
        if self.min_horizon_s <= 0 or self.max_horizon_s < self.min_horizon_s:
            raise ValueError("0 < min_horizon_s <= max_horizon_s")
        if self.window < 1 or self.max_sessions < 1 or self.new_session_tokens < 0:
            raise ValueError("window and max_sessions >= 1, new_session_tokens >= 0")


@dataclass(slots=True)
class SessionKV:
    """One session's KV as the policy sees it (tokens; ``timer`` seconds)."""

    tokens: int = 0
    growth: int = 0
    running: int = 0
    away_since: float | None = None
    calls: int = 0
    seen_at: float = field(default=0.0)
    order: int = 0
    waiting: int = 0
    fresh: bool = True

    def need(self, block: int = 1) -> int:
        """Tokens its next call will hold: what it re-reads plus what it adds, in whole
        ``block``-token blocks plus one (the KV cache allocates whole blocks, and the
        prefix cache keeps only full ones)."""
        if block <= 1:
            return self.tokens + self.growth
        return (-(-(self.tokens + self.growth) // block) + 1) * block


class WorkingSet:
    """Per-session KV footprints and the admission rule (pure; the clock is injected).

    Args:
        config: the settings.
        timer: monotonic seconds; tests inject one.
    """

    def __init__(self, config: WorkingSetConfig | None = None,
                 timer: Timer = time.monotonic) -> None:
        self.config = config or WorkingSetConfig()
        self._timer = timer
        self._sessions: dict[str, SessionKV] = {}
        self._gaps: deque[float] = deque(maxlen=self.config.window)
        self._firsts: deque[int] = deque(maxlen=self.config.window)
        self._order = itertools.count()
        self.held = 0
        """Calls held at the door so far (counted by the scheduler)."""

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    # -- what the scheduler reports ---------------------------------------------------
    def arrived(self, program: str | None) -> None:
        """A call of ``program`` starts to wait for a slot: a known session stays in the
        working set while it waits (one that had left it goes last); a new one enters
        when it starts (:meth:`started`)."""
        s = None if program is None or not self.enabled else self._sessions.get(program)
        if s is None:
            return
        now = self._timer()
        if not self._live(s, now, self.horizon_s()):
            s.order = next(self._order)
        if s.away_since is not None and s.running == 0 and not s.waiting:
            self._gaps.append(now - s.away_since)
        s.waiting += 1

    def left(self, program: str | None) -> None:
        """A call of ``program`` stopped waiting without a slot (cancelled)."""
        s = None if program is None else self._sessions.get(program)
        if s is not None and s.waiting:
            s.waiting -= 1

    def started(self, program: str | None) -> None:
        """A call of ``program`` got a slot."""
        if program is None or not self.enabled:
            return
        now = self._timer()
        s = self._sessions.pop(program, None)
        if s is None:
            s = SessionKV(tokens=self.estimate(program), order=next(self._order))
        s.waiting = max(0, s.waiting - 1)
        s.running += 1
        s.away_since, s.seen_at = None, now
        s.calls += 1
        self._sessions[program] = s  # re-inserted: the most recently seen is last
        while len(self._sessions) > self.config.max_sessions:
            del self._sessions[next(iter(self._sessions))]

    def finished(self, program: str | None) -> None:
        """A call of ``program`` gave its slot back: away until its next call."""
        s = None if program is None else self._sessions.get(program)
        if s is None:
            return
        s.running = max(0, s.running - 1)
        if s.running == 0:
            s.away_since = s.seen_at = self._timer()

    def observed(self, program: str | None, tokens: int) -> None:
        """A call of ``program`` ended holding ``tokens`` (prompt plus completion)."""
        s = None if program is None else self._sessions.get(program)
        if s is None:
            return
        if s.fresh:  # its first footprint replaces the estimate it started with
            self._firsts.append(tokens)
            s.fresh, s.tokens = False, tokens
            return
        s.growth = max(0, tokens - s.tokens)
        s.tokens = max(s.tokens, tokens)

    def ended(self, program: str | None) -> None:
        """``program`` will not call again (its step is over): it leaves at once."""
        if program is not None:
            self._sessions.pop(program, None)

    # -- the rule ---------------------------------------------------------------------
    def horizon_s(self) -> float:
        """How long a session may be away and still count as coming back (seconds)."""
        c = self.config
        gap = c.default_gap_s
        if self._gaps:
            gaps = sorted(self._gaps)
            gap = gaps[min(len(gaps) - 1, int(c.quantile * (len(gaps) - 1) + 0.5))]
        return min(c.max_horizon_s, max(c.min_horizon_s, c.horizon_factor * gap))

    @staticmethod
    def _live(s: SessionKV, now: float, horizon: float) -> bool:
        return (s.running > 0 or s.waiting > 0
                or (s.away_since is not None and now - s.away_since < horizon))

    def members(self, block: int = 1) -> dict[str, int]:
        """The working set now, oldest admitted first: session -> tokens its next call
        will hold (in whole ``block``-token blocks)."""
        now, horizon = self._timer(), self.horizon_s()
        live = sorted((s.order, p) for p, s in self._sessions.items()
                      if self._live(s, now, horizon))
        return {p: self._sessions[p].need(block) for _, p in live}

    def knows(self, program: str | None) -> bool:
        """Whether ``program`` is a session tracked here (one not known is admitted by
        the estimate every unknown session gets)."""
        return program is not None and program in self._sessions

    def tokens(self) -> int:
        """The working set's tokens now."""
        return sum(self.members().values())

    def estimate(self, program: str | None, block: int = 1) -> int:
        """Tokens a call of ``program`` will hold: its own need when known, else the
        mean first call seen (``new_session_tokens`` before any)."""
        s = None if program is None else self._sessions.get(program)
        if s is not None and (s.tokens or not s.fresh):
            return s.need(block)
        first = (round(sum(self._firsts) / len(self._firsts)) if self._firsts
                 else self.config.new_session_tokens)
        return SessionKV(tokens=first).need(block)

    def admits(self, program: str | None, capacity_tokens: int | None,
               block: int | None = None) -> bool:
        """Whether a call of ``program`` may start now on a cache of ``capacity_tokens``
        (None: unknown, every call is admitted) allocated in ``block``-token blocks
        (None: 1)."""
        if not self.enabled or capacity_tokens is None or capacity_tokens <= 0:
            return True
        block = block or 1
        members = self.members(block)
        ahead = 0
        for p, need in members.items():  # oldest first: those admitted before it
            if p == program:
                return ahead == 0 or ahead + need <= self.config.target * capacity_tokens
            ahead += need
        if not members:
            return True
        return ahead + self.estimate(program, block) <= self.config.target * capacity_tokens

    def next_change_s(self) -> float | None:
        """Seconds until the next away session leaves the working set (None: none
        away): when a held call should be looked at again."""
        now, horizon = self._timer(), self.horizon_s()
        left = [s.away_since + horizon - now for s in self._sessions.values()
                if s.running == 0 and s.away_since is not None
                and now - s.away_since < horizon]
        return max(0.0, min(left)) if left else None

    def snapshot(self, capacity_tokens: int | None) -> dict[str, object]:
        """What ``/readyz`` shows."""
        members = self.members()
        return {"enabled": self.enabled, "sessions": len(self._sessions),
                "members": len(members), "tokens": sum(members.values()),
                "capacity_tokens": capacity_tokens,
                "horizon_s": round(self.horizon_s(), 2), "held": self.held}
