"""Conditional steps (issue 27 part 1): ``when=`` conditions shipped as data and decided
on the proxy, skipped as a state of its own, skips that propagate, ``default=``, graph
errors for bad conditions, and a restored run that keeps its skips."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import pytest
from pydantic import BaseModel

from flowlift import GraphError, StepWasSkipped, UserError, field, step, tool, workflow
from flowlift.costs import CostTracker
from flowlift.dataflow import validate
from flowlift.graph import Graph
from flowlift.predicates import Predicate, PredicateFailed, evaluate
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.state import STATE
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.workflows.registry import RunRegistry
from flowlift.testing import FakeEngine


class Verdict(BaseModel):
    ok: bool
    score: int
    topic: str


@step(output=Verdict, max_tokens=40)
def judge(text):
    return f"Judge: {text}"


@step(max_tokens=20)
def repair(text):
    return f"Repair: {text}"


@step(max_tokens=20)
def polish(text):
    return f"Polish: {text}"


@step(output=Literal["yes", "no"])
def gate(text):
    return f"Gate: {text}"


GATHERED: list[list[str]] = []


@tool
def gather(items):
    GATHERED.append(list(items))
    return len(items)


def _verdict(ok: bool, score: int, topic: str = "math"):
    def respond(request):
        if request.constraint is not None and request.constraint.json_schema:
            return json.dumps({"ok": ok, "score": score, "topic": topic})
        if request.constraint is not None and request.constraint.choices:
            return request.constraint.choices[0]
        last = request.messages[-1].content
        return f"done({last})"
    return respond


def _base(client) -> str:
    return str(client.make_url("")).rstrip("/")


async def test_false_condition_skips_and_propagates_but_run_succeeds(client, engine):
    engine.responder = _verdict(ok=True, score=2)
    GATHERED.clear()
    async with workflow("cond", base_url=_base(client)) as wf:
        v = judge("essay")
        fix = repair(v.topic, when=field(v.ok) == False)  # noqa: E712 -- a condition
        after = polish(fix)  # reads only a skipped step: skipped too
        kept = polish(v.topic, when=(field(v.score) < 3) & field(v.topic).isin(["math"]))
        total = gather([fix, kept])  # a list: the skipped item is left out
    assert wf.status == "succeeded" and not wf.failures
    assert set(wf.skipped) == {fix.step_id, after.step_id}
    assert "condition judge_1.ok == False is false" in wf.skipped[fix.step_id]
    assert f"input {fix.step_id!r} was skipped" in wf.skipped[after.step_id]
    assert kept.value == "done(Polish: math)" and total.value == 1
    assert GATHERED == [["done(Polish: math)"]]
    with pytest.raises(StepWasSkipped, match="repair_1' was skipped"):
        _ = fix.value
    prompts = [r.messages[-1].content for r in engine.requests]
    assert not any(p.startswith(("Repair", "Polish: done")) for p in prompts)
    statuses = {r["step_id"]: r["status"] for r in wf.trace if r["type"] == "step"}
    assert statuses[fix.step_id] == statuses[after.step_id] == "skipped"
    assert statuses[kept.step_id] == "done"


async def test_default_stands_for_a_skipped_step(client, engine):
    engine.responder = _verdict(ok=True, score=9)
    async with workflow("dflt", base_url=_base(client)) as wf:
        v = judge("essay")
        fix = repair.when(~field(v.ok), default="nothing to repair")(v.topic)
        after = polish(fix)
        labelled = gate(v.topic, when=v.ok)  # a boolean field alone: its truthiness
    assert fix.step_id in wf.skipped and fix.value == "nothing to repair"
    assert after.value == "done(Polish: nothing to repair)"
    assert labelled.value == "yes"


async def test_condition_is_decided_before_the_steps_other_inputs(aiohttp_client, make_app,
                                                                  engine):
    engine.delay_s = 0.02  # each chunk: the long step takes a while
    engine.responder = lambda r: ("no" if r.constraint and r.constraint.choices
                                  else "slow " * 30)
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    async with workflow("early", base_url=_base(client)) as wf:
        long = polish("a long text")
        flag = gate("quick")
        tail = repair(long, when=field(flag) == "yes")
    assert tail.step_id in wf.skipped
    run = app[STATE].runs.live(wf.run_id, None) or None
    events = [n for n, d in await _events(app, wf.run_id)
              if d.get("step_id") in (long.step_id, tail.step_id)]
    assert events.index("step.skipped") < events.index("step.finished"), events
    del run


async def _events(app, run_id):
    await app[STATE].runs.io.flush()  # (the store may trail the run by a few writes)
    stored = await app[STATE].runs.stored(run_id, None)
    return [(n, d) for _, n, d in stored.events]


async def test_progress_and_get_run_show_skipped(client, engine):
    engine.responder = _verdict(ok=True, score=2)
    async with workflow("prog", base_url=_base(client)) as wf:
        v = judge("x")
        repair(v.topic, when=field(v.score) > 5)
    doc = await (await client.get(f"/v1/workflows/{wf.run_id}")).json()
    assert doc["skipped"] == {"repair_1": "condition judge_1.score > 5 is false"}
    assert doc["failures"] == {} and doc["status"] == "succeeded"
    counts = (await (await client.get(f"/v1/workflows/{wf.run_id}/progress")).json())["counts"]
    assert counts["skipped"] == 1 and counts["done"] == 1 and counts["failed"] == 0


def _node(node_id, text="x", **extra):
    return {"kind": "llm", "id": node_id,
            "messages": [{"role": "user", "content": [{"text": text}]}], **extra}


def test_bad_conditions_are_graph_errors_listed_together():
    schema = Verdict.model_json_schema()
    graph = Graph.model_validate({"nodes": [
        _node("v", contract={"json_schema": schema}),
        _node("g", contract={"choices": ["yes", "no"]}),
        _node("a", when={"op": "eq", "ref": "v", "path": ["verdict"], "value": "x"}),
        _node("b", when={"op": "eq", "ref": "v", "path": ["score"], "value": "high"}),
        _node("c", when={"op": "in", "ref": "g", "value": ["yes", "maybe"]}),
        _node("d", when={"op": "gt", "ref": "v", "path": ["ok"], "value": 1}),
        _node("e", when={"op": "truthy", "ref": "nope"})]})
    with pytest.raises(GraphError) as info:
        validate(graph)
    text = "\n".join(info.value.problems)
    assert "reads field 'verdict' of 'v', whose contract has no such field" in text
    assert "compares v.score (integer) with 'high' (string)" in text
    assert "'maybe', which is not one of its labels (yes, no)" in text
    assert "orders v.ok, a boolean field" in text
    assert "unknown node 'nope'" in text
    assert len(info.value.problems) == 5


def test_conditions_are_data_with_every_operator():
    outputs = {"v": {"ok": False, "score": 4, "tags": ["a"]}, "g": "yes"}

    def read(ref, path):
        value = outputs[ref]
        for key in path:
            value = value[key]
        return value

    def p(doc):
        return evaluate(Predicate.model_validate(doc), read)

    assert p({"op": "ne", "ref": "g", "value": "no"})
    assert p({"op": "not", "args": [{"op": "truthy", "ref": "v", "path": ["ok"]}]})
    assert p({"op": "or", "args": [{"op": "lt", "ref": "v", "path": ["score"], "value": 1},
                                   {"op": "ge", "ref": "v", "path": ["score"], "value": 4}]})
    assert not p({"op": "and", "args": [{"op": "le", "ref": "v", "path": ["score"],
                                         "value": 4},
                                        {"op": "in", "ref": "g", "value": ["no"]}]})
    assert not p({"op": "eq", "ref": "v", "path": ["ok"], "value": 0})  # JSON: False != 0
    assert p({"op": "truthy", "ref": "v", "path": ["tags"]})
    with pytest.raises(PredicateFailed, match="has no field 'missing'"):
        p({"op": "truthy", "ref": "v", "path": ["missing"]})
    with pytest.raises(PredicateFailed, match="cannot compare"):
        p({"op": "lt", "ref": "g", "value": 3})
    with pytest.raises(ValueError, match="'not' takes exactly one"):
        Predicate.model_validate({"op": "not", "args": []})


def test_sdk_ships_the_condition_as_data_and_refuses_python_logic():
    with workflow("rec", submit=False) as wf:
        v = judge("x")
        repair(v.topic, when=(field(v.score) >= 2) | ~field(v.ok), default=None)
        with pytest.raises(UserError, match="combine conditions with `&`"):
            repair(v.topic, when=field(v.ok) and field(v.score) > 1)
        with pytest.raises(UserError, match="a plain value cannot change on the proxy"):
            repair(v.topic, when=True)
    wire = wf.graph().to_wire()["nodes"][1]
    assert wire["when"] == {"op": "or", "args": [
        {"op": "ge", "ref": "judge_1", "path": ["score"], "value": 2},
        {"op": "not", "args": [{"op": "truthy", "ref": "judge_1", "path": ["ok"]}]}]}
    assert wire["default"] == {"value": None}
    assert "when" not in wf.graph().to_wire()["nodes"][0]  # unconditional: as before


async def test_a_restored_run_keeps_its_skips_and_defaults():
    store = RunStore(":memory:")
    graph = Graph.model_validate({"detached": True, "nodes": [
        _node("g", contract={"choices": ["yes", "no"]}),
        _node("s", "never", when={"op": "eq", "ref": "g", "value": "yes"},
              default={"value": "stand-in"}),
        {"kind": "llm", "id": "r", "messages": [{"role": "user", "content": [
            {"text": "after "}, {"ref": "s"}]}]}]})
    store.create("wf-c", graph.to_wire())
    start = {"run_id": "wf-c", "started_at": time.time()}
    for seq, (name, data) in enumerate((("run.started", start),
                       ("step.finished", {"step_id": "g", "value": "no"}),
                       ("step.skipped", {"step_id": "s", "reason": "condition g == 'yes' "
                                         "is false", "value": "stand-in"})), 1):
        store.append("wf-c", seq, name, data)
    engine = FakeEngine(["m"])
    registry = RunRegistry(store)
    (run,) = await registry.resume_all(Backends({"m": engine}), CostTracker())
    await asyncio.wait_for(run.task, 10)
    prompts = [r.messages[-1].content for r in engine.requests]
    assert prompts == ["after stand-in"], prompts  # neither g nor s ran again
    assert run.skipped == {"s": "condition g == 'yes' is false"}
    assert run.trace.step("s").status == "skipped"
    await registry.io.flush()  # (the store trails the run by its last writes)
    assert store.load("wf-c").status == "succeeded"


async def test_report_and_progress_line_count_skipped_steps(client, engine):
    from flowlift.sdk.progress import Counts, format_line

    engine.responder = _verdict(ok=True, score=2)
    async with workflow("rep", base_url=_base(client)) as wf:
        v = judge("x")
        repair(v.topic, when=field(v.score) > 5)
    assert wf.summary()["skipped"] == 1 and "1 skipped" in wf.report()
    line = format_line(Counts(total=4, done=2, skipped=1), 1.0, width=8)
    assert "[####--  ]" in line and "1 skipped, 1 waiting" in line


def test_compiler_reports_conditional_steps_and_expected_vs_worst_case():
    from flowlift.compiler import compile_graph
    from flowlift.report import format_report

    when = {"op": "eq", "ref": "g", "value": "yes"}
    graph = Graph.model_validate({"nodes": [
        _node("g", contract={"choices": ["yes", "no"]}),
        _node("a", "branch a", when=when, params={"max_tokens": 200}),
        _node("b", "branch b", when=when, default={"value": "none"}),
        {"kind": "llm", "id": "ra", "messages": [{"role": "user", "content": [
            {"text": "after "}, {"ref": "a"}]}]},
        {"kind": "llm", "id": "rb", "messages": [{"role": "user", "content": [
            {"text": "after "}, {"ref": "b"}]}]},
        {"kind": "tool", "id": "t", "name": "merge", "args": [
            {"items": [{"ref": "a"}, {"ref": "g"}]}]}]})
    report = compile_graph(graph).report
    d = report.decisions
    assert d is not None
    assert d.conditional == ["a", "b", "ra"]  # rb reads b's default; t has g for sure
    assert d.run_chance == {"a": 0.5, "b": 0.5, "ra": 0.5}
    assert d.expected_work_ms < d.worst_case_work_ms
    assert d.worst_case_work_ms == pytest.approx(report.total_work_ms)
    assert d.expected_tokens < d.worst_case_tokens
    text = format_report(report)
    assert "3 conditional step(s) (a, b, ra), 0 group(s), 0 map(s)" in text
    assert "?conditional" in text
    plain = Graph.model_validate({"nodes": [_node("x")]})
    assert compile_graph(plain).report.decisions is None


async def test_bad_conditions_groups_and_maps_come_back_together_over_http(client):
    schema = {"json_schema": Verdict.model_json_schema()}
    graph = {"nodes": [
        _node("v", contract=schema), _node("t"),
        _node("a", when={"op": "eq", "ref": "v", "path": ["nope"], "value": 1}),
        {"kind": "group", "id": "g", "mode": "quorum", "members": ["v", "t"], "k": 2,
         "agree_on": ["missing"]},
        {"kind": "map", "id": "m", "over": {"ref": "t"}, "max_items": 2,
         "step": _node("s")}]}
    response = await client.post("/v1/workflows", json=graph)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "invalid_graph"
    text = "\n".join(error["problems"])
    assert "reads field 'nope' of 'v'" in text
    assert "agrees on field 'missing'" in text and "member 't' has no JSON contract" in text
    assert "map 'm' runs over t, which is not a list" in text


async def test_the_timeline_page_shows_skipped_steps_as_skipped(client, engine):
    engine.responder = _verdict(ok=True, score=2)
    async with workflow("page", base_url=_base(client)) as wf:
        v = judge("x")
        repair(v.topic, when=field(v.score) > 5)
    page = await (await client.get(f"/ui/workflows/{wf.run_id}")).text()
    assert "<td>skipped</td>" in page
    assert "skipped: condition judge_1.score &gt; 5 is false" in page
