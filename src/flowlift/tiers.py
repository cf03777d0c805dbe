"""Service tiers under one deadline: each step on the cheapest tier that still makes it.

Pure planning over data (no I/O). From the steps' dependencies, their durations at the
fast tier and the run's deadline, each step's *latest start* is the deadline minus the
critical path of the step and its descendants at fast-tier estimates
(:func:`latest_starts`). :func:`plan_tiers` walks the steps in dependency order, gives
each the earliest start its planned parents allow, and picks the cheapest tier whose
planned duration (the fast estimate plus the tier's p90 turnaround, plus a margin for
deferred tiers) still ends by the step's latest finish; a step with no such tier gets the
fastest. Among tiers of one price the slower wins (batch before flex: it keeps the
synchronous tiers' rate limits for the steps that need them), so hours of slack go to
batch and minutes to flex. Because a step's earliest start never passes its latest start
when every parent keeps to its own latest finish, a plan never misses the deadline under
the estimates when the all-fast plan does not (the property tests hold it to that).

Turnaround per tier is learned from finished work (:class:`TurnaroundBook`: p50/p90 of
the last observations), with the configured priors until enough is measured.
:func:`must_move` is the watchdog's rule: a deferred step whose latest start has come
moves to the fast tier.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from flowlift.errors import GraphError

SPEED_ORDER: Final = ("priority", "local", "standard", "flex", "batch", "idle")
"""Tiers from fastest to slowest (``idle``: the local engine's deferrable mode, running
only when nothing of a higher class waits)."""
DEFERRED: Final = frozenset({"flex", "batch", "idle"})


@dataclass(frozen=True, slots=True)
class TierProfile:
    """One tier as the planner sees it.

    Attributes:
        tier: ``priority``, ``local``, ``standard``, ``flex`` or ``batch``.
        input_price_per_1k, output_price_per_1k: price of 1,000 tokens (any currency).
        turnaround_p50_s, turnaround_p90_s: time before the work starts or comes back,
            added to the step's fast-tier duration (0 for synchronous tiers).
        margin_s: kept free after the p90 on a deferred tier (0 on the others).
    """

    tier: str
    input_price_per_1k: float
    output_price_per_1k: float
    turnaround_p50_s: float = 0.0
    turnaround_p90_s: float = 0.0
    margin_s: float = 0.0

    def cost(self, input_tokens: float, output_tokens: float) -> float:
        """Price of one call of the given size."""
        return (input_tokens * self.input_price_per_1k
                + output_tokens * self.output_price_per_1k) / 1000.0

    def duration_s(self, fast_s: float) -> float:
        """Planned duration of a step of ``fast_s`` seconds at the fast tier."""
        return fast_s + self.turnaround_p90_s + self.margin_s


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """A step as the planner sees it: its parents, its fast-tier duration (seconds) and
    its size in tokens."""

    step_id: str
    deps: frozenset[str]
    fast_s: float
    input_tokens: float = 0.0
    output_tokens: float = 0.0
    tiers: tuple[TierProfile, ...] | None = None
    """The tiers this step may use (its model's backends); None: the plan's."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's tier and its planned window (seconds from the run's start)."""

    step_id: str
    tier: str
    start_s: float
    finish_s: float
    latest_start_s: float
    cost: float
    standard_cost: float

    @property
    def slack_s(self) -> float:
        """Seconds the step could wait before its latest start (at its planned start)."""
        return self.latest_start_s - self.start_s


@dataclass(frozen=True, slots=True)
class TierPlan:
    """Every step's :class:`StepPlan`, the expected cost against all-standard, and
    whether the plan makes the deadline under the estimates."""

    steps: dict[str, StepPlan]
    deadline_s: float
    cost: float
    standard_cost: float
    feasible: bool

    @property
    def makespan_s(self) -> float:
        """Planned finish of the last step."""
        return max((p.finish_s for p in self.steps.values()), default=0.0)

    def by_tier(self) -> dict[str, int]:
        """Tier -> number of steps planned on it."""
        out: dict[str, int] = {}
        for p in self.steps.values():
            out[p.tier] = out.get(p.tier, 0) + 1
        return out


def _order(steps: Sequence[StepEstimate]) -> list[StepEstimate]:
    by_id = {s.step_id: s for s in steps}
    seen: dict[str, int] = {}
    out: list[StepEstimate] = []

    def visit(s: StepEstimate) -> None:
        stack = [(s, iter(sorted(s.deps)))]
        seen[s.step_id] = 1
        while stack:
            node, deps = stack[-1]
            dep = next(deps, None)
            if dep is None:
                stack.pop()
                seen[node.step_id] = 2
                out.append(node)
            elif dep in by_id and seen.get(dep) == 1:
                raise GraphError([f"cycle through step {dep!r}"])
            elif dep in by_id and dep not in seen:
                seen[dep] = 1
                stack.append((by_id[dep], iter(sorted(by_id[dep].deps))))

    for s in steps:
        if s.step_id not in seen:
            visit(s)
    return out


def latest_starts(steps: Sequence[StepEstimate], deadline_s: float) -> dict[str, float]:
    """Each step's latest start (seconds): the deadline minus the critical path of the
    step and its descendants at fast-tier durations. Parents outside ``steps`` are
    ignored.

    Raises:
        GraphError: the steps' dependencies form a cycle.
    """
    order = _order(steps)
    children: dict[str, list[str]] = {s.step_id: [] for s in order}
    for s in order:
        for d in s.deps:
            if d in children:
                children[d].append(s.step_id)
    tail: dict[str, float] = {}
    for s in reversed(order):
        tail[s.step_id] = s.fast_s + max((tail[c] for c in children[s.step_id]),
                                         default=0.0)
    return {sid: deadline_s - t for sid, t in tail.items()}


def plan_tiers(steps: Sequence[StepEstimate], deadline_s: float,
               tiers: Sequence[TierProfile], *, now_s: float = 0.0,
               finished_s: Mapping[str, float] | None = None) -> TierPlan:
    """The cheapest tier per step that keeps the deadline (module docstring).

    Args:
        steps: the steps still to plan (finished ones belong in ``finished_s``).
        deadline_s: the run's deadline, seconds from its start.
        tiers: the tiers available (a step's own ``tiers`` win); the fastest of them
            (:data:`SPEED_ORDER`) is the fast tier of the estimates, ``standard`` (else
            the fast tier) the baseline of ``standard_cost``.
        now_s: no step starts before this (re-planning during a run).
        finished_s: parent step -> the time it finished.

    Returns:
        The plan; ``feasible`` is False when even the all-fast plan misses the deadline
        (those steps are then planned on the fast tier).

    Raises:
        GraphError: a dependency cycle.
        ValueError: ``tiers`` is empty or names an unknown tier.
    """
    for listed in [tiers, *(s.tiers for s in steps if s.tiers is not None)]:
        _check(listed)
    latest = latest_starts(steps, deadline_s)
    done = dict(finished_s or {})
    finish: dict[str, float] = {}
    plans: dict[str, StepPlan] = {}
    feasible = True
    for s in _order(steps):
        options = s.tiers or tiers
        fast = min(options, key=lambda t: SPEED_ORDER.index(t.tier))
        base = next((t for t in options if t.tier == "standard"), fast)
        start = max([now_s] + [finish.get(d, done.get(d, now_s)) for d in s.deps])
        latest_finish = latest[s.step_id] + s.fast_s
        by_price = sorted(options, key=lambda t: (t.cost(s.input_tokens, s.output_tokens),
                                                t.cost(1000, 1000),
                                                -SPEED_ORDER.index(t.tier)))
        tier = next((t for t in by_price
                     if start + _duration(t, fast, s.fast_s) <= latest_finish + 1e-9), None)
        if tier is None:
            tier, feasible = fast, False
        finish[s.step_id] = start + _duration(tier, fast, s.fast_s)
        plans[s.step_id] = StepPlan(s.step_id, tier.tier, start, finish[s.step_id],
                                    latest[s.step_id],
                                    tier.cost(s.input_tokens, s.output_tokens),
                                    base.cost(s.input_tokens, s.output_tokens))
    return TierPlan(plans, deadline_s, sum(p.cost for p in plans.values()),
                    sum(p.standard_cost for p in plans.values()), feasible)


def _check(tiers: Sequence[TierProfile]) -> None:
    if not tiers:
        raise ValueError("no tiers to plan on")
    unknown = [t.tier for t in tiers if t.tier not in SPEED_ORDER]
    if unknown:
        raise ValueError(f"unknown tiers: {unknown} (known: {', '.join(SPEED_ORDER)})")


def _duration(tier: TierProfile, fast: TierProfile, fast_s: float) -> float:
    return fast_s if tier is fast else tier.duration_s(fast_s)


def must_move(now_s: float, plan: StepPlan, guard_s: float = 0.0) -> bool:
    """The watchdog's rule: a step on a deferred tier that has not answered moves to the
    fast tier once ``now_s`` reaches its latest start minus ``guard_s`` (any later and
    the fast tier cannot make the deadline either)."""
    return plan.tier in DEFERRED and now_s + guard_s >= plan.latest_start_s


@dataclass(slots=True)
class TurnaroundBook:
    """Turnaround per tier, learned from finished work (seconds).

    Args:
        priors: tier -> ``(p50_s, p90_s)`` used until ``min_observations`` are in.
        keep: observations kept per tier (the most recent).
        min_observations: below this many, the prior answers.
    """

    priors: Mapping[str, tuple[float, float]]
    keep: int = 500
    min_observations: int = 20
    _seen: dict[str, deque[float]] = field(default_factory=dict)

    def observe(self, tier: str, turnaround_s: float) -> None:
        """Record one finished unit of work (a batch, or a deferred call)."""
        self._seen.setdefault(tier, deque(maxlen=self.keep)).append(turnaround_s)

    def quantiles(self, tier: str) -> tuple[float, float]:
        """``(p50_s, p90_s)`` of ``tier``: measured, else its prior, else ``(0, 0)``."""
        seen = self._seen.get(tier)
        if seen is None or len(seen) < self.min_observations:
            return self.priors.get(tier, (0.0, 0.0))
        xs = sorted(seen)
        return _quantile(xs, 0.5), _quantile(xs, 0.9)

    def profile(self, base: TierProfile) -> TierProfile:
        """``base`` with this book's turnaround quantiles."""
        p50, p90 = self.quantiles(base.tier)
        return TierProfile(base.tier, base.input_price_per_1k, base.output_price_per_1k,
                           p50, p90, base.margin_s)


def overrun_probability(profile: TierProfile, window_s: float) -> float:
    """Probability that one unit of work on ``profile``'s tier takes longer than
    ``window_s`` seconds, under a log-normal fitted to its p50 and p90 (0 for a tier
    with no turnaround)."""
    p50, p90 = profile.turnaround_p50_s, profile.turnaround_p90_s
    if p50 <= 0 or p90 <= p50:
        return 0.0 if window_s >= p90 else 1.0
    if window_s <= 0:
        return 1.0
    sigma = (math.log(p90) - math.log(p50)) / _Z90
    z = (math.log(window_s) - math.log(p50)) / sigma
    return 0.5 * math.erfc(z / math.sqrt(2))


def watchdog_risk(plan: TierPlan, tiers: Mapping[str, TierProfile]) -> float:
    """Probability that at least one deferred step of ``plan`` outlasts its planned
    window (turnaround p90 plus margin) and the watchdog must move it to the fast tier
    (the deadline still holds under the estimates: this is the risk of paying the fast
    price, not of missing), the steps taken as independent."""
    keep = 1.0
    for step in plan.steps.values():
        profile = tiers.get(step.tier)
        if profile is not None and step.tier in DEFERRED:
            keep *= 1.0 - overrun_probability(
                profile, profile.turnaround_p90_s + profile.margin_s)
    return 1.0 - keep


_Z90: Final = 1.2815515655446004


def _quantile(xs: Sequence[float], q: float) -> float:
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def steps_from(deps: Mapping[str, Iterable[str]], fast_s: Mapping[str, float],
               tokens: Mapping[str, tuple[float, float]] | None = None
               ) -> list[StepEstimate]:
    """:class:`StepEstimate` list from plain maps (step -> parents, step -> seconds,
    step -> (input, output) tokens), e.g. a compiled plan's dependencies and
    ``cost_ms / 1000``."""
    sizes = tokens or {}
    return [StepEstimate(sid, frozenset(deps.get(sid, ())), fast_s[sid],
                         *sizes.get(sid, (0.0, 0.0))) for sid in fast_s]


__all__ = ["DEFERRED", "SPEED_ORDER", "StepEstimate", "StepPlan", "TierPlan",
           "TierProfile", "TurnaroundBook", "latest_starts", "must_move",
           "overrun_probability", "plan_tiers", "steps_from", "watchdog_risk"]
