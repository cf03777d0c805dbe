"""Agent sessions: a bounded, expiring table of what each session's turns reused.

An agent session (requests with the same ``X-Flowlift-Session`` header) sends, at turn
N+1, turn N's prompt plus the model's answer plus something new (a tool result, the
next question). Kept on one engine, the engine's prefix cache serves all of that but
the new part (case W5). The table records, per session, the backend it is served by
and, per turn, the prompt, completion and cached prompt tokens from the engine's usage,
so the reuse can be checked (``GET /v1/sessions/{id}``, :mod:`flowlift.proxy.sessions.api`).

Bounded on both axes: at most ``max_sessions`` sessions (least recently used go first)
that expire ``ttl_s`` after their last turn, and the latest ``max_turns`` turns per
session (older ones are summed into the totals). Unique session ids cannot grow it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from cachetools import TTLCache

from flowlift.proxy.tenants import tenant_of

__all__ = ["SESSIONS", "Session", "SessionTable", "Turn", "observe", "program_of"]

Timer = Callable[[], float]
OnOutput = Callable[[str, "dict[str, Any] | None"], None]


@dataclass(frozen=True, slots=True)
class Turn:
    """One answered request of a session.

    Attributes:
        prompt_tokens, completion_tokens, cached_tokens: the engine's usage.
        reusable_tokens: the previous turn's prompt plus answer (0 on the first turn):
            what turn N+1 repeats, so what the prefix cache could serve at most.
        backend: the backend that answered.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reusable_tokens: int
    backend: str | None = None

    @property
    def reuse_ratio(self) -> float | None:
        """Cached tokens over reusable tokens (capped at 1; ``None`` on a first turn)."""
        if not self.reusable_tokens:
            return None
        return min(1.0, self.cached_tokens / self.reusable_tokens)

    def answer_cached(self, previous: Turn | None) -> int | None:
        """How many of the previous answer's tokens the cache served this turn."""
        if previous is None:
            return None
        return max(0, min(self.cached_tokens, self.reusable_tokens) - previous.prompt_tokens)

    def to_json(self, previous: Turn | None = None) -> dict[str, Any]:
        ratio = self.reuse_ratio
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
                "reusable_tokens": self.reusable_tokens,
                "previous_answer_cached_tokens": self.answer_cached(previous),
                "reuse_ratio": None if ratio is None else round(ratio, 4),
                "backend": self.backend}


@dataclass(slots=True)
class Session:
    """What the table keeps about one session (the latest ``max_turns`` turns)."""

    id: str
    backend: str | None
    created_at: float
    max_turns: int
    last_at: float = 0.0
    turns: deque[Turn] = field(default_factory=deque)
    turn_count: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reusable_tokens: int = 0

    def add(self, turn: Turn, now: float) -> None:
        self.turns.append(turn)
        while len(self.turns) > self.max_turns:
            self.turns.popleft()
        self.turn_count += 1
        self.prompt_tokens += turn.prompt_tokens
        self.cached_tokens += turn.cached_tokens
        self.reusable_tokens += turn.reusable_tokens
        self.last_at = now

    @property
    def last(self) -> Turn | None:
        return self.turns[-1] if self.turns else None

    def to_json(self) -> dict[str, Any]:
        """The ``GET /v1/sessions/{id}`` body: totals and the kept turns."""
        first = self.turn_count - len(self.turns) + 1
        turns, previous = [], None
        for n, turn in enumerate(self.turns):
            turns.append({"turn": first + n, **turn.to_json(previous)})
            previous = turn
        if first > 1 and turns:
            turns[0]["previous_answer_cached_tokens"] = None  # its predecessor was dropped
        ratio = (min(1.0, self.cached_tokens / self.reusable_tokens)
                 if self.reusable_tokens else None)
        return {"id": self.id, "object": "flowlift.session", "backend": self.backend,
                "turn_count": self.turn_count, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "reusable_tokens": self.reusable_tokens,
                "reuse_ratio": None if ratio is None else round(ratio, 4),
                "turns": turns}


