"""Recording a workflow in the SDK: no proxy, no sockets."""

from __future__ import annotations

import re
from typing import Literal

import pytest
from pydantic import BaseModel

from flowlift import SemanticVariableError, UserError, step, tool, workflow
from flowlift.dataflow import dependencies, validate
from flowlift.graph import Literal_, Ref, Template, Text


class Facts(BaseModel):
    name: str
    area: str


@step(output=Facts, max_tokens=64)
def extract(doc: str):
    return [{"role": "system", "content": "You extract facts."},
            {"role": "user", "content": f"Document: {doc}"}]


@step
def combine(a, b):
    return f"A={a}; B={b}; A again={a}"


@step
def just(var):
    return var


@step(output=Literal["x", "y"])
def label(text):
    return f"label {text}"


@tool
def lookup(facts, k=3):
    return [facts.name] * k


def test_steps_record_nodes_and_return_placeholders():
    with workflow("t", submit=False) as wf:
        f = extract("some text")
        c = combine(f, label(f))
    g = wf.graph()
    assert [n.id for n in g.nodes] == ["extract_1", "label_1", "combine_1"]
    assert dependencies(g)["combine_1"] == {"extract_1", "label_1"}
    validate(g)
    msg = g.node_map()["combine_1"].messages[0]
    assert msg.content == (Text(text="A="), Ref(ref="extract_1"), Text(text="; B="),
                           Ref(ref="label_1"), Text(text="; A again="), Ref(ref="extract_1"))
    assert g.node_map()["extract_1"].contract.json_schema["title"] == "Facts"
    assert g.node_map()["label_1"].contract.choices == ("x", "y")
    assert g.node_map()["extract_1"].params.max_tokens == 64
    assert not c.ready


def test_w2_prompt_that_is_only_a_variable_and_fan_out():
    with workflow("w2", submit=False) as wf:
        src = wf.input("seed text")
        outs = [just(src) for _ in range(3)]
    g = wf.graph()
    for var in outs:
        node = g.node_map()[var.step_id]
        assert node.messages[0].content == (Ref(ref=src.step_id),)
        assert dependencies(g)[var.step_id] == {src.step_id}


def test_field_projection_is_an_edge_with_a_path():
    with workflow("proj", submit=False) as wf:
        f = extract("doc")
        out = combine(f.name, f.area)
    node = wf.graph().node_map()[out.step_id]
    refs = [p for p in node.messages[0].content if isinstance(p, Ref)]
    assert refs[0] == Ref(ref="extract_1", path=("name",))
    assert refs[1] == Ref(ref="extract_1", path=("area",))
    with pytest.raises(AttributeError, match="no field 'nope'"):
        _ = f.nope


def test_tool_arguments_become_refs_templates_and_literals():
    with workflow("tools", submit=False) as wf:
        f = extract("doc")
        lookup(f, k=2)
        lookup(f"name: {f.name}")
    tools = [n for n in wf.graph().nodes if n.kind == "tool"]
    assert tools[0].args == (Ref(ref="extract_1"),)
    assert tools[0].kwargs == {"k": Literal_(value=2)}
    assert isinstance(tools[1].args[0], Template)


def test_tool_outputs_project_any_field():
    with workflow("tp", submit=False) as wf:
        hits = lookup(extract("doc"))
        out = combine(hits.names, hits.best.score)
    refs = [p for p in wf.graph().node_map()[out.step_id].messages[0].content
            if isinstance(p, Ref)]
    assert refs[0] == Ref(ref=hits.step_id, path=("names",))
    assert refs[1] == Ref(ref=hits.step_id, path=("best", "score"))
    with pytest.raises(SemanticVariableError, match="calling it"):
        hits.upper()


@pytest.mark.parametrize("misuse", [
    lambda v: bool(v), lambda v: len(v), lambda v: v + "x", lambda v: "x" + v,
    lambda v: v == "a", lambda v: list(v), lambda v: v["k"], lambda v: f"{v:>10}",
    lambda v: v.value, lambda v: int(v)])
def test_any_other_use_of_a_placeholder_says_what_to_do(misuse):
    with workflow("bad", submit=False):
        v = extract("doc")
        with pytest.raises(SemanticVariableError, match=r"@tool step|not known|f-string"):
            misuse(v)


def test_placeholder_from_another_workflow_is_rejected():
    with workflow("one", submit=False):
        v = extract("doc")
    with workflow("two", submit=False), \
            pytest.raises(SemanticVariableError, match="another workflow"):
        combine(v, "x")


def test_bad_prompt_and_bad_output_type():
    @step
    def broken():
        return 42

    with workflow("bad", submit=False), pytest.raises(UserError, match="must return its prompt"):
        broken()
    with pytest.raises(UserError, match="unsupported step output"):
        step(output=int)(lambda: "x")


def test_tool_outside_workflow_is_a_plain_call():
    assert lookup(Facts(name="n", area="a"), k=2) == ["n", "n"]


def test_unserialisable_tool_argument():
    with workflow("t", submit=False), pytest.raises(UserError, match="JSON values"):
        lookup(object())


def test_exception_in_block_ships_nothing():
    with pytest.raises(RuntimeError), workflow("t", base_url="http://127.0.0.1:9") as wf:
        extract("doc")
        raise RuntimeError("boom")
    assert wf.status == "abandoned"


@pytest.mark.parametrize(("kwargs", "param", "fix"), [
    ({"retries": 1.5}, "retries", "whole number 0 to 10"),
    ({"retries": "2"}, "retries", "whole number 0 to 10"),
    ({"retries": True}, "retries", "whole number 0 to 10"),
    ({"output": re.compile("")}, "output", "non-empty regex"),
    ({"min_confidence": "high", "model": ["a", "b"]}, "min_confidence", "in (0, 1]"),
    ({"min_confidence": 0.5}, "min_confidence", "model=[small, large]"),
    ({"min_confidence": 0.5, "model": "a"}, "min_confidence", "model=[small, large]"),
])
def test_bad_step_options_are_user_errors_naming_the_parameter(kwargs, param, fix):
    with pytest.raises(UserError) as exc:
        step(**kwargs)
    assert exc.value.param == param and fix in exc.value.message
