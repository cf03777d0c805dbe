"""The tier planner (flowlift.tiers): latest starts, the cheapest tier that keeps the
deadline, learned turnaround, the watchdog's rule; property-based."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlift.errors import GraphError
from flowlift.tiers import (
    StepEstimate,
    TierProfile,
    TurnaroundBook,
    latest_starts,
    must_move,
    plan_tiers,
)

STANDARD = TierProfile("standard", 1.0, 4.0)
FLEX = TierProfile("flex", 0.5, 2.0, turnaround_p50_s=60, turnaround_p90_s=300,
                   margin_s=120)
BATCH = TierProfile("batch", 0.5, 2.0, turnaround_p50_s=420, turnaround_p90_s=3600,
                    margin_s=1800)
ALL = [STANDARD, FLEX, BATCH]


def chain(n: int, fast_s: float = 10.0) -> list[StepEstimate]:
    return [StepEstimate(f"s{i}", frozenset({f"s{i - 1}"} if i else set()), fast_s,
                         1000, 200) for i in range(n)]


def test_latest_start_is_the_deadline_minus_the_descendants_critical_path() -> None:
    steps = [StepEstimate("a", frozenset(), 5), StepEstimate("b", frozenset({"a"}), 10),
             StepEstimate("c", frozenset({"a"}), 30), StepEstimate("d", frozenset({"b", "c"}), 1)]
    assert latest_starts(steps, 100) == {"a": 64, "b": 89, "c": 69, "d": 99}


def test_a_cycle_is_a_graph_error() -> None:
    with pytest.raises(GraphError, match="cycle"):
        latest_starts([StepEstimate("a", frozenset({"b"}), 1),
                       StepEstimate("b", frozenset({"a"}), 1)], 100)


def test_hours_of_slack_go_to_batch_minutes_to_flex_seconds_to_standard() -> None:
    assert {p.tier for p in plan_tiers(chain(7), 24 * 3600, ALL).steps.values()} == {"batch"}
    minutes = plan_tiers(chain(3), 1200, ALL)
    assert [p.tier for p in minutes.steps.values()] == ["flex", "flex", "standard"]
    seconds = plan_tiers(chain(3), 40, ALL)
    assert {p.tier for p in seconds.steps.values()} == {"standard"} and seconds.feasible
    assert plan_tiers(chain(3), 20, ALL).feasible is False


def test_the_plan_spends_half_when_every_step_can_wait() -> None:
    plan = plan_tiers(chain(7), 24 * 3600, ALL)
    assert plan.cost == pytest.approx(0.5 * plan.standard_cost)
    assert plan.by_tier() == {"batch": 7} and plan.makespan_s <= 24 * 3600


def test_replanning_starts_no_step_before_now_or_its_finished_parents() -> None:
    steps = chain(7)[3:]
    plan = plan_tiers(steps, 24 * 3600, ALL, now_s=20 * 3600, finished_s={"s2": 19 * 3600})
    assert plan.steps["s3"].start_s == 20 * 3600
    assert [p.tier for p in plan.steps.values()] == ["batch", "batch", "flex", "flex"]
    assert plan.makespan_s <= 24 * 3600


@st.composite
def dags(draw: st.DrawFn) -> list[StepEstimate]:
    n = draw(st.integers(1, 12))
    steps = []
    for i in range(n):
        deps = draw(st.sets(st.integers(0, i - 1), max_size=3)) if i else set()
        steps.append(StepEstimate(f"s{i}", frozenset(f"s{d}" for d in deps),
                                  draw(st.floats(0.1, 600)), draw(st.floats(0, 5000)),
                                  draw(st.floats(0, 2000))))
    return steps


tier_lists = st.lists(st.sampled_from([*ALL, TierProfile("priority", 2, 8),
                                       TierProfile("local", 0.1, 0.1, 0, 5)]),
                      min_size=1, max_size=5, unique_by=lambda t: t.tier)


@settings(max_examples=300, deadline=None)
@given(dags(), st.floats(1, 48 * 3600), tier_lists)
def test_no_plan_misses_the_deadline_when_all_fast_would_not(
        steps: list[StepEstimate], deadline_s: float, tiers: list[TierProfile]) -> None:
    plan = plan_tiers(steps, deadline_s, tiers)
    fast = plan_tiers(steps, deadline_s, [min(tiers, key=lambda t: t.turnaround_p90_s
                                              + t.margin_s)])
    if fast.makespan_s <= deadline_s:
        assert plan.feasible
        assert plan.makespan_s <= deadline_s + 1e-6
    by_id = {s.step_id: s for s in steps}
    for p in plan.steps.values():  # a step starts after its parents finish
        assert all(plan.steps[d].finish_s <= p.start_s + 1e-9 for d in by_id[p.step_id].deps)


@settings(max_examples=300, deadline=None)
@given(dags(), st.floats(1, 48 * 3600))
def test_cheaper_than_all_standard_whenever_slack_allows(
        steps: list[StepEstimate], deadline_s: float) -> None:
    plan = plan_tiers(steps, deadline_s, ALL)
    assert plan.cost <= plan.standard_cost + 1e-9
    latest = latest_starts(steps, deadline_s)
    roots = [s for s in steps if not s.deps]
    for s in roots:  # a root with a batch window of slack is planned cheaper than standard
        # (tokens may be subnormal floats whose cost rounds to 0.0: nothing to save there)
        if latest[s.step_id] >= BATCH.turnaround_p90_s + BATCH.margin_s \
                and plan.steps[s.step_id].standard_cost > 0:
            assert plan.steps[s.step_id].cost < plan.steps[s.step_id].standard_cost


def test_turnaround_is_learned_after_enough_observations() -> None:
    book = TurnaroundBook({"batch": (420.0, 3600.0)}, min_observations=5)
    assert book.quantiles("batch") == (420.0, 3600.0)
    for x in [100, 200, 300, 400, 1000]:
        book.observe("batch", x)
    assert book.quantiles("batch") == (300.0, pytest.approx(760.0))
    assert book.profile(BATCH).turnaround_p90_s == pytest.approx(760.0)
    assert book.quantiles("flex") == (0.0, 0.0)


def test_the_watchdog_moves_a_deferred_step_when_its_latest_start_comes() -> None:
    plan = plan_tiers(chain(2), 24 * 3600, ALL).steps["s0"]
    assert not must_move(plan.latest_start_s - 100, plan)
    assert must_move(plan.latest_start_s - 100, plan, guard_s=100)
    std = plan_tiers(chain(2), 30, ALL).steps["s0"]
    assert not must_move(10**6, std)  # a synchronous step is never moved


def test_overrun_probability_follows_the_fitted_lognormal() -> None:
    from flowlift.tiers import overrun_probability, watchdog_risk
    assert overrun_probability(BATCH, 420) == pytest.approx(0.5)
    assert overrun_probability(BATCH, 3600) == pytest.approx(0.1)
    assert overrun_probability(BATCH, 7200) < 0.05
    assert overrun_probability(STANDARD, 1) == 0.0
    plan = plan_tiers(chain(7), 24 * 3600, ALL)
    one = overrun_probability(BATCH, BATCH.turnaround_p90_s + BATCH.margin_s)
    assert watchdog_risk(plan, {"batch": BATCH}) == pytest.approx(1 - (1 - one) ** 7)
    assert watchdog_risk(plan_tiers(chain(3), 40, ALL), {"standard": STANDARD}) == 0.0


def test_steps_from_plain_maps() -> None:
    from flowlift.tiers import steps_from
    steps = steps_from({"b": ["a"]}, {"a": 1.0, "b": 2.0}, {"a": (10.0, 5.0)})
    assert steps == [StepEstimate("a", frozenset(), 1.0, 10.0, 5.0),
                     StepEstimate("b", frozenset({"a"}), 2.0)]
    assert latest_starts(steps, 10) == {"a": 7.0, "b": 8.0}
