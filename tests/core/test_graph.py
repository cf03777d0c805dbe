"""Graph wire format and validation: invalid graphs are rejected whole."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowlift.dataflow import dependencies, find_cycle, levels, validate
from flowlift.errors import GraphError
from flowlift.graph import Graph, graph_json_schema


def llm(node_id: str, *refs: str, model: str | None = None, **extra):
    content = [{"text": "go "}] + [{"ref": r} for r in refs]
    return {"kind": "llm", "id": node_id, "model": model,
            "messages": [{"role": "user", "content": content}], **extra}


def test_edges_come_from_references_not_order():
    g = Graph.model_validate({"nodes": [llm("c", "a", "b", "a"), llm("a"), llm("b", "a")]})
    assert dependencies(g) == {"c": {"a", "b"}, "a": set(), "b": {"a"}}
    assert levels(g) == [["a"], ["b"], ["c"]]


def test_every_problem_is_listed():
    g = Graph.model_validate({"nodes": [
        llm("a", "b"), llm("b", "a"), llm("c", "ghost"), llm("d", model="gpt-nope"),
        llm("d")]})
    with pytest.raises(GraphError) as info:
        validate(g, {"fake-model"})
    problems = " | ".join(info.value.problems)
    assert "duplicate node id 'd'" in problems
    assert "unknown node 'ghost'" in problems
    assert "unknown model 'gpt-nope'" in problems
    assert "dependency cycle" in problems
    assert len(info.value.problems) == 4


def test_self_reference_and_field_of_text_output():
    g = Graph.model_validate({"nodes": [
        llm("a", "a"),
        llm("t"),
        {"kind": "llm", "id": "u", "messages": [
            {"role": "user", "content": [{"ref": "t", "path": ["x"]}]}]}]})
    with pytest.raises(GraphError) as info:
        validate(g)
    text = " ".join(info.value.problems)
    assert "references its own output" in text
    assert "whose output is text" in text


def test_invalid_json_schema_contract():
    g = Graph.model_validate({"nodes": [llm("a", contract={"json_schema": {"type": 5}})]})
    with pytest.raises(GraphError, match="invalid JSON Schema"):
        validate(g)


def test_contract_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        Graph.model_validate({"nodes": [llm("a", contract={})]})


def test_wire_round_trip_and_schema():
    g = Graph.model_validate({"class": "batch", "deadline_s": 5, "nodes": [
        llm("a"), {"kind": "tool", "id": "t", "name": "f",
                   "args": [{"ref": "a"}, {"value": 3}, {"template": [{"text": "x"}]}]},
        {"kind": "input", "id": "i", "value": {"k": [1, 2]}}]})
    again = Graph.model_validate(g.to_wire())
    assert again == g
    assert again.workflow_class == "batch"
    assert "nodes" in graph_json_schema()["properties"]


@given(st.lists(st.lists(st.integers(min_value=0, max_value=14), max_size=4),
                min_size=1, max_size=15))
def test_levels_respect_every_dependency(raw):
    # node i may only depend on nodes < i: always a DAG
    nodes = [llm(f"n{i}", *sorted({f"n{d % i}" for d in deps}) if i else ())
             for i, deps in enumerate(raw)]
    g = Graph.model_validate({"nodes": nodes})
    validate(g)
    depth = {n: k for k, level in enumerate(levels(g)) for n in level}
    for node, deps in dependencies(g).items():
        for dep in deps:
            assert depth[dep] < depth[node]


@given(st.integers(min_value=2, max_value=12))
def test_cycles_are_found(n):
    deps = {f"n{i}": {f"n{(i + 1) % n}"} for i in range(n)}
    cycle = find_cycle(deps)
    assert cycle is not None and cycle[0] == cycle[-1] and len(cycle) == n + 1
