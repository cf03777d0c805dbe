"""Plans of a real machine (issue 38 item 8, second pass): default figures sized by the
model's parameter count, a cascade's share planned on each model's engine, engines on
one machine taking turns on its cores, the engines' prefix caches known to the next
plan, and the machine's factor learned by replaying a finished run."""

from __future__ import annotations

import pytest

from flowlift.calibration import Ran, machine_factor, replayed_ms
from flowlift.compiler import CompileOptions, compile_graph, prompt_text
from flowlift.costs import LOCAL, UNMEASURED, CostModel, CostTracker, sized_default
from flowlift.escalation import OutcomeCounts
from flowlift.graph import Graph
from flowlift.local_engine.base import ChatMessage
from flowlift.prefix_cache import PrefixIndex
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.workflows.planning import compile_options, sent
from flowlift.simulate import EngineModel, Work, simulate
from flowlift.testing import FakeEngine

CM = CostModel(ttft_overhead_ms=60.0, tpot_ms=40.0, prefill_tps=1000.0, per_request_ms=4.0)


def _llm(nid: str, *content: dict, **extra) -> dict:
    return {"kind": "llm", "id": nid, "messages": [{"role": "user", "content": list(content)}],
            **extra}


def test_a_larger_model_gets_slower_default_figures():
    big = sized_default(1.78e9)  # Qwen2.5-Coder-1.5B as counted from its config.json
    assert big.tpot_ms == pytest.approx(UNMEASURED.tpot_ms * 1.78 / 0.63, rel=0.01)
    assert big.prefill_tps == pytest.approx(UNMEASURED.prefill_tps * 0.63 / 1.78, rel=0.01)
    assert big.ttft_overhead_ms == UNMEASURED.ttft_overhead_ms
    assert sized_default(1.35e8) == UNMEASURED == sized_default(None)  # small: not faster
    backends = Backends({"small": FakeEngine(["small"], parameters=630_000_000),
                         "large": FakeEngine(["large"], parameters=1_780_000_000)})
    costs = compile_options(backends, CostTracker()).costs
    assert costs("large").tpot_ms == pytest.approx(costs("small").tpot_ms * 1.78 / 0.63,
                                                   rel=0.01)


def _cascades(n: int) -> Graph:
    return Graph.model_validate({"nodes": [
        _llm(f"c{i}", {"text": f"label item {i}"}, cascade=["small", "large"],
             params={"max_tokens": 20}) for i in range(n)]})


def test_a_cascade_share_is_planned_on_the_later_model_engine():
    def opts(escalated: int) -> CompileOptions:
        return CompileOptions(
            costs=lambda model: CM, engine=lambda model: model, host=lambda name: None,
            capacity=lambda name, kind: 8 if name == "small" else 1,
            outcomes=lambda step, model: OutcomeCounts(100, escalated, 100)
            if model == "small" else OutcomeCounts(100, 0, 100))
    one = CM.step_ms(4, 20)
    kept = compile_graph(_cascades(4), opts(0)).report
    moved = compile_graph(_cascades(4), opts(100)).report
    assert kept.critical_path_ms < 2 * one  # (every label kept by the small model)
    # all escalate: the large engine's one slot takes the four in turn (planned as more
    # work on the small engine's eight slots, they ended in about 2 calls' time)
    assert moved.critical_path_ms > 4 * one


def test_engines_on_one_machine_take_turns_on_its_cores():
    engine = EngineModel(base_ms=50.0, per_request_ms=0.0, prefill_token_ms=0.0,
                         capacity=4, host="cpu")
    work = {"a": Work("e1", decode_tokens=10), "b": Work("e2", decode_tokens=10)}
    deps = {"a": frozenset(), "b": frozenset()}
    alone = simulate(["a"], {"a": frozenset()}, work, {"e1": engine}).finish_ms["a"]
    both = simulate(["a", "b"], deps, work, {"e1": engine, "e2": engine}).finish_ms
    assert alone == pytest.approx(500.0)
    assert both["a"] == pytest.approx(1000.0) and both["b"] == pytest.approx(1000.0)
    apart = {"e1": engine, "e2": EngineModel(50.0, 0.0, 0.0, 4, host="gpu")}
    assert simulate(["a", "b"], deps, work, apart).finish_ms["a"] == pytest.approx(500.0)