class SessionTable:
    """Sessions by id, bounded in count and age (a ``cachetools.TTLCache``), kept per
    tenant (:mod:`flowlift.proxy.tenants`; ``tenant=None``: anonymous): one tenant's
    session id never reaches another's turns.

    Args:
        max_sessions: sessions kept; the least recently used goes when a new one comes.
        ttl_s: a session is forgotten this long after its last turn.
        max_turns: turns kept per session (older ones count in the totals only).
        timer: the clock (seconds, monotonic); inject one in tests.
    """

    def __init__(self, *, max_sessions: int = 10_000, ttl_s: float = 1800.0,
                 max_turns: int = 256, timer: Timer = time.monotonic) -> None:
        if max_sessions < 1 or ttl_s <= 0 or max_turns < 1:
            raise ValueError("max_sessions and max_turns must be >= 1 and ttl_s > 0")
        self.max_turns = max_turns
        self.ttl_s = ttl_s
        self._timer = timer
        self._table: TTLCache[tuple[str | None, str], Session] = TTLCache(
            max_sessions, ttl_s, timer=timer)

    def __len__(self) -> int:
        self._table.expire()
        return len(self._table)

    def __contains__(self, session_id: str) -> bool:
        return (None, session_id) in self._table

    def get(self, session_id: str, tenant: str | None = None) -> Session | None:
        """``tenant``'s live session, or ``None`` (unknown, expired, or another's)."""
        return self._table.get((tenant, session_id))

    def _session(self, session_id: str, backend: str | None, tenant: str | None) -> Session:
        session = self._table.get((tenant, session_id))
        if session is None:
            now = self._timer()
            session = Session(session_id, backend, created_at=now, max_turns=self.max_turns,
                              last_at=now)
        self._table[(tenant, session_id)] = session  # (re)insert: the TTL restarts at each turn
        return session

    def record(self, session_id: str, usage: dict[str, Any] | None,
               backend: str | None = None, tenant: str | None = None) -> Turn:
        """Add a turn to ``tenant``'s session from an OpenAI ``usage`` object
        (``prompt_tokens_details.cached_tokens``).

        Returns:
            The recorded turn.
        """
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        session = self._session(session_id, backend, tenant)
        if backend is not None and session.backend is None:
            session.backend = backend
        last = session.last
        turn = Turn(int(usage.get("prompt_tokens") or 0),
                    int(usage.get("completion_tokens") or 0),
                    int(details.get("cached_tokens") or 0),
                    0 if last is None else last.prompt_tokens + last.completion_tokens,
                    backend)
        session.add(turn, self._timer())
        return turn


SESSIONS: web.AppKey[SessionTable] = web.AppKey("flowlift_sessions", SessionTable)


def program_of(request: web.Request) -> str | None:
    """The program of an OpenAI request for program-level scheduling
    (:mod:`flowlift.proxy.dispatch.slots.programs`): its ``X-Flowlift-Workflow`` id, else its
    ``X-Flowlift-Session`` id (the ids the proxy routes by for affinity), kept apart per
    tenant; None: neither header (the request is its own program at level 0)."""
    program = (request.headers.get("x-flowlift-workflow")
               or request.headers.get("x-flowlift-session"))
    if not program:
        return None
    tenant = tenant_of(request)
    return program if tenant is None else f"{tenant}/{program}"


def observe(request: web.Request, backend: str | None,
            on_output: OnOutput | None) -> OnOutput | None:
    """``on_output`` that also records the answer into the request's session.

    Unchanged when the request has no ``X-Flowlift-Session`` header or the app has no
    session table.
    """
    session_id = request.headers.get("x-flowlift-session")
    table = request.app.get(SESSIONS)
    if not session_id or table is None:
        return on_output

    tenant = tenant_of(request)

    def record(text: str, usage: dict[str, Any] | None) -> None:
        table.record(session_id, usage, backend, tenant)
        if on_output is not None:
            on_output(text, usage)
    return record
