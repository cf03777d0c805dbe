"""Session affinity between equivalent replicas is not moved by noise (issue 38, item
11): a predicted difference under a few milliseconds, or within the spread the
replicas' own measurements show, keeps a run or session on its rendezvous replica
(and its warm prefix cache); a replica that is really slower still loses it."""

from __future__ import annotations

import random

from flowlift.proxy.dispatch.routing.latency import Features, LatencyBook
from flowlift.proxy.dispatch.routing.routing import (
    AFFINITY_MIN_MARGIN_S,
    Route,
    affinity_score,
    pick,
)

ROUTE = Route("m", ("r1", "r2", "r3"))


def _key(target: str) -> str:
    return next(k for k in (f"run-{i}" for i in range(1000))
                if max(ROUTE.replicas, key=lambda n: affinity_score(k, n)) == target)


def _pick(predicted: dict[str, float], noise: dict[str, float] | None = None) -> str | None:
    spread = noise or {}
    return pick(ROUTE, available=lambda n: True, load=lambda n: 0, affinity=_key("r1"),
                predict=predicted.get, noise=lambda n: spread.get(n, 0.0))


def test_sub_millisecond_differences_never_move_a_session():
    # 3x slower by ratio, but 0.6 ms: noise
    assert _pick({"r1": 0.0009, "r2": 0.0003, "r3": 0.0004}) == "r1"
    assert _pick({"r1": 0.0003 + AFFINITY_MIN_MARGIN_S * 0.99, "r2": 0.0003,
                  "r3": 0.01}) == "r1"
    assert _pick({"r1": 0.0003 + AFFINITY_MIN_MARGIN_S * 1.5, "r2": 0.0003,
                  "r3": 0.01}) == "r2"


def test_a_difference_within_the_measured_spread_keeps_the_session():
    predicted = {"r1": 0.40, "r2": 0.25, "r3": 0.5}  # 1.6x: past the 1.5x bound
    assert _pick(predicted, {"r1": 0.10, "r2": 0.08}) == "r1"  # 0.15 s within 0.18 s
    assert _pick(predicted, {"r1": 0.02, "r2": 0.02}) == "r2"  # tight: really slower
    assert _pick(predicted) == "r2"


def test_a_really_slower_replica_still_loses_the_session():
    assert _pick({"r1": 0.9, "r2": 0.1, "r3": 0.5}, {"r1": 0.05, "r2": 0.05}) == "r2"


def _answers(book: LatencyBook, name: str, ttfts: list[float]) -> None:
    for i, ttft in enumerate(ttfts):
        book.observe(name, "m", Features(0, 400), ttft_s=ttft, total_s=ttft + 0.1,
                     output_tokens=11, now=float(i))


def test_the_book_measures_each_replicas_spread():
    book = LatencyBook()
    assert book.spread("r1") == 0.0
    _answers(book, "steady", [0.2] * 30)
    rng = random.Random(7)
    _answers(book, "noisy", [0.2 + rng.uniform(-0.1, 0.1) for _ in range(30)])
    assert book.spread("steady") < 0.005
    assert 0.02 < book.spread("noisy") < 0.1
