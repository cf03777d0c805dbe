"""First-wins and quorum groups (issue 27 part 2): resolved on the proxy as soon as the
first good result arrives or k results agree; the rest cancelled (queued dropped,
running engine requests aborted, billed for what they generated), in whole and open
runs; bad groups are graph errors; the compiler counts early resolution."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import BaseModel

from flowlift import GraphError, UserError, WorkflowFailed, step, workflow
from flowlift.compiler import compile_graph
from flowlift.dataflow import dependencies, validate
from flowlift.graph import Graph
from flowlift.proxy.state import STATE
from flowlift.report import format_report
from flowlift.tracing.timeline import measured_critical_path, segments


class Vote(BaseModel):
    choice: str
    why: str


@step(output=Vote, max_tokens=400)
def vote(question, voter):
    return f"Q: {question} voter={voter}"


@step(max_tokens=400)
def say(text):
    return f"Say {text}"


@step(max_tokens=40)
def use(x):
    return f"use {x}"


def _voter(request) -> str:
    return request.messages[-1].content.rsplit("voter=", 1)[-1]


def _votes(table):
    """voter -> (choice, words of reasoning): more words take longer to stream."""
    def respond(request):
        text = request.messages[-1].content
        if "voter=" in text:
            choice, words = table[_voter(request)]
            return json.dumps({"choice": choice, "why": " ".join(["w"] * words)})
        return f"used({text[:20]})"
    return respond


def _base(client) -> str:
    return str(client.make_url("")).rstrip("/")


async def _proxy(aiohttp_client, make_app, engine):
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return app, client


async def test_quorum_resolves_early_and_leaves_nothing_running(aiohttp_client, make_app,
                                                                engine):
    engine.delay_s, engine.chunk_chars = 0.01, 2
    engine.max_running = 4  # the fifth voter waits in the engine's queue
    engine.responder = _votes({"a": ("yes", 2), "b": ("no", 3), "c": ("yes", 4),
                               "d": ("yes", 400), "e": ("no", 400)})
    app, client = await _proxy(aiohttp_client, make_app, engine)
    t0 = time.monotonic()
    async with workflow("vote", base_url=_base(client)) as wf:
        votes = [vote("2+2=4?", v) for v in "abcde"]
        agreed = wf.quorum(*votes, k=2, agree_on="choice")
        after = use(agreed.choice)
    elapsed = time.monotonic() - t0
    assert wf.status == "succeeded" and not wf.failures
    assert agreed.value.choice == "yes" and isinstance(agreed.value, Vote)
    assert after.value.startswith("used(")
    assert set(wf.skipped) == {"vote_4", "vote_5"}  # cancelled, not failed
    assert "group 'quorum_1' resolved by 'vote_1'" in wf.skipped["vote_4"]
    assert engine.running() == 0
    losers = {r.request_id for r in engine.requests if _voter(r) in "de"}
    assert losers <= set(engine.aborted) or not losers  # queued ones may never reach it
    assert elapsed < 400 * 2 * 0.01 / 2, "the slow voters were waited for"
    await app[STATE].runs.io.flush()  # (the store may trail the run by a few writes)
    resolved = [d for _, n, d in (await app[STATE].runs.stored(wf.run_id, None)).events
                if n == "group.resolved"]
    assert resolved == [{"step_id": "quorum_1", "winner": "vote_1",
                         "agreeing": ["vote_1", "vote_3"], "cancelled": ["vote_4", "vote_5"]}]
    steps = {r["step_id"]: r for r in wf.trace if r["type"] == "step"}
    running_loser = steps["vote_4"]
    assert running_loser["status"] == "skipped"
    assert running_loser["attempts"][-1]["outcome"] == "cancelled"
    billed = running_loser["completion_tokens"]
    assert 0 < billed < 400, billed  # what it generated before the abort, not the whole


async def test_first_wins_takes_the_first_good_result(aiohttp_client, make_app, engine):
    """...and the slow member, cancelled when the quick one won, ends after the winner:
    it is drawn as a cancelled try (not a failed one), and the measured critical path
    runs through the winner, not through the loser nothing waited for (issue 38 item 9)."""
    engine.delay_s, engine.chunk_chars = 0.01, 2
    engine.responder = lambda r: ("x" * 300 if "slow" in r.messages[-1].content
                                  else "quick answer")
    _, client = await _proxy(aiohttp_client, make_app, engine)
    async with workflow("first", base_url=_base(client)) as wf:
        slow, quick = say("slow"), say("quick")
        best = wf.first(slow, quick)
        use(best)
    assert best.value == "quick answer"
    assert slow.step_id in wf.skipped and quick.step_id not in wf.skipped
    assert f"{wf.run_id}:{slow.step_id}:1" in engine.aborted
    assert engine.running() == 0
    steps = [r for r in wf.trace if r["type"] == "step"]
    by_id = {r["step_id"]: r for r in steps}
    loser = by_id[slow.step_id]
    assert loser["finished_ms"] >= by_id[quick.step_id]["finished_ms"]  # ended last
    stages = [s.stage for s in segments(loser)]
    assert "cancelled" in stages and "failed_try" not in stages, stages
    path = measured_critical_path(steps, dependencies(wf.graph()))
    assert quick.step_id in path and slow.step_id not in path, path
    assert path[-1] == "use_1"


async def test_no_quorum_possible_fails_the_group_at_once(aiohttp_client, make_app, engine):
    engine.delay_s, engine.chunk_chars = 0.01, 2
    engine.responder = _votes({"a": ("yes", 1), "b": ("no", 1), "c": ("maybe", 1),
                               "d": ("yes", 400)})
    _, client = await _proxy(aiohttp_client, make_app, engine)
    with pytest.raises(WorkflowFailed) as info:
        async with workflow("split", base_url=_base(client)) as wf:
            votes = [vote("q", v) for v in "abcd"]
            agreed = wf.quorum(*votes, k=3, agree_on="choice")
            use(agreed)
    assert "no quorum: 3 result(s), at most 1 agree on choice (k=3)" in str(
        info.value.failures["quorum_1"])
    assert "vote_4" in wf.skipped and engine.running() == 0
    assert info.value.failures["use_1"].kind == "skipped"  # its input failed


async def test_an_open_run_awaits_a_group_and_grows_after_it(aiohttp_client, make_app,
                                                             engine):
    engine.delay_s, engine.chunk_chars = 0.005, 2
    engine.responder = _votes({"a": ("yes", 1), "b": ("yes", 2), "c": ("no", 300)})
    _, client = await _proxy(aiohttp_client, make_app, engine)
    async with workflow("open", base_url=_base(client)) as wf:
        votes = [vote("q", v) for v in "abc"]
        agreed = await wf.quorum(*votes, k=2, agree_on="choice")
        assert agreed.choice == "yes"
        tail = use(agreed.choice)  # decided in the app, after the group
    assert tail.value.startswith("used(") and "vote_3" in wf.skipped
    assert engine.running() == 0


def _llm(node_id, **extra):
    return {"kind": "llm", "id": node_id,
            "messages": [{"role": "user", "content": [{"text": node_id}]}], **extra}


def test_bad_groups_are_graph_errors_listed_with_the_others():
    schema = {"json_schema": Vote.model_json_schema()}
    graph = Graph.model_validate({"nodes": [
        _llm("a", contract=schema), _llm("b"), {"kind": "input", "id": "i", "value": 1},
        {"kind": "group", "id": "g1", "mode": "quorum", "members": ["a", "b"], "k": 2,
         "agree_on": ["verdict"]},
        {"kind": "group", "id": "g2", "mode": "first", "members": ["a", "i", "zz"]}]})
    with pytest.raises(GraphError) as info:
        validate(graph)
    text = "\n".join(info.value.problems)
    assert "agrees on field 'verdict', which the contract of member 'a' does not have" in text
    assert "member 'b' has no JSON contract" in text
    assert "member 'i' is a input node" in text
    assert "references unknown node 'zz'" in text
    with pytest.raises(ValueError, match="k=3 needs at least 3 members"):
        Graph.model_validate({"nodes": [_llm("a"), _llm("b"), {
            "kind": "group", "id": "g", "mode": "quorum", "members": ["a", "b"], "k": 3}]})
    with workflow("rec", submit=False) as wf:
        a = say("x")
        with pytest.raises(UserError, match="k=0 must be a whole number 1 to 1"):
            wf.quorum(a, k=0)
        with pytest.raises(UserError, match="listed twice"):
            wf.first(a, a)


def test_compiler_counts_early_resolution():
    graph = Graph.model_validate({"nodes": [
        _llm("fast", params={"max_tokens": 10}), _llm("mid", params={"max_tokens": 50}),
        _llm("slow", params={"max_tokens": 2000}),
        {"kind": "group", "id": "g", "mode": "first", "members": ["fast", "mid", "slow"]},
        {"kind": "llm", "id": "after", "messages": [{"role": "user", "content": [
            {"text": "after "}, {"ref": "g"}]}], "params": {"max_tokens": 10}}]})
    report = compile_graph(graph).report
    d = report.decisions
    assert d is not None and d.groups == ["g"]
    assert d.critical_path_ms < d.worst_case_critical_path_ms
    assert report.critical_path_ms == d.critical_path_ms
    assert d.expected_work_ms < d.worst_case_work_ms  # slow is cancelled when fast is in
    assert "groups resolving early: critical path" in format_report(report)


async def test_group_members_still_waiting_for_inputs_are_dropped(aiohttp_client, make_app,
                                                                   engine):
    engine.delay_s, engine.chunk_chars = 0.01, 2
    engine.responder = lambda r: ("y" * 300 if "long" in r.messages[-1].content
                                  else "ok")
    _, client = await _proxy(aiohttp_client, make_app, engine)
    async with workflow("drop", base_url=_base(client)) as wf:
        chained = use(say("long"))  # waits for a slow input
        quick = say("quick")
        wf.first(chained, quick)
    assert chained.step_id in wf.skipped
    prompts = [r.messages[-1].content for r in engine.requests]
    assert not any(p.startswith("use ") for p in prompts)  # never sent
    await asyncio.sleep(0)


async def test_a_tool_member_out_in_the_app_is_cancelled_and_its_late_result_harmless(
        aiohttp_client, make_app, engine):
    from flowlift import tool

    @tool
    async def slow_lookup(x):
        await asyncio.sleep(0.3)
        return f"looked up {x}"

    engine.responder = lambda r: "quick answer"
    _, client = await _proxy(aiohttp_client, make_app, engine)
    async with workflow("tool-member", base_url=_base(client)) as wf:
        looked = slow_lookup("q")
        best = wf.first(looked, say("q"))
    assert best.value == "quick answer" and looked.step_id in wf.skipped
    assert wf.status == "succeeded" and not wf.failures
