"""Dynamic fan-out (issue 27 part 3): ``wf.map(step, items, max_items=...)`` makes one
step per item on the proxy once the list is known, consolidated like a static batch;
the value is a list a reduce step reads; limits, bad maps as graph errors, and a run
restarted in the middle of a map."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import BaseModel

from flowlift import GraphError, UserError, WorkflowFailed, field, step, workflow
from flowlift.costs import CostTracker
from flowlift.dataflow import validate
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.state import STATE
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.workflows.progress import stored_listing
from flowlift.proxy.workflows.registry import RunRegistry
from flowlift.testing import FakeEngine


class Outline(BaseModel):
    sections: list[str]


class Item(BaseModel):
    name: str
    keep: bool


class Items(BaseModel):
    items: list[Item]


@step(output=Outline, max_tokens=80)
def outline(topic):
    return f"Outline {topic}"


@step(output=Items, max_tokens=80)
def listing(topic):
    return f"List {topic}"


@step(max_tokens=30)
def draft(section, topic):
    return f"Shared preamble for every draft of the topic. Topic {topic}. Draft {section}"


@step(max_tokens=30)
def describe(item):
    return f"Describe {item.name}"


@step(max_tokens=60)
def merge(drafts):
    return f"Merge {drafts}"


def _responder(sections):
    def respond(request):
        text = request.messages[-1].content
        if text.startswith("Outline"):
            return json.dumps({"sections": sections})
        if text.startswith("List"):
            return json.dumps({"items": [{"name": "a", "keep": True},
                                         {"name": "b", "keep": False},
                                         {"name": "c", "keep": True}]})
        for head in ("Draft ", "Merge ", "Describe "):
            if head in text:
                return f"<{text.split(head, 1)[1]}>"
        return f"<{text}>"
    return respond


def _base(client) -> str:
    return str(client.make_url("")).rstrip("/")


async def test_map_runs_a_step_per_item_and_a_reduce_reads_the_list(client, engine):
    engine.responder = _responder(["intro", "body", "intro", "end"])
    async with workflow("fan", base_url=_base(client)) as wf:
        plan = outline("cats")
        drafts = wf.map(draft, plan.sections, "cats", max_items=8)
        final = merge(drafts)
    assert wf.status == "succeeded"
    assert drafts.value == ["<intro>", "<body>", "<intro>", "<end>"]
    assert final.value == '<["<intro>", "<body>", "<intro>", "<end>"]>'
    prompts = [r.messages[-1].content for r in engine.requests]
    drafted = [p for p in prompts if "Draft" in p]
    assert sorted(drafted) == sorted({p for p in drafted}), "an identical item ran twice"
    assert len(drafted) == 3  # "intro" twice: merged, paid once
    steps = {r["step_id"]: r for r in wf.trace if r["type"] == "step"}
    assert {"map_draft_1-0", "map_draft_1-3"} <= set(steps)
    assert steps["map_draft_1-2"]["same_as"] == "map_draft_1-0"


async def test_a_map_runs_progress_counts_its_items_live_and_from_the_store(client, engine):
    """`flowlift runs` without a proxy reads the progress from the store: a map's item
    steps count in the total there as they do live (it said 7/4 here: done counted the
    items, the total only the graph's nodes) (issue 38 item 9)."""
    engine.responder = _responder(["intro", "body", "end"])
    async with workflow("fan", base_url=_base(client)) as wf:
        merge(wf.map(draft, outline("cats").sections, "cats", max_items=8))
    steps = len([r for r in wf.trace if r["type"] == "step"])
    live = next(r for r in (await (await client.get("/v1/workflows")).json())["data"]
                if r["id"] == wf.run_id)
    runs = client.app[STATE].runs
    await runs.io.flush()
    stored = stored_listing(await runs.stored(wf.run_id, None))
    assert (live["steps"], live["done"]) == (steps, steps) == (stored["steps"],
                                                                stored["done"])
    progress = await (await client.get(f"/v1/workflows/{wf.run_id}/progress")).json()
    assert progress["steps"] == steps


async def test_an_empty_list_is_an_empty_list(client, engine):
    engine.responder = _responder([])
    async with workflow("none", base_url=_base(client)) as wf:
        drafts = wf.map(draft, outline("x").sections, "x", max_items=4)
        final = merge(drafts)
    assert drafts.value == [] and final.value == "<[]>" and not wf.failures


async def test_more_items_than_max_items_fails_the_map_clearly(client, engine):
    engine.responder = _responder(["a", "b", "c"])
    with pytest.raises(WorkflowFailed) as info:
        async with workflow("many", base_url=_base(client)) as wf:
            wf.map(draft, outline("x").sections, "x", max_items=2)
    reason = str(info.value.failures["map_draft_1"])
    assert "outline_1.sections has 3 items, more than its max_items=2" in reason
    assert not any("Draft" in r.messages[-1].content for r in engine.requests)


async def test_items_are_projected_and_a_condition_on_them_drops_items(client, engine):
    engine.responder = _responder([])
    async with workflow("cond", base_url=_base(client)) as wf:
        found = listing("x")
        described = wf.map(describe, found.items, max_items=5,
                           when=lambda item: field(item.keep))
        every = wf.map(describe, found.items, max_items=5,
                       when=lambda item: field(item.keep), default="(dropped)")
    assert described.value == ["<a>", "<c>"]
    assert every.value == ["<a>", "(dropped)", "<c>"]
    assert not wf.failures


def test_bad_maps_are_graph_errors_and_bad_calls_user_errors():
    def llm(node_id, **extra):
        return {"kind": "llm", "id": node_id, "messages": [{"role": "user", "content": [
            {"text": node_id}]}], **extra}

    template = llm("t", messages=[{"role": "user", "content": [{"ref": "$item"}]}])
    graph = Graph.model_validate({"nodes": [
        llm("text"), llm("obj", contract={"json_schema": Outline.model_json_schema()}),
        {"kind": "input", "id": "n", "value": 3},
        {"kind": "map", "id": "m1", "over": {"ref": "text"}, "step": template,
         "max_items": 3},
        {"kind": "map", "id": "m2", "over": {"ref": "obj"}, "step": template,
         "max_items": 3},
        {"kind": "map", "id": "m3", "over": {"ref": "n"}, "step": template, "max_items": 3},
        {"kind": "map", "id": "m4", "over": {"ref": "obj", "path": ["sections"]},
         "step": template, "max_items": 3}]})
    with pytest.raises(GraphError) as info:
        validate(graph)
    assert [p.split(" runs over ")[0] for p in info.value.problems] == [
        "map 'm1'", "map 'm2'", "map 'm3'"]
    assert "runs over text, which is not a list" in info.value.problems[0]
    with workflow("rec", submit=False) as wf:
        with pytest.raises(UserError, match="max_items=0 must be a whole number"):
            wf.map(draft, outline("x").sections, "x", max_items=0)
        with pytest.raises(UserError, match="must be a @step"):
            wf.map(len, outline("x").sections, max_items=2)


async def test_a_run_restarted_in_the_middle_of_a_map_runs_only_the_rest():
    store = RunStore(":memory:")
    with workflow("restart", submit=False, detach=True) as wf:
        drafts = wf.map(draft, outline("cats").sections, "cats", max_items=8)
        merge(drafts)
    graph = wf.graph()
    store.create("wf-m", graph.to_wire())
    done_trace = {"step_id": "map_draft_1-0", "kind": "llm", "status": "done",
                  "completion_tokens": 7, "ready_ms": 1.0, "finished_ms": 5.0}
    events = [("run.started", {"run_id": "wf-m", "started_at": time.time()}),
              ("step.finished", {"step_id": "outline_1",
                                 "value": {"sections": ["a", "b", "c"]}}),
              ("map.expanded", {"step_id": "map_draft_1", "items": 3,
                                "steps": ["map_draft_1-0", "map_draft_1-1", "map_draft_1-2"]}),
              ("step.finished", {"step_id": "map_draft_1-0-item", "value": "a"}),
              ("step.finished", {"step_id": "map_draft_1-0", "value": "<a, before>",
                                 "trace": done_trace})]
    for seq, (name, data) in enumerate(events, 1):
        store.append("wf-m", seq, name, data)
    engine = FakeEngine(["m"], responder=_responder([]))
    registry = RunRegistry(store)
    (run,) = await registry.resume_all(Backends({"m": engine}), CostTracker())
    await asyncio.wait_for(run.task, 10)
    prompts = [r.messages[-1].content for r in engine.requests]
    assert sorted(p.rsplit(" ", 1)[-1] for p in prompts if "Draft" in p) == ["b", "c"]
    assert not any(p.startswith("Outline") for p in prompts)
    assert run.outputs["map_draft_1"] == ["<a, before>", "<b>", "<c>"]
    assert run.trace.step("map_draft_1-0").completion_tokens == 7  # its record is back
    await registry.io.flush()  # (the store trails the run by its last writes)
    assert store.load("wf-m").status == "succeeded"


def test_compiler_counts_a_map_at_max_items():
    from flowlift.compiler import compile_graph

    with workflow("plan", submit=False) as wf:
        wf.map(draft, outline("cats").sections, "cats", max_items=8)
    plan = compile_graph(wf.graph())
    report = plan.report
    d = report.decisions
    assert d is not None and d.maps == {"map_draft_1": 8}
    one = plan.cost_ms["map_draft_1"]
    assert d.worst_case_work_ms == pytest.approx(report.total_work_ms + 7 * one, abs=0.5)


def test_kill_9_in_the_middle_of_a_map_then_restart_runs_only_the_rest(tmp_path):
    import os
    import signal
    import threading

    from flowlift.testing import free_port, running_proxy

    port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"

    def serve():  # type: ignore[no-untyped-def]
        return running_proxy("--engine", "fake", "--state-db", str(db), "--fake-delay-s",
                             "0.02", log_path=log, port=port, ready_timeout_s=60)

    wf = workflow("map-restart", base_url=f"http://127.0.0.1:{port}", reconnect_s=60)
    errors: list[BaseException] = []
    sections = [f"s{i} " + "word " * (12 * i) for i in range(5)]  # longer ones end later

    def run() -> None:
        try:
            with wf:
                wf.map(draft, wf.input(sections, name="sections"), "t", max_items=5)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    with serve() as (_, proc):
        thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(
                k.startswith("map_draft_1-") and not k.endswith("item")
                for k in wf._outputs) < 2:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    before = {k for k in wf._outputs if k.startswith("map_draft_1-") and "item" not in k}
    assert 2 <= len(before) < 5, before
    with serve():
        thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
    assert wf.status == "succeeded" and len(wf.outputs["map_draft_1"]) == 5
    stored = RunStore(db).load(wf.run_id)
    finished = [d["step_id"] for _, n, d in stored.events if n == "step.finished"]
    assert sorted(finished) == sorted(set(finished)), "an item that had finished ran again"
    assert [n for _, n, _ in stored.events].count("run.resumed") == 1


def test_a_map_s_items_are_planned_after_the_step_that_makes_their_list():
    """Issue 38 item 8: a run's grown graph (its map expanded) is planned with the item
    steps after the step whose output is the list, and the map after its items."""
    from flowlift.compiler import compile_graph
    from flowlift.proxy.workflows.fanout import expand

    with workflow("plan", submit=False) as wf:
        merge(wf.map(draft, outline("cats").sections, "cats", max_items=8))
    graph = wf.graph()
    node = graph.node_map()["map_draft_1"]
    grown = graph.model_copy(update={"nodes": (*graph.nodes, *expand(node, ["a", "b", "c"]))})
    rows = {n.step_id: n for n in compile_graph(grown).report.nodes}
    outline_end = rows["outline_1"].start_ms + rows["outline_1"].est_ms
    for i in range(3):
        assert rows[f"map_draft_1-{i}"].start_ms >= outline_end > 0
        assert rows[f"map_draft_1-{i}-item"].level > rows["outline_1"].level
    items_end = max(rows[f"map_draft_1-{i}"].start_ms + rows[f"map_draft_1-{i}"].est_ms
                    for i in range(3))
    assert rows["map_draft_1"].start_ms + rows["map_draft_1"].est_ms >= items_end
    assert rows["merge_1"].start_ms >= items_end
    assert rows["map_draft_1"].est_ms == 0.0  # its items carry the work
