"""The compiler: pure planning over graphs (no engine, no sockets)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlift.compiler import CompileOptions, compile_graph, find_identical
from flowlift.costs import CostModel, CostTracker
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.workflows.runs import Run
from flowlift.report import format_report
from flowlift.testing import FakeEngine

PREAMBLE = "You are a careful assistant that answers in one short sentence. " * 4


def llm(node_id, *parts, system=None, model=None, **extra):
    content = [p if isinstance(p, dict) else {"text": p} for p in parts]
    msgs = [{"role": "user", "content": content}]
    if system:
        msgs.insert(0, {"role": "system", "content": [{"text": system}]})
    return {"kind": "llm", "id": node_id, "model": model, "messages": msgs, **extra}


def ref(node_id):
    return {"ref": node_id}


@st.composite
def dags(draw):
    n = draw(st.integers(min_value=1, max_value=25))
    nodes = []
    for i in range(n):
        deps = draw(st.sets(st.integers(min_value=0, max_value=max(i - 1, 0)), max_size=3)) \
            if i else set()
        text = draw(st.sampled_from(["alpha", "beta", PREAMBLE + "gamma", PREAMBLE + "delta"]))
        max_tokens = draw(st.integers(min_value=1, max_value=64))
        temperature = draw(st.sampled_from([0.0, 0.0, 0.7]))
        nodes.append(llm(f"n{i}", text, *[ref(f"n{d}") for d in sorted(deps)],
                         params={"max_tokens": max_tokens, "temperature": temperature}))
    return Graph.model_validate({"nodes": nodes})


@settings(max_examples=60, deadline=None)
@given(dags())
def test_critical_path_bounds_and_order(graph):
    plan = compile_graph(graph)
    r = plan.report
    rows = {n.step_id: n for n in r.nodes}
    costs = [n.est_ms for n in r.nodes]
    assert r.critical_path_ms <= sum(costs) + sum(n.wait_ms for n in r.nodes) + 1.0
    assert r.critical_path_ms >= max(costs) - 1.0
    # the solo estimate bounds the plan from below: sharing an engine only slows steps
    assert r.critical_path_ms >= max(plan.tail_ms.values()) * 0.5
    position = {n.step_id: i for i, n in enumerate(r.nodes)}
    deps = {n.step_id: set(n.deps) | ({n.same_as} if n.same_as else set())
            for n in r.nodes}
    for node in r.nodes:
        assert all(position[d] < position[node.step_id] for d in node.deps)
        assert node.start_ms + node.est_ms <= r.critical_path_ms + 0.5
    # one computation: the headline, the named path and the rows agree
    first, last = rows[r.critical_path[0]], rows[r.critical_path[-1]]
    assert first.start_ms - first.wait_ms == pytest.approx(0.0, abs=0.2)
    assert first.remaining_ms == pytest.approx(r.critical_path_ms - first.start_ms, abs=0.3)
    assert last.start_ms + last.est_ms == pytest.approx(r.critical_path_ms, abs=0.2)
    for a, b in zip(r.critical_path, r.critical_path[1:], strict=False):
        assert a in deps[b]  # the critical path is a chain of real dependencies
        assert rows[b].start_ms == pytest.approx(
            rows[a].start_ms + rows[a].est_ms + rows[b].wait_ms, abs=0.3)
        assert rows[b].critical


async def _outputs(graph, use_plan):
    engine = FakeEngine(["default-model"])
    backends = Backends({"default-model": engine})
    run_plan = compile_graph(graph, CompileOptions(default_model="default-model")) \
        if use_plan else None
    run = Run(graph, backends, run_plan)
    await run.start()
    return run.outputs, len(engine.requests)


@settings(max_examples=40, deadline=None)
@given(dags())
def test_merging_identical_calls_never_changes_any_output(graph):
    merged, n_merged = asyncio.run(_outputs(graph, True))
    plain, n_plain = asyncio.run(_outputs(graph, False))
    assert merged == plain
    assert n_merged == n_plain - len(compile_graph(graph).merged_into)


def test_identical_calls_hash_cons_through_references():
    g = Graph.model_validate({"nodes": [
        llm("a", "same"), llm("b", "same"), llm("c", "x", ref("a")), llm("d", "x", ref("b")),
        llm("hot", "same", params={"temperature": 0.9}),
        llm("seeded", "same", params={"temperature": 0.9, "seed": 1}),
        llm("seeded2", "same", params={"temperature": 0.9, "seed": 1}),
        {"kind": "tool", "id": "t1", "name": "f"}, {"kind": "tool", "id": "t2", "name": "f"}]})
    merged = find_identical(g, [n.id for n in g.nodes])
    assert merged == {"b": "a", "d": "c", "seeded2": "seeded"}


def test_shared_prefix_groups_and_tokens_saved():
    g = Graph.model_validate({"nodes": [
        *[llm(f"s{i}", f"question {i}", system=PREAMBLE) for i in range(4)],
        llm("other", "unrelated"), llm("m2", "question 9", system=PREAMBLE, model="big")]})
    plan = compile_graph(g)
    r = plan.report
    assert len(r.prefix_groups) == 1
    group = r.prefix_groups[0]
    assert group.steps == 4 and group.shared_tokens >= 32 and group.leader == "s0"
    assert group.shared_tokens % 16 == 0  # whole KV blocks
    assert group.tokens_saved == group.shared_tokens * 3
    assert plan.cost_ms["s1"] < plan.cost_ms["s0"]  # the leader pays the prefill


def test_costs_come_from_measurements():
    tracker = CostTracker(alpha=1.0)
    tracker.observe("m", prompt_tokens=1100, cached_tokens=100, completion_tokens=11,
                    prefill_ms=500, decode_ms=1000)
    cm = tracker.model("m")
    assert cm.source == "measured" and cm.prefill_tps == 2000 and cm.tpot_ms == 100
    g = Graph.model_validate({"nodes": [llm("a", "hi", model="m", params={"max_tokens": 10})]})
    r = compile_graph(g, CompileOptions(costs=tracker.model)).report
    assert r.cost_models["m"].source == "measured"
    assert r.nodes[0].est_ms > (10 - 1) * 100  # the measured TPOT after the first token


def test_deadline_breaks_residency_and_switches():
    g = Graph.model_validate({"deadline_s": 1, "nodes": [
        llm("a", "one", model="small", contract={"choices": ["x", "y"]}),
        llm("b", "two", ref("a"), model="large", params={"max_tokens": 100}),
        {"kind": "tool", "id": "t", "name": "lookup", "args": [ref("b")]},
        llm("c", "three", ref("t"), model="small")]})
    slow = CostModel(ttft_overhead_ms=10, tpot_ms=50, prefill_tps=1000)
    r = compile_graph(g, CompileOptions(costs=lambda m: slow,
                                        enforces=lambda m: m != "small")).report
    assert r.deadline_feasible is False
    assert r.model_switches == 2
    assert {x.model for x in r.residency} == {"small", "large"}
    small = next(x for x in r.residency if x.model == "small")
    assert small.keep_until_ms > next(x for x in r.residency if x.model == "large").keep_until_ms
    reasons = {b.step_id: b.reason for b in r.breaks}
    assert "client-run" in reasons["t"] and "not enforceable" in reasons["a"]
    text = format_report(r)
    assert "NOT feasible" in text and "critical path" in text


def test_large_consolidated_batch_graph_compiles():
    nodes = []
    for i in range(2500):  # 2,500 documents x 4 steps = 10,000 nodes
        nodes += [llm(f"e{i}", f"document {i}", system=PREAMBLE),
                  llm(f"c{i}", "classify", ref(f"e{i}"), system=PREAMBLE),
                  {"kind": "tool", "id": f"t{i}", "name": "lookup", "args": [ref(f"e{i}")]},
                  llm(f"s{i}", "summarize", ref(f"c{i}"), ref(f"t{i}"), system=PREAMBLE)]
    r = compile_graph(Graph.model_validate({"class": "batch", "nodes": nodes})).report
    assert r.steps == 10_000 and r.levels == 3
    assert len(r.critical_path) == 3


def test_projection_counts_the_field_not_the_whole_output():
    schema = {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "body": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}
    g = Graph.model_validate({"nodes": [
        llm("a", "write", contract={"json_schema": schema}, params={"max_tokens": 2000}),
        llm("whole", "read ", ref("a")),
        llm("title", "read ", {"ref": "a", "path": ["title"]}),
        llm("body", "read ", {"ref": "a", "path": ["body"]})]})
    by_id = {n.step_id: n for n in compile_graph(g).report.nodes}
    assert by_id["whole"].prompt_tokens > 1900  # unbounded body: max_tokens stands
    assert by_id["title"].prompt_tokens < 30  # maxLength 40 chars, not 2,000 tokens
    assert by_id["body"].prompt_tokens < 0.4 * by_id["whole"].prompt_tokens  # 1 of 3 fields


def test_bounded_schema_and_learned_lengths_replace_max_tokens():
    from flowlift.compiler import OutputLengths, schema_tokens

    enum = {"type": "object", "properties": {"label": {"enum": ["yes", "no"]},
                                             "score": {"type": "integer"}}}
    assert schema_tokens(enum, lambda t: 1.0) is not None
    assert schema_tokens({"type": "string"}, lambda t: 1.0) is None
    g = Graph.model_validate({"nodes": [
        llm("a", "judge", contract={"json_schema": enum}, params={"max_tokens": 500}),
        llm("b", "write", params={"max_tokens": 500})]})
    learned = {("b", "default"): OutputLengths(samples=5, p50=42.0, p90=60.0)}
    r = compile_graph(g, CompileOptions(output_lengths=lambda s, m: learned.get((s, m))))
    out = {n.step_id: n.output_tokens for n in r.report.nodes}
    assert out["a"] < 20 and out["b"] == 42
    assert {n.step_id: n.output_tokens for n in compile_graph(g).report.nodes}["b"] == 500
