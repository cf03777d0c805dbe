"""The residency manager: furthest-next-use eviction, queued steps' models pinned, the
compiler's plan as input; FakeEngine-backed models."""

from __future__ import annotations

import asyncio

import pytest

from flowlift.compiler import compile_graph
from flowlift.errors import EngineError
from flowlift.graph import Graph
from flowlift.local_engine.base import ChatMessage, GenerationRequest
from flowlift.local_engine.residency import (
    NEVER,
    Lookahead,
    ManagedModel,
    ResidencyManager,
    choose_evictions,
    lookahead,
)
from flowlift.report import ResidencyReport
from flowlift.testing import FakeEngine

SIZES = {"a": 400.0, "b": 400.0, "c": 400.0, "d": 400.0}


def _manager(budget_mb: float = 1000.0) -> ResidencyManager:
    return ResidencyManager({m: ManagedModel(FakeEngine([m], delay_s=0.01), size)
                             for m, size in SIZES.items()}, budget_mb)


def test_evicts_the_model_whose_next_use_is_furthest_away() -> None:
    ahead = Lookahead({"a": 50.0, "b": 5_000.0})
    # "a" was loaded first (LRU/FIFO would evict it), but "b" is needed much later
    assert choose_evictions("c", SIZES, ["a", "b"], 1000.0, ahead) == ["b"]
    assert choose_evictions("c", SIZES, ["b", "a"], 1000.0, ahead) == ["b"]


def test_a_model_needed_by_no_one_goes_first() -> None:
    ahead = Lookahead({"a": 9_000.0})
    assert choose_evictions("c", SIZES, ["a", "b"], 1000.0, ahead) == ["b"]


def test_never_evicts_what_a_queued_step_needs_next() -> None:
    # "a" is pinned by a queued step even though the plan puts its window far away
    ahead = lookahead([ResidencyReport(model="a", load_by_ms=90_000, keep_until_ms=95_000,
                                       steps=1),
                       ResidencyReport(model="b", load_by_ms=100, keep_until_ms=200,
                                       steps=1)], elapsed_ms=0, queued_models=["a"])
    assert choose_evictions("c", SIZES, ["a", "b"], 1000.0, ahead) == ["b"]
    with pytest.raises(EngineError, match="needed by queued steps"):
        choose_evictions("c", SIZES, ["a", "b"], 1000.0, Lookahead(pinned=frozenset("ab")))


def test_busy_models_are_not_evicted_and_too_big_is_an_error() -> None:
    assert choose_evictions("c", SIZES, ["a", "b"], 1000.0, Lookahead({"a": 1.0}),
                            busy=["b"]) == ["a"]
    with pytest.raises(EngineError, match="does not fit"):
        choose_evictions("c", SIZES, ["a", "b"], 1000.0, Lookahead({"a": 1.0}), busy=["a", "b"])
    with pytest.raises(EngineError, match="budget"):
        choose_evictions("a", {"a": 2000.0}, [], 1000.0, Lookahead())


def test_lookahead_reads_the_plan_relative_to_elapsed_time() -> None:
    plan = [ResidencyReport(model="a", load_by_ms=0, keep_until_ms=1_000, steps=2),
            ResidencyReport(model="b", load_by_ms=3_000, keep_until_ms=4_000, steps=1)]
    ahead = lookahead(plan, elapsed_ms=2_000)
    assert ahead.next_use("a") == NEVER  # its window has closed
    assert ahead.next_use("b") == 1_000
    merged = ahead.merge(Lookahead({"a": 10.0}, frozenset({"c"})))
    assert merged.next_use("a") == 10.0 and merged.next_use("c") == 0.0


def test_lookahead_from_a_compiled_graph() -> None:
    graph = Graph.model_validate({"name": "two-models", "nodes": [
        {"id": "x", "kind": "llm", "model": "a",
         "messages": [{"role": "user", "content": [{"text": "hi"}]}]},
        {"id": "y", "kind": "llm", "model": "b",
         "messages": [{"role": "user", "content": [{"ref": "x"}, {"text": " then"}]}]},
    ]})
    plan = compile_graph(graph).report.residency
    assert {w.model for w in plan} == {"a", "b"}
    ahead = lookahead(plan, elapsed_ms=0)
    assert ahead.next_use("a") <= ahead.next_use("b") < NEVER


async def test_manager_loads_and_unloads_through_the_engines() -> None:
    mgr = _manager()
    await mgr.ensure("a")
    await mgr.ensure("b")
    assert mgr.models["a"].engine.started and mgr.models["b"].engine.started  # type: ignore[attr-defined]
    engine = await mgr.ensure("c", Lookahead({"a": 10.0, "b": 60_000.0}))
    assert engine is mgr.models["c"].engine
    assert mgr.events[-2:] == [("unload", "b"), ("load", "c")]
    assert mgr.resident == ["a", "c"]
    assert not mgr.models["b"].engine.started  # type: ignore[attr-defined]
    await mgr.ensure("a")  # already loaded: nothing happens
    assert mgr.events[-1] == ("load", "c")
    await mgr.close()
    assert mgr.resident == []


async def test_manager_keeps_a_model_with_requests_in_flight() -> None:
    mgr = _manager()
    a = await mgr.ensure("a")
    await mgr.ensure("b")
    stream = a.generate(GenerationRequest("r1", "a", (ChatMessage("user", "one two three"),)))
    await anext(stream)  # "a" is generating
    # the plan says "a" is needed furthest away, but it is busy: "b" goes
    await mgr.ensure("c", Lookahead({"a": 99_000.0, "b": 10.0}))
    assert mgr.resident == ["a", "c"]
    await stream.aclose()  # type: ignore[attr-defined]
    await asyncio.sleep(0)
    assert a.running() == 0
    with pytest.raises(EngineError, match="no managed model"):
        await mgr.ensure("zzz")
