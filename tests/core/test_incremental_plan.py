"""Incremental compilation of open runs (issue 24 part 3): after any sequence of appends
the incremental state equals the full compile of the grown graph -- remaining critical
paths, costs, the critical path, identical-call merges, prefix groups (numbered as the
proxy keeps them, :func:`stable_plan`) -- and an append's validation errors are the full
validation's."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flowlift.compiler import CompileOptions, Plan, compile_graph
from flowlift.costs import CostModel
from flowlift.dataflow import validate
from flowlift.errors import GraphError
from flowlift.graph import Graph, Node
from flowlift.incremental import GrowingPlan
from flowlift.proxy.workflows.open_runs import stable_plan

PREAMBLES = ["", "You are a careful assistant who answers in one short line . " * 3,
             "You are a careful assistant who answers in one short line . " * 2 + "Be terse .",
             "Summarise the following document for a busy reader , plainly and well . " * 2]
WORDS = ["alpha", "beta", "gamma", "delta"]
OPTS = CompileOptions(default_model="m1", costs=lambda model: CostModel(
    ttft_overhead_ms=5.0 if model == "m1" else 9.0, prefill_tps=800.0, tpot_ms=25.0))


@st.composite
def _node(draw: Any, nid: str, earlier: list[str]) -> dict[str, Any]:
    kind = draw(st.sampled_from(["llm", "llm", "llm", "input", "tool"]))
    refs = draw(st.lists(st.sampled_from(earlier), max_size=3)) if earlier else []
    if kind == "input":
        return {"kind": "input", "id": nid, "value": draw(st.sampled_from(WORDS))}
    if kind == "tool":
        return {"kind": "tool", "id": nid, "name": "t", "pure": draw(st.booleans()),
                "args": [{"ref": r} for r in refs]}
    content: list[dict[str, Any]] = [{"text": draw(st.sampled_from(PREAMBLES))}]
    for r in refs:
        content += [{"ref": r}, {"text": draw(st.sampled_from(WORDS))}]
    node: dict[str, Any] = {
        "kind": "llm", "id": nid, "model": draw(st.sampled_from([None, "m1", "m2"])),
        "messages": [{"role": "user", "content": content}],
        "params": {"max_tokens": draw(st.sampled_from([8, 64])),
                   "temperature": draw(st.sampled_from([0.0, 0.0, 0.7]))}}
    if draw(st.booleans()):
        node["messages"].insert(0, {"role": "system",
                                    "content": [{"text": draw(st.sampled_from(PREAMBLES))}]})
    return node


@st.composite
def _growth(draw: Any) -> list[list[dict[str, Any]]]:
    """Batches of wire nodes: each may read any node before it, or one of its own batch
    (in any order within the batch)."""
    batches: list[list[dict[str, Any]]] = []
    ids: list[str] = []
    for b in range(draw(st.integers(1, 5))):
        batch = []
        for k in range(draw(st.integers(1, 4))):
            nid = f"n{b}_{k}"
            batch.append(draw(_node(nid, list(ids))))
            ids.append(nid)
        batches.append(draw(st.permutations(batch)))
    return batches


def _same(state: GrowingPlan, full: Plan, groups: Plan) -> None:
    assert state.tail == pytest.approx(full.tail_ms)
    assert state.cost == pytest.approx(full.cost_ms)
    assert state.uncached == pytest.approx(full.uncached_tokens)
    assert state.out_tok == pytest.approx(full.output_tokens)
    assert state.merged == full.merged_into
    assert state.group_of == groups.prefix_group
    assert state.group_leader == groups.group_leader
    path = state.critical_path()  # along the remaining paths (the report's is the schedule's)
    if path:
        assert full.tail_ms[path[0]] == pytest.approx(max(full.tail_ms.values()))
        assert full.tail_ms[path[-1]] == pytest.approx(full.cost_ms[path[-1]])
    for a, b in itertools.pairwise(path):
        assert a in state.deps[b]
        assert full.tail_ms[a] == pytest.approx(full.cost_ms[a] + full.tail_ms[b])


@settings(max_examples=150)
@given(_growth())
def test_appends_equal_the_full_compile_of_the_grown_graph(batches):
    graph = Graph.model_validate({"open": True, "nodes": batches[0]})
    state = GrowingPlan(graph, OPTS)
    shown = compile_graph(graph, OPTS)
    _same(state, shown, shown)
    for batch in batches[1:]:
        nodes = Graph.model_validate({"nodes": batch}).nodes
        graph = graph.model_copy(update={"nodes": (*graph.nodes, *nodes)})
        full = compile_graph(graph, OPTS)
        held = set(state.nodes)
        # by design an existing step is never re-pointed to a newer identical call
        assume(not any(k in held and v not in held for k, v in full.merged_into.items()))
        state.add(nodes)
        shown = stable_plan(shown, full)
        _same(state, full, shown)
    assert [n.id for n in state.graph.nodes] == [n.id for n in graph.nodes]


def _problems(graph: Graph) -> set[str]:
    try:
        validate(graph, {"m1", "m2"})
    except GraphError as exc:
        return set(exc.problems)
    return set()


BAD = [
    {"kind": "llm", "id": "n0_0", "messages": [{"role": "user", "content": [{"text": "x"}]}]},
    {"kind": "llm", "id": "dang", "messages": [{"role": "user", "content": [{"ref": "nope"}]}]},
    {"kind": "llm", "id": "self", "messages": [{"role": "user", "content": [{"ref": "self"}]}]},
    {"kind": "llm", "id": "cyc_a", "messages": [{"role": "user", "content": [{"ref": "cyc_b"}]}]},
    {"kind": "llm", "id": "cyc_b", "messages": [{"role": "user", "content": [{"ref": "cyc_a"}]}]},
    {"kind": "llm", "id": "unk", "model": "m9",
     "messages": [{"role": "user", "content": [{"text": "x"}]}]},
    {"kind": "llm", "id": "path", "messages": [{"role": "user", "content": [
        {"ref": "n0_0", "path": ["title"]}]}]},
]


@settings(max_examples=100)
@given(_growth(), st.lists(st.sampled_from(BAD), min_size=1, max_size=4, unique_by=str))
def test_an_appends_problems_are_the_full_validations(batches, bad):
    graph = Graph.model_validate({"open": True, "nodes": batches[0]})
    assume(not _problems(graph))
    state = GrowingPlan(graph, OPTS)
    nodes: tuple[Node, ...] = Graph.model_validate({"nodes": bad}).nodes
    grown = graph.model_copy(update={"nodes": (*graph.nodes, *nodes)})
    assert set(state.problems(nodes, {"m1", "m2"})) == _problems(grown)
    if any(b["id"] != "path" for b in bad):  # every other one of them is a problem
        assert state.problems(nodes, {"m1", "m2"})  # (a projection of an input is not)


@settings(max_examples=100)
@given(_growth(), st.data())
def test_finished_steps_are_left_alone_and_the_others_stay_exact(batches, data):
    """Updates stop at finished steps (a prefix of a topological order: a step finishes
    after its inputs); every unfinished step's remaining path is the full compile's."""
    done: set[str] = set()
    graph = Graph.model_validate({"open": True, "nodes": batches[0]})
    state = GrowingPlan(graph, OPTS, finished=done.__contains__)
    for batch in batches[1:]:
        order = sorted(state.nodes, key=state.seq.__getitem__)
        done.update(order[:data.draw(st.integers(0, len(order)))])
        nodes = Graph.model_validate({"nodes": batch}).nodes
        graph = graph.model_copy(update={"nodes": (*graph.nodes, *nodes)})
        full = compile_graph(graph, OPTS)
        held = set(state.nodes)
        assume(not any(k in held and v not in held for k, v in full.merged_into.items()))
        state.add(nodes)
        live = {n for n in state.nodes if n not in done}
        assert {n: state.tail[n] for n in live} == pytest.approx(
            {n: full.tail_ms[n] for n in live})
