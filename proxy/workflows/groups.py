"""First-wins and quorum groups: resolved on the proxy, the losers cancelled at once.

A group node (:class:`~flowlift.graph.GroupNode`) lists sibling steps. It resolves
as soon as the first member's result arrives (``first``; a result is an output that
passed its contract: a failed or skipped member is none), or as soon as ``k`` members'
results agree on the field ``agree_on`` (``quorum``; compared as JSON). Its value is the
winning member's output (quorum: the first of the agreeing ones to finish). Then every
member still queued or running is cancelled: a queued one is dropped, a running
engine request aborted, and its trace keeps the tokens it generated until then (what it
is billed for). Cancelled members are *skipped* (:mod:`.conditions`): steps that need
their value are skipped too.

A quorum that can no longer be reached (too few members left to agree) fails the group
at once, cancelling the rest; so does a group none of whose members delivered.

Used by :class:`~flowlift.proxy.workflows.runs.Run`; the ``group.resolved`` event
``{step_id, winner, agreeing, cancelled}`` records the outcome.

Sources: "first good result wins, cancel the rest" (LangGraph users); early-exit voting
as in LAMaS (2026), which removes redundant agent calls as execution unfolds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from flowlift.errors import StepFailed
from flowlift.graph import GroupNode, project

RESOLVED: Final = "group.resolved"


@dataclass(slots=True)
class Resolution:
    """How a group ended: the winner, the members that agreed, those cancelled."""

    winner: str
    value: Any
    agreeing: list[str]
    cancelled: list[str] = field(default_factory=list)

    def event(self, group_id: str) -> dict[str, Any]:
        return {"step_id": group_id, "winner": self.winner, "agreeing": self.agreeing,
                "cancelled": self.cancelled}


def agreement_key(value: Any, path: Sequence[str]) -> str | None:
    """The JSON text a quorum compares (None: the output lacks the field)."""
    try:
        return json.dumps(project(value, tuple(path)), sort_keys=True, ensure_ascii=False)
    except (KeyError, IndexError, TypeError):
        return None


async def resolve(group: GroupNode, done: Mapping[str, asyncio.Event],
                  result: Callable[[str], tuple[bool, Any]],
                  cancel: Callable[[Sequence[str], str], None]) -> Resolution:
    """Wait for ``group``'s members until it resolves, then cancel the rest.

    Args:
        group: the group node.
        done: member id -> set once the member has its outcome.
        result: member id -> ``(delivered, value)``, its outcome once done.
        cancel: ``(member ids, reason)``: stop members still queued or running.

    Returns:
        The resolution (``cancelled``: the members stopped).

    Raises:
        StepFailed: no member delivered, or the quorum can no longer be reached.
    """
    waiting = list(group.members)
    tallies: dict[str, list[str]] = {}
    delivered = 0
    while waiting:
        ready = [m for m in waiting if done[m].is_set()]
        if not ready:
            await _first_done([done[m] for m in waiting])
            continue
        for m in ready:
            waiting.remove(m)
            ok, value = result(m)
            if not ok:
                continue
            delivered += 1
            key = m if group.mode == "first" else agreement_key(value, group.agree_on)
            if key is None:
                continue
            agreeing = tallies.setdefault(key, [])
            agreeing.append(m)
            if len(agreeing) >= group.k:
                won = Resolution(agreeing[0], result(agreeing[0])[1], list(agreeing),
                                 list(waiting))
                cancel(waiting, f"group {group.id!r} resolved by {agreeing[0]!r}")
                return won
        best = max((len(v) for v in tallies.values()), default=0)
        if waiting and best + len(waiting) < group.k:
            cancel(waiting, f"group {group.id!r} failed: no quorum possible")
            break
    raise StepFailed(group.id, _why_unresolved(group, delivered, tallies))


def _why_unresolved(group: GroupNode, delivered: int, tallies: Mapping[str, list[str]]
                    ) -> str:
    if not delivered:
        return (f"group {group.id!r}: none of its {len(group.members)} members delivered a "
                "result (each failed or was skipped)")
    best = max((len(v) for v in tallies.values()), default=0)
    on = ".".join(group.agree_on) or "the whole output"
    return (f"group {group.id!r}: no quorum: {delivered} result(s), at most {best} agree "
            f"on {on} (k={group.k})")


async def _first_done(events: Sequence[asyncio.Event]) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
