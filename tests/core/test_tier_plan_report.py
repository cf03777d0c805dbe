"""The compiler report's tier plan (flowlift.compiler + flowlift.tiers) and the tiers a
model's configured backends offer (flowlift.proxy.dispatch.batch.tier_profiles)."""

from __future__ import annotations

from typing import Any

import pytest

from flowlift.compiler import CompileOptions, compile_graph
from flowlift.graph import Graph
from flowlift.proxy.config import parse_config
from flowlift.proxy.dispatch.batch.tier_profiles import model_tiers
from flowlift.report import format_report
from flowlift.tiers import TierProfile, TurnaroundBook


def chain(deadline_s: float | None, n: int = 4) -> Graph:
    nodes: list[dict[str, Any]] = []
    for i in range(n):
        content: list[dict[str, Any]] = [{"text": f"stage {i}: summarize "}]
        if i:
            content.append({"ref": f"s{i - 1}"})
        nodes.append({"kind": "llm", "id": f"s{i}", "model": "m",
                      "messages": [{"role": "user", "content": content}],
                      "params": {"max_tokens": 64}})
    nodes.append({"kind": "tool", "id": "t", "name": "save", "args": [{"ref": f"s{n - 1}"}]})
    doc: dict[str, Any] = {"nodes": nodes}
    if deadline_s is not None:
        doc["deadline_s"] = deadline_s
    return Graph.model_validate(doc)


TIERS = (TierProfile("standard", 1.0, 4.0),
         TierProfile("batch", 0.5, 2.0, 420, 3600, 3600))


def test_a_day_of_deadline_puts_the_model_steps_on_batch_at_half_the_cost() -> None:
    report = compile_graph(chain(24 * 3600), CompileOptions(tiers=lambda m: TIERS)).report
    plan = report.tier_plan
    assert plan is not None and plan.feasible
    tiers = {s.step_id: s.tier for s in plan.steps}
    assert tiers == {"s0": "batch", "s1": "batch", "s2": "batch", "s3": "batch",
                     "t": "local"}
    assert plan.cost_ratio == pytest.approx(0.5)
    text = format_report(report)
    assert "tiers: batch 4, local 1; expected cost" in text and "(0.50x)" in text
    assert plan.watchdog_risk > 0 and "risk that the watchdog moves a step" in text
    assert "tier=batch" in text


def test_a_tight_deadline_keeps_the_steps_standard_and_no_deadline_plans_nothing() -> None:
    tight = compile_graph(chain(60), CompileOptions(tiers=lambda m: TIERS)).report.tier_plan
    assert tight is not None and {s.tier for s in tight.steps} == {"standard", "local"}
    assert tight.cost_ratio == pytest.approx(1.0)
    assert compile_graph(chain(None), CompileOptions(tiers=lambda m: TIERS)
                         ).report.tier_plan is None
    assert compile_graph(chain(3600)).report.tier_plan is None  # no tiers configured


def test_a_models_tiers_come_from_its_backends_with_prices_and_priors(
        monkeypatch: Any) -> None:
    cfg = parse_config({
        "backends": {"std": {"kind": "openai", "base_url": "http://x/v1",
                             "offers_flex": True, "input_price_per_1k": 1.0,
                             "output_price_per_1k": 4.0},
                     "prio": {"kind": "openai", "base_url": "http://y/v1",
                              "tier": "priority"},
                     "b": {"kind": "openai-batch", "base_url": "http://x/v1"}},
        "models": {"m": {"backends": ["std"], "fallbacks": ["prio"], "batch": "b",
                         "price_per_1k_tokens": 2.0}}})
    got = {t.tier: t for t in model_tiers(cfg, "m")}
    assert set(got) == {"standard", "flex", "priority", "batch"}
    assert (got["flex"].input_price_per_1k, got["flex"].output_price_per_1k) == (0.5, 2.0)
    assert got["priority"].input_price_per_1k == 4.0  # the model's price, twice
    assert got["batch"].input_price_per_1k == 1.0  # the model's price, halved
    assert (got["batch"].turnaround_p50_s, got["batch"].turnaround_p90_s) == (420, 3600)
    assert got["standard"].turnaround_p90_s == 0
    assert model_tiers(cfg, "other") == (TierProfile("local", 0.0, 0.0),)
    assert model_tiers(None, "m") == (TierProfile("local", 0.0, 0.0),)
    book = TurnaroundBook({"batch": (60.0, 600.0)})
    assert {t.tier: t for t in model_tiers(cfg, "m", book)}["batch"].turnaround_p90_s == 600


def test_learned_turnaround_replaces_the_configured_priors_once_measured() -> None:
    cfg = parse_config({
        "backends": {"std": {"kind": "openai", "base_url": "http://x/v1"},
                     "b": {"kind": "openai-batch", "base_url": "http://x/v1",
                           "turnaround_p50_s": 100, "turnaround_p90_s": 200}},
        "models": {"m": {"backends": ["std"], "batch": "b", "price_per_1k_tokens": 1.0}}})
    book = TurnaroundBook({"batch": (420.0, 3600.0)}, min_observations=5)

    def batch() -> TierProfile:
        return next(t for t in model_tiers(cfg, "m", book) if t.tier == "batch")
    assert (batch().turnaround_p50_s, batch().turnaround_p90_s) == (100, 200)  # priors
    for seconds in (600, 700, 800, 900, 5000):
        book.observe("batch", seconds)
    learned = batch()
    assert learned.turnaround_p50_s == 800.0  # measured: the median of what finished
    assert learned.turnaround_p90_s == pytest.approx(3360.0)  # and its 90th percentile
    # the plan follows: 90 minutes of deadline held batch under the priors, not any more
    graph = chain(5400, n=1)
    tiers = (TierProfile("standard", 1.0, 1.0),)

    def planned(profile: TierProfile) -> str:
        plan = compile_graph(graph, CompileOptions(tiers=lambda m: (*tiers, profile))
                             ).report.tier_plan
        assert plan is not None
        return next(s.tier for s in plan.steps if s.step_id == "s0")
    prior = TierProfile("batch", 0.5, 0.5, 100, 200, 3600)
    assert planned(prior) == "batch"
    assert planned(TierProfile("batch", 0.5, 0.5, learned.turnaround_p50_s,
                               learned.turnaround_p90_s, 3600)) == "standard"