def test_the_prefix_index_holds_whole_blocks_and_forgets_the_oldest():
    index = PrefixIndex(block=4, capacity_tokens=8)
    index.add(list(range(10)))  # blocks [0..3], [4..7]; the last 2 tokens are no block
    assert index.cached(list(range(10))) == 8
    assert index.cached([0, 1, 2, 3, 9, 9, 9, 9]) == 4
    assert index.cached([9, 1, 2, 3]) == 0  # a block counts only after the same start
    index.add([7, 7, 7, 7])  # over capacity: a prompt's last block goes first (as vLLM)
    assert index.cached(list(range(10))) == 4


DOC = "the module's documentation text " * 20
ASK = "The module described in the documentation above has this purpose: "


def _doc_graph() -> Graph:
    return Graph.model_validate({"nodes": [
        _llm("extract", {"text": f"Document: {DOC}"}, params={"max_tokens": 30}),
        _llm("classify", {"text": ASK}, {"ref": "extract"},
             {"text": " Which area?"}, params={"max_tokens": 4})]})


def test_prompts_sent_before_are_cached_in_the_next_plan():
    engine = FakeEngine(["m"], kv_block=8)
    backends = Backends({"m": engine})
    first = compile_graph(_doc_graph(), compile_options(backends, CostTracker()))
    assert first.uncached_tokens["extract"] > 50
    # the run sent both prompts (the classify one with extract's output in it)
    sent(backends, "m", [ChatMessage("user", f"Document: {DOC}")])
    sent(backends, "m", [ChatMessage("user", f"{ASK}purpose here Which area?")])
    second = compile_graph(_doc_graph(), compile_options(backends, CostTracker()))
    assert second.uncached_tokens["extract"] < 8  # all but the last part-block
    # classify reads a deterministic step whose whole prompt repeats: so does its own
    assert second.uncached_tokens["classify"] < 8 < first.uncached_tokens["classify"]
    warm_only = Graph.model_validate({"nodes": [
        _llm("extract", {"text": f"Document: {DOC}"},
             params={"max_tokens": 30, "temperature": 0.7}),
        _llm("classify", {"text": ASK}, {"ref": "extract"},
             {"text": " Which area?"}, params={"max_tokens": 4})]})
    sampled = compile_graph(warm_only, compile_options(backends, CostTracker()))
    assert sampled.uncached_tokens["classify"] > 8  # sampled input: its output may differ


def test_prompt_text_is_the_compilers_rendering():
    assert prompt_text([("system", "a"), ("user", "b")]) == "<|system|>a<|user|>b"


def test_a_replayed_run_gives_the_machine_factor():
    engines = {"e": EngineModel.of(CM, capacity=4)}
    ran = [Ran("a", frozenset(), (("m", 100.0, 20.0),)),
           Ran("t", frozenset({"a"}), (), fixed_ms=300.0),
           Ran("b", frozenset({"t"}), (("m", 50.0, 10.0), ("m", 50.0, 10.0)))]
    replay = replayed_ms(ran, lambda m: CM, lambda m: "e", engines)
    alone = CM.step_ms(100, 20) + 300.0 + 2 * CM.step_ms(50, 10)
    assert replay == pytest.approx(alone, rel=0.02)
    assert machine_factor(2 * replay, replay, used=1.5) == pytest.approx(3.0)
    assert machine_factor(0.0, replay) is None
    tracker = CostTracker()
    assert tracker.calibrated(LOCAL, CM) == CM
    for factor in (2.0, 2.0, 50.0):  # the median: one odd run does not move it
        tracker.calibrate(LOCAL, factor)
    calibrated = tracker.calibrated(LOCAL, CM)
    assert calibrated.tpot_ms == pytest.approx(80.0) and calibrated.source == "calibrated"
    assert calibrated.calibration == pytest.approx(2.0) and calibrated.samples == 3
