"""Appends that cost what they add (issue 24 part 3), counted, not timed: an append to an
open run walks a bounded number of nodes whatever the run's size, never compiles the
grown graph (the report does, when read), logs only its own nodes, and a restarted run
is rebuilt by one full compile."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from flowlift.compiler import CompileOptions
from flowlift.graph import Graph, Node
from flowlift.incremental import GrowingPlan
from flowlift.proxy.state import STATE
from flowlift.proxy.workflows import open_runs
from flowlift.testing import parse_sse

PREAMBLE = "You are a coding agent with a shell tool; answer with the next command . " * 2


def _turn(k: int) -> dict[str, Any]:
    """Turn k of an agent loop: the preamble, the previous turn's answer, a tool result."""
    content: list[dict[str, Any]] = [{"text": PREAMBLE}]
    if k > 1:
        content += [{"ref": f"t{k - 1}"}, {"text": f" result {k}"}]
    return {"kind": "llm", "id": f"t{k}", "messages": [{"role": "user", "content": content}],
            "params": {"max_tokens": 8, "temperature": 0.7}}


def _nodes(*wire: dict[str, Any]) -> tuple[Node, ...]:
    return Graph.model_validate({"nodes": list(wire)}).nodes


def _work_per_append(n: int, finished: bool) -> list[int]:
    """Nodes and edges walked by each of 5 appends to an agent loop of ``n`` turns."""
    done: set[str] = set()
    state = GrowingPlan(Graph.model_validate({"open": True, "nodes": [_turn(1)]}),
                        CompileOptions(default_model="m"),
                        finished=done.__contains__)
    walked = []
    for k in range(2, n + 6):
        before = state.visited
        state.add(_nodes(_turn(k)))
        walked.append(state.visited - before)
        if finished:
            done.add(f"t{k - 1}")  # the app read it before it appended turn k
    return walked[-5:]


def test_an_append_to_an_agent_loop_walks_the_same_whatever_its_length():
    small, big = _work_per_append(20, finished=True), _work_per_append(400, finished=True)
    assert small == big and max(big) < 12, (small, big)


def test_an_unfinished_chain_is_walked_to_its_root_and_no_further():
    # nobody read anything: every ancestor's remaining path grows by the new turn
    small, big = _work_per_append(20, finished=False), _work_per_append(200, finished=False)
    assert big[-1] > small[-1] >= 20
    assert big[-1] < 8 * 205, big  # a few visits per ancestor, not per pair of them


async def test_appends_never_compile_the_grown_graph(client, engine, monkeypatch):
    compiled: list[int] = []
    real = open_runs.compile_graph
    monkeypatch.setattr(open_runs, "compile_graph",
                        lambda g, o=None: compiled.append(len(g.nodes)) or real(g, o))
    import flowlift.incremental as incremental
    monkeypatch.setattr(incremental, "compile_graph",
                        lambda g, o=None: compiled.append(len(g.nodes)) or real(g, o))
    resp = await client.post("/v1/workflows", json={"open": True, "nodes": [_turn(1)]})
    events = asyncio.ensure_future(resp.text())
    runs = client.server.app[STATE].runs
    while not runs.active:
        await asyncio.sleep(0.005)
    (run_id,) = runs.active
    run = runs.get(run_id)
    for k in range(2, 41):
        while f"t{k - 1}" not in run.outputs:
            await asyncio.sleep(0.002)
        ok = await client.post(f"/v1/workflows/{run_id}/nodes",
                               json={"nodes": [_turn(k)], "awaited": [f"t{k}"]})
        assert ok.status == 200, await ok.text()
        assert "append;dur=" in ok.headers["Server-Timing"]
    assert compiled == []  # 39 appends, no compile of the grown graph
    assert run.plan is not None and set(run.plan.tail_ms) == {f"t{k}" for k in range(1, 41)}
    status = await (await client.get(f"/v1/workflows/{run_id}")).json()
    assert compiled == [40]  # the report: one full compile, when read
    assert status["report"]["steps"] == 40 and status["report"]["open"] is True
    await client.post(f"/v1/workflows/{run_id}/close")
    appended = [d for e, d in parse_sse(await events) if e == "nodes.appended"]
    assert [[n["id"] for n in d["nodes"]] for d in appended] == [[f"t{k}"] for k in
                                                                 range(2, 41)]
    assert max(len(json.dumps(d)) for d in appended) < 2 * len(json.dumps(_turn(40)))


@pytest.mark.parametrize("recompile", [False, True])
async def test_both_append_paths_give_the_scheduler_the_same_plan(make_app, aiohttp_client,
                                                                  engine, recompile):
    from flowlift.proxy import ProxyConfig
    engine.delay_s = 0.05  # the fan-out still runs when the join comes
    client = await aiohttp_client(make_app(ProxyConfig(append_recompile=recompile)))
    await client.server.app[STATE].ready.wait()
    resp = await client.post("/v1/workflows", json={"open": True, "nodes": [
        {"kind": "input", "id": "doc", "value": "a long document " * 10}]})
    events = asyncio.ensure_future(resp.text())
    runs = client.server.app[STATE].runs
    while not runs.active:
        await asyncio.sleep(0.005)
    (run_id,) = runs.active
    fan = [{"kind": "llm", "id": f"s{i}", "messages": [{"role": "user", "content": [
        {"text": PREAMBLE}, {"text": f"part {i}: "}, {"ref": "doc"}]}],
            "params": {"max_tokens": 4}} for i in range(4)]
    for batch in (fan[:2], fan[2:], [{"kind": "llm", "id": "join", "messages": [
            {"role": "user", "content": [{"ref": f"s{i}"} for i in range(4)]}],
            "params": {"max_tokens": 4}}]):
        ok = await client.post(f"/v1/workflows/{run_id}/nodes", json={"nodes": batch})
        assert ok.status == 200, await ok.text()
    plan = runs.get(run_id).plan
    groups = {s: plan.prefix_group[s] for s in ("s0", "s1", "s2", "s3")}
    assert len(set(groups.values())) == 1 and plan.group_leader[groups["s0"]] == "s0"
    assert plan.tail_ms["s0"] > plan.tail_ms["join"] > 0  # (the input, read, is done)
    assert plan.tail_ms["s0"] == pytest.approx(plan.cost_ms["s0"] + plan.tail_ms["join"])
    await client.post(f"/v1/workflows/{run_id}/close")
    await events


def test_serve_append_recompile_reaches_the_settings():
    from flowlift.cli import build_parser, serve_flags
    from flowlift.proxy.config import settings
    parse = build_parser().parse_args
    assert settings(serve_flags(parse(["serve", "--append-recompile"]))).append_recompile
    assert not settings(serve_flags(parse(["serve"]))).append_recompile
