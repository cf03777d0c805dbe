"""Plans that are honest on the hardware they run on (issue 38 item 8): prefix groups in
the engine's real KV blocks, agent steps costed by their turns, one computation for a
report's headline, named path and rows (groups included), and steps that share an
engine planned as sharing it (continuous batching, the backend's slots)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from flowlift.compiler import CompileOptions, compile_graph
from flowlift.costs import CostModel, CostTracker
from flowlift.graph import Graph
from flowlift.incremental import GrowingPlan
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.settings import DispatchSettings
from flowlift.proxy.store.outcomes import StepOutcomes
from flowlift.proxy.workflows.planning import compile_options, plan
from flowlift.proxy.workflows.registry import learn_lengths
from flowlift.simulate import EngineModel, Work, simulate
from flowlift.testing import FakeEngine
from flowlift.timing import agent_turns, call_ms

CM = CostModel(ttft_overhead_ms=60.0, tpot_ms=40.0, prefill_tps=1000.0, per_request_ms=4.0)
SHORT = " ".join(f"w{i}" for i in range(15))  # with the role marker: about 20 tokens


def _llm(nid: str, *content: dict, **extra) -> dict:
    return {"kind": "llm", "id": nid, "messages": [{"role": "user", "content": list(content)}],
            **extra}


def _siblings(n: int = 20) -> Graph:
    """``n`` steps whose prompts share a start of about 20 tokens, then differ."""
    return Graph.model_validate({"nodes": [
        _llm(f"s{i}", {"text": f"{SHORT} item number {i} " + "detail " * 40},
             params={"max_tokens": 8}) for i in range(n)]})


def _opts(block: int, **extra) -> CompileOptions:
    return CompileOptions(costs=lambda model: CM, kv_block=lambda model: block, **extra)


def test_a_shared_start_shorter_than_a_block_is_no_group():
    graph = _siblings()
    cpu = compile_graph(graph, _opts(128))
    assert cpu.report.prefix_groups == [] and cpu.prefix_group == {}
    assert sum(g.tokens_saved for g in cpu.report.prefix_groups) == 0  # 0 promised
    rows = {n.step_id: n for n in cpu.report.nodes}
    assert all(cpu.uncached_tokens[s] == rows[s].prompt_tokens for s in rows)
    assert GrowingPlan(graph, _opts(128)).group_of == {}  # an open run's plan too
    gpu = compile_graph(graph, _opts(16))
    (group,) = gpu.report.prefix_groups
    assert group.steps == 20 and group.shared_tokens == 16  # whole blocks only
    assert group.tokens_saved == 16 * 19
    assert gpu.uncached_tokens["s1"] == rows["s1"].prompt_tokens - 16


def test_the_block_comes_from_the_engine_the_step_runs_on():
    graph = _siblings(4)
    cpu = Backends({"m": FakeEngine(["m"], kv_block=128)})
    assert compile_options(cpu, CostTracker()).kv_block("m") == 128
    assert plan(graph, cpu, CostTracker()).prefix_group == {}  # no sibling held back
    unknown = Backends({"m": FakeEngine(["m"])})
    assert compile_options(unknown, CostTracker()).kv_block("m") == 16
    assert len(set(plan(graph, unknown, CostTracker()).prefix_group.values())) == 1


def _agent(**extra) -> dict:
    return _llm("a", {"text": "find the answer"}, params={"max_tokens": 40},
                tools=[{"name": "search", "parameters": {"type": "object"}}], **extra)


def test_an_agent_step_costs_its_expected_turns():
    plain = compile_graph(Graph.model_validate({"nodes": [
        _llm("a", {"text": "find the answer"}, params={"max_tokens": 40})]}), _opts(16))
    agent = compile_graph(Graph.model_validate({"nodes": [_agent(max_turns=9)]}),
                          _opts(16))
    one = plain.cost_ms["a"]
    assert agent.cost_ms["a"] == pytest.approx(call_ms(CM, agent.uncached_tokens["a"], 40.0,
                                                       3.0, 50.0))
    assert agent.cost_ms["a"] > 2.9 * one  # sqrt(9) = 3 turns, tool calls between
    learned = compile_graph(Graph.model_validate({"nodes": [_agent(max_turns=9)]}),
                            _opts(16, agent_turns=lambda step, model: 6.0))
    assert learned.cost_ms["a"] > 1.9 * agent.cost_ms["a"]
    node = Graph.model_validate({"nodes": [_agent(max_turns=9, tool_choice="required")]}
                                ).nodes[0]
    assert agent_turns(node) == 9.0 and agent_turns(node, 2.0) == 9.0
    free = Graph.model_validate({"nodes": [_agent(max_turns=10)]}).nodes[0]
    assert agent_turns(free) == pytest.approx(math.sqrt(10))
    assert agent_turns(free, 40.0) == 10.0  # never past max_turns


def test_finished_runs_teach_an_agent_step_s_turns():
    outcomes = StepOutcomes(":memory:")
    graph = Graph.model_validate({"nodes": [_agent(max_turns=9, name="research")]})
    attempt = SimpleNamespace(model="m", completion_tokens=12)
    step = SimpleNamespace(kind="llm", status="done", same_as=None, name="research",
                           step_id="a", attempts=[attempt] * 5)
    run = SimpleNamespace(graph=graph, trace=SimpleNamespace(steps={"a": step}))
    learn_lengths(run, outcomes)  # type: ignore[arg-type]
    assert outcomes.turns("research", "m") == 5.0
    opts = _opts(16, agent_turns=outcomes.turns, default_model="m")
    assert compile_graph(graph, opts).cost_ms["a"] == pytest.approx(call_ms(
        CM, compile_graph(graph, opts).uncached_tokens["a"], 40.0, 5.0, 50.0))


def test_a_first_wins_report_agrees_with_itself():
    graph = Graph.model_validate({"nodes": [
        _llm("fast", {"text": "quick"}, params={"max_tokens": 10}),
        _llm("slow", {"text": "long"}, params={"max_tokens": 2000}),
        {"kind": "group", "id": "g", "mode": "first", "members": ["fast", "slow"]},
        _llm("after", {"text": "after "}, {"ref": "g"}, params={"max_tokens": 10})]})
    report = compile_graph(graph, _opts(16)).report
    rows = {n.step_id: n for n in report.nodes}
    assert report.critical_path == ["fast", "g", "after"]
    assert [n.step_id for n in report.nodes if n.critical] == ["fast", "g", "after"]
    end = rows["after"].start_ms + rows["after"].est_ms
    assert report.critical_path_ms == pytest.approx(end, abs=0.2)
    assert report.decisions is not None
    assert report.decisions.critical_path_ms == report.critical_path_ms
    assert rows["slow"].start_ms + rows["slow"].est_ms <= rows["g"].start_ms + 0.2  # cancelled
    assert rows["fast"].remaining_ms == pytest.approx(report.critical_path_ms, abs=0.3)
    assert report.decisions.worst_case_critical_path_ms > report.critical_path_ms


def test_requests_decoding_together_share_the_engine():
    graph = Graph.model_validate({"nodes": [
        _llm(f"d{i}", {"text": f"document {i}"}, params={"max_tokens": 100})
        for i in range(21)]})
    alone = compile_graph(graph, _opts(16)).cost_ms["d0"]
    shared = compile_graph(graph, _opts(16, max_concurrency=21)).report
    assert shared.critical_path_ms == pytest.approx(
        alone + 99 * CM.per_request_ms * 20, rel=0.05)  # 21 decoding at once
    queued = compile_graph(graph, _opts(16, max_concurrency=4)).report
    assert max(n.wait_ms for n in queued.nodes) > alone  # 4 slots: the rest wait
    assert queued.critical_path_ms > 4 * alone


def test_a_prefill_holds_up_the_decodes_beside_it():
    engines = {"e": EngineModel(base_ms=40.0, per_request_ms=0.0, prefill_token_ms=1.0,
                                capacity=8)}
    deps = {"a": frozenset(), "b": frozenset()}
    work = {"a": Work("e", decode_tokens=10), "b": Work("e", prefill_tokens=1000)}
    alone = simulate(["a"], {"a": frozenset()}, work, engines).finish_ms["a"]
    beside = simulate(["a", "b"], deps, work, engines).finish_ms["a"]
    assert alone == pytest.approx(400.0)
    assert beside == pytest.approx(400.0 + 1000.0)  # one step carried b's 1,000 tokens


def test_the_tpot_line_is_learned_from_requests_decoding_together():
    tracker = CostTracker(alpha=1.0)
    for decoding, tpot in ((1, 45.0), (1, 45.0), (21, 125.0), (21, 125.0)):
        tracker.observe("m", prompt_tokens=10, cached_tokens=0, completion_tokens=11,
                        prefill_ms=60.0, decode_ms=tpot * 10, decoding=decoding)
    cm = tracker.model("m")
    assert cm.tpot_ms == pytest.approx(45.0) and cm.per_request_ms == pytest.approx(4.0)
    assert cm.tpot_at(21) == pytest.approx(125.0)
    crowded = CostTracker(alpha=1.0)  # one count seen: brought back to one request
    crowded.observe("m", prompt_tokens=10, cached_tokens=0, completion_tokens=11,
                    prefill_ms=60.0, decode_ms=1250.0, decoding=21)
    assert crowded.model("m").tpot_ms < 125.0 / 2


def test_a_batch_run_is_planned_within_the_proxy_s_batch_budget():
    engines = {"e": EngineModel(base_ms=10.0, per_request_ms=0.0, prefill_token_ms=1.0,
                                capacity=8, prefill_budget=1024)}
    deps = {"a": frozenset(), "b": frozenset()}
    work = {"a": Work("e", prefill_tokens=800), "b": Work("e", prefill_tokens=800)}
    sched = simulate(["a", "b"], deps, work, engines)
    assert sched.start_ms["b"] == pytest.approx(sched.finish_ms["a"])  # 1,600 > 1,024
    opts = compile_options(Backends({"m": FakeEngine(["m"])}, DispatchSettings(max_concurrency=6)),
                           CostTracker())
    assert opts.capacity is not None and opts.prefill_budget is not None
    name = opts.engine("m")
    assert opts.capacity(name, "batch") == 5 and opts.capacity(name, "interactive") == 6
    assert opts.prefill_budget(name, "batch") == 1024
    assert opts.prefill_budget(name, "interactive") == math.inf


def test_points_that_follow_no_line_fall_back_to_the_mean():
    from collections import deque

    from flowlift.costs import tpot_line

    assert tpot_line({2: deque([40.0, 40.0]), 12: deque([1000.0, 1000.0])}) is None
    assert tpot_line({1: deque([45.0] * 3), 21: deque([125.0] * 3)}) == pytest.approx(
        (45.0, 4.0))
