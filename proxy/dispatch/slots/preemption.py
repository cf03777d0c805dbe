"""Which running batch requests to preempt when interactive work arrives (pure code).

On an engine whose per-token time grows with the batch (any CPU, a saturated GPU),
capping only *new* batch admissions while interactive work runs
(:class:`~flowlift.proxy.dispatch.slots.scheduler.PrioritySlots`) still leaves every batch
request already decoding in the batch: interactive latency stays a multiple of its
unloaded value. With preemption on (``flowlift serve --scheduling preempt``), the slots
bring the running batch down to ``batch_cap_when_interactive`` by aborting the requests
:func:`choose_victims` picks; each resumes later as a continuation from its token ids
(:mod:`flowlift.local_engine.continuation`, :mod:`flowlift.proxy.dispatch.slots.resumable`).

The order (who goes first) follows Autellix (2025: program-level priority; least
attained service first) and vLLM's own recompute preemption (the newest request goes
first: it has the least KV to give back and the least to redo):

1. the least urgent: the largest :class:`~flowlift.proxy.dispatch.slots.scheduler.Priority`
   (class, then shortest remaining critical path, then most deadline slack);
2. the least progress (fewest tokens generated: the least to prefill again);
3. the most tokens still to generate.

A request within ``min_remaining_tokens`` of its ``max_tokens`` is left to finish: it
frees its slot sooner than a preemption would.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the scheduler imports this module
    from flowlift.proxy.dispatch.slots.batch_cap import BatchPlan
    from flowlift.proxy.dispatch.slots.scheduler import Priority


@dataclass(frozen=True, slots=True)
class Candidate:
    """A running request that may be preempted.

    Attributes:
        key: what the caller finds the request by.
        priority: its slot's priority.
        generated_tokens: tokens it has generated so far.
        max_tokens: its limit (None: none).
        in_prefill: its current engine request has produced no token yet.
        prefill_tokens: the prompt tokens it counts in prefill (while ``in_prefill``).
    """

    key: Hashable
    priority: Priority
    generated_tokens: int = 0
    max_tokens: int | None = None
    in_prefill: bool = False
    prefill_tokens: int = 0

    @property
    def remaining_tokens(self) -> float:
        """Tokens it may still generate (infinite without a limit)."""
        if self.max_tokens is None:
            return float("inf")
        return max(self.max_tokens - self.generated_tokens, 0)


class Preemptible(Protocol):
    """A running request registered with its slots while it may be preempted."""

    def candidate(self) -> Candidate:
        """What :func:`choose_victims` weighs, as of now."""
        ...

    def preempt(self) -> None:
        """Ask it to stop now and resume later (it releases its slot when stopped)."""
        ...


def choose_victims(candidates: Sequence[Candidate], count: int,
                   min_remaining_tokens: int = 4) -> list[Candidate]:
    """The ``count`` candidates to preempt, first choice first (see the module's order).

    Args:
        candidates: the running requests that may be preempted.
        count: how many to preempt (0 or less: none).
        min_remaining_tokens: candidates with fewer tokens than this left to generate
            are never chosen.

    Returns:
        At most ``count`` candidates; fewer when too few may be preempted.
    """
    if count <= 0:
        return []
    eligible = [c for c in candidates if c.remaining_tokens >= min_remaining_tokens]
    eligible.sort(key=lambda c: (_negated(c.priority), c.generated_tokens,
                                 -c.remaining_tokens))
    return eligible[:count]


def _negated(p: Priority) -> tuple[float, float, float]:
    """A key that sorts the least urgent priority first."""
    return (-p.class_rank, -p.neg_remaining_ms, -p.slack_ms)


def victims_beside_interactive(candidates: Sequence[Candidate], plan: BatchPlan,
                               min_remaining_tokens: int = 4,
                               stop_decoding: bool = True) -> list[Candidate]:
    """The running batch requests to preempt so that what stays fits ``plan``
    (:func:`~flowlift.proxy.dispatch.slots.batch_cap.plan_beside_interactive`).

    Requests still in prefill go first: their prompt tokens count against
    ``plan.prefill_tokens`` (smallest first is kept) and they have generated nothing
    (their computed KV blocks stay in the prefix cache). Then, while more than
    ``plan.decode_cap`` requests would stay, the decoding ones in
    :func:`choose_victims`'s order.

    Args:
        stop_decoding: False: decoding requests are never chosen (under a steady batch
            cap, ``--batch-cap``, they already fit); a request in prefill is kept only
            while it fits beside all of them.

    Returns:
        The requests to preempt (a request within ``min_remaining_tokens`` of its limit
        is never chosen).
    """
    prefilling = sorted((c for c in candidates if c.in_prefill),
                        key=lambda c: c.prefill_tokens)
    decoding = [c for c in candidates if not c.in_prefill]
    stop: list[Candidate] = []
    room = plan.decode_cap - (0 if stop_decoding else len(decoding))
    kept, allowance = 0, plan.prefill_tokens
    for c in prefilling:
        if c.prefill_tokens <= allowance and kept < room:
            allowance -= c.prefill_tokens
            kept += 1
        else:
            stop.append(c)
    if not stop_decoding:
        return stop
    excess = len(decoding) + kept - plan.decode_cap
    return stop + choose_victims(decoding, excess, min_remaining_tokens)
