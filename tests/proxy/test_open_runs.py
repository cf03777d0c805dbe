"""Open runs (issue 14 part 1): reading a value inside the block ships what was recorded,
waits for that value, and later steps join the same run; the proxy side appends, closes,
prioritises awaited steps and resumes an open run after a restart."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from flowlift import (
    GraphError,
    SemanticVariableError,
    StepFailed,
    UserError,
    Workflow,
    WorkflowFailed,
    step,
    tool,
    workflow,
)
from flowlift.compiler import CompileOptions, compile_graph
from flowlift.costs import CostTracker
from flowlift.errors import RunClosed
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.settings import DispatchSettings
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.state import STATE
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.workflows.open_runs import Growth, grown, stable_plan, stored_graph
from flowlift.proxy.workflows.registry import RunRegistry
from flowlift.proxy.workflows.runs import Run
from flowlift.testing import FakeEngine, free_port, parse_sse, running_proxy


@step(max_tokens=40)
def think(question):
    return f"Think: {question}"


@step(model="no-such-model")
def unserved(x):
    return f"never {x}"


TOOL_CALLS: list[str] = []


@tool
def shout(text: str) -> str:
    TOOL_CALLS.append(text)
    return text.upper()


def _llm(node_id, *parts, **extra):
    content = [p if isinstance(p, dict) else {"text": p} for p in parts]
    return {"kind": "llm", "id": node_id, "messages": [{"role": "user", "content": content}],
            **extra}


def _base(client) -> str:
    return str(client.make_url("")).rstrip("/")


class AsyncSpy(httpx.AsyncBaseTransport):
    """Counts the SDK's requests (method, path, JSON body) on a real socket."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.calls: list[tuple[str, str, object]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.method, request.url.path, body))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def posts(self) -> list[tuple[str, object]]:
        return [(path, body) for method, path, body in self.calls
                if method == "POST" and "/steps/" not in path]


class SyncSpy(httpx.BaseTransport):
    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.calls: list[tuple[str, str, object]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.method, request.url.path, body))
        return self.inner.handle_request(request)

    def posts(self) -> list[tuple[str, object]]:
        return [(path, body) for method, path, body in self.calls
                if method == "POST" and "/steps/" not in path]


# -- the SDK: reads inside the block ---------------------------------------------------
async def test_agent_loop_of_three_dependent_awaits_is_one_run(client, engine):
    app = client.server.app
    seen_done: list[str] = []
    async with workflow("agent", base_url=_base(client)) as wf:
        answer = think("start")
        texts = []
        for _ in range(3):
            text = await answer  # the value, parsed: a plain str here
            run = app[STATE].runs.get(wf.run_id)
            seen_done.append(run.trace.step(answer.step_id).status)
            texts.append(text)
            if "Think" in text:  # plain Python branching on the value
                answer = think(f"again after <{text}>")
    assert wf.status == "succeeded"
    assert seen_done == ["done", "done", "done"], "a value was served before its step ended"
    assert texts[0] == "echo: Think: start"
    assert texts[1] == "echo: Think: again after <echo: Think: start>"
    prompts = [r.messages[-1].content for r in engine.requests]
    assert prompts[1] == "Think: again after <echo: Think: start>"
    steps = [r["step_id"] for r in wf.trace if r["type"] == "step"]
    assert steps == ["think_1", "think_2", "think_3", "think_4"]
    assert {r.session_id for r in engine.requests} == {wf.run_id}  # one run, one session
    assert answer.value.startswith("echo: Think: again after <echo: Think: again")


async def test_one_request_per_flush_and_values_parsed(client):
    spy = AsyncSpy()
    async with workflow("flushes", base_url=_base(client), transport=spy) as wf:
        a, b = think("a"), think("b")
        c = think(b)  # a reference: travels with its producer
        first = await c  # flush 1: the whole graph so far, open
        d, e = think(f"d {first}"), think("e")
        assert await e == "echo: Think: e"  # flush 2: d and e in one request
        assert await a == "echo: Think: a"  # nothing new to ship: no request at all
        f = think("f")  # shipped at the block's end
    assert wf.status == "succeeded" and f.value == "echo: Think: f" and d.ready
    posts = spy.posts()
    paths = [p.removeprefix(f"/v1/workflows/{wf.run_id}") for p, _ in posts]
    assert paths == ["/v1/workflows", "/nodes", "/nodes", "/close"], paths
    start, grow, last = posts[0][1], posts[1][1], posts[2][1]
    assert start["open"] is True and start["awaited"] == ["think_3"]
    assert [n["id"] for n in start["nodes"]] == ["think_1", "think_2", "think_3"]
    assert [n["id"] for n in grow["nodes"]] == ["think_4", "think_5"]
    assert grow["awaited"] == ["think_5"]
    assert [n["id"] for n in last["nodes"]] == ["think_6"] and last["awaited"] == []


async def test_reads_gathered_together_share_one_run(client, engine):
    engine.delay_s = 0.01
    spy = AsyncSpy()
    async with workflow("gather", base_url=_base(client), transport=spy) as wf:
        a, b = think("left"), think("right")
        left, right = await asyncio.gather(a, b)  # two reads at once: one run
        both = think(f"{left} + {right}")
    assert (left, right) == ("echo: Think: left", "echo: Think: right")
    assert both.value == "echo: Think: echo: Think: left + echo: Think: right"
    posts = spy.posts()
    assert [p.rsplit("/", 1)[-1] for p, _ in posts] == ["workflows", "nodes", "nodes", "close"]
    assert posts[1][1] == {"nodes": [], "awaited": ["think_2"]}  # only the second read's mark
    assert wf.status == "succeeded" and len({r.session_id for r in engine.requests}) == 1


async def test_no_read_in_the_block_is_one_post_as_before(client):
    spy = AsyncSpy()
    async with workflow("whole", base_url=_base(client), transport=spy) as wf:
        think(think("x"))
    assert [p for p, _ in spy.posts()] == ["/v1/workflows"]
    assert "open" not in spy.posts()[0][1]  # the wire document of a whole graph, as before
    assert wf.status == "succeeded"


def _sync_loop(base: str, transport: httpx.BaseTransport) -> tuple[object, list[str]]:
    TOOL_CALLS.clear()
    texts = []
    with workflow("sync agent", base_url=base, transport=transport) as wf:
        answer = think("go")
        for _ in range(3):
            text = answer.get()
            texts.append(text)
            loud = shout(text)  # a @tool step in an open run: run by the follower thread
            answer = think(f"{loud} / {len(text)}")
    return wf, texts


async def test_sync_form_with_get_and_a_tool(client):
    spy = SyncSpy()
    wf, texts = await asyncio.to_thread(_sync_loop, _base(client), spy)
    assert wf.status == "succeeded"
    assert texts[0] == "echo: Think: go"
    assert texts[1] == f"echo: Think: ECHO: THINK: GO / {len('echo: Think: go')}"
    assert texts == TOOL_CALLS  # each tool ran once, with the awaited value
    assert len([r for r in wf.trace if r["type"] == "step"]) == 7
    paths = [p.rsplit("/", 1)[-1] for p, _ in spy.posts()]
    assert paths == ["workflows", "nodes", "nodes", "nodes", "close"]


async def test_reads_in_the_wrong_form_say_which_to_use(client):
    base = _base(client)
    async with workflow("a", base_url=base):
        v = think("x")
        with pytest.raises(UserError, match="await var"):
            v.get()
        assert await v == "echo: Think: x"

    def sync() -> None:
        with workflow("s", base_url=base):
            w = think("y")
            with pytest.raises(UserError, match=r"var\.get\(\)"):
                asyncio.run(_await(w))
            assert w.get() == "echo: Think: y"

    await asyncio.to_thread(sync)


async def _await(v):
    return await v


def test_misuse_says_await_it_first():
    with workflow("m", submit=False):
        v = think("x")
        with pytest.raises(SemanticVariableError, match=r"await it \(or `var\.get\(\)`"):
            bool(v)
        with pytest.raises(SemanticVariableError, match="await it"):
            len(v)
        with pytest.raises(UserError, match="submit=False"):
            v.get()
    with pytest.raises(SemanticVariableError, match="not known"):
        v.get()


async def test_rejected_flush_lists_every_problem_and_the_run_goes_on(client):
    with pytest.raises(WorkflowFailed) as failed:
        async with workflow("bad", base_url=_base(client)) as wf:
            first = await think("fine")
            bad = unserved(first)
            again = unserved(bad)
            with pytest.raises(GraphError) as info:
                await again
            assert len(info.value.problems) == 2  # both unknown-model steps named
            run = client.server.app[STATE].runs.get(wf.run_id)
            assert not run.finished and run.outputs == {"think_1": first}
            assert await think("after") == "echo: Think: after"  # the run goes on
    assert set(failed.value.failures) == {"unserved_1", "unserved_2"}
    assert wf.status == "succeeded"  # the run itself: every step it took succeeded
    with pytest.raises(StepFailed, match="rejected by the proxy"):
        _ = bad.value


async def test_a_refused_first_flush_fails_its_steps_and_the_next_read_starts_the_run(client):
    """The first flush is rejected like a later one: its steps fail, the run starts with
    the steps recorded after it, and the block's end raises WorkflowFailed naming them."""
    def sync() -> tuple[Workflow, object, object, pytest.ExceptionInfo[WorkflowFailed]]:
        with pytest.raises(WorkflowFailed) as failed, \
                workflow("late", base_url=_base(client)) as wf:
            a = think("x")
            with pytest.raises(GraphError, match="no-such-model"):
                unserved(f"{a}").get()
            assert wf.run_id is None  # nothing started
            c = think("after")
            assert c.get() == "echo: Think: after"  # the run goes on
        return wf, a, c, failed

    wf, a, c, failed = await asyncio.to_thread(sync)
    assert set(failed.value.failures) == {"think_1", "unserved_1"}  # the refused flush
    assert wf.run_id is not None and wf.status == "succeeded"
    assert c.value == "echo: Think: after"
    with pytest.raises(StepFailed, match="rejected by the proxy"):
        _ = a.value
    run = client.server.app[STATE].runs.get(wf.run_id)
    assert [n.id for n in run.graph.nodes] == ["think_2"]

    with pytest.raises(WorkflowFailed) as afailed:
        async with workflow("late", base_url=_base(client)) as awf:
            with pytest.raises(GraphError):
                await unserved("y")
            assert await think("then") == "echo: Think: then"
    assert set(afailed.value.failures) == {"unserved_1"} and awf.run_id is not None


async def test_a_block_whose_every_step_is_refused_raises_graph_error(client):
    runs = client.server.app[STATE].runs
    with pytest.raises(GraphError, match="no-such-model"):
        async with workflow("void", base_url=_base(client)) as wf:
            with pytest.raises(GraphError):
                await unserved("y")
    assert wf.run_id is None and not runs.active

    def sync() -> Workflow:
        with pytest.raises(GraphError, match="no-such-model"), \
                workflow("void", base_url=_base(client)) as swf:
            with pytest.raises(GraphError):
                unserved("z").get()
            with pytest.raises(GraphError):
                unserved("w").get()  # the next read is refused again: still no run
        return swf

    swf = await asyncio.to_thread(sync)
    assert swf.run_id is None and not runs.active


async def test_a_block_that_raises_cancels_its_open_run(client, engine):
    engine.delay_s = 0.02
    runs = client.server.app[STATE].runs
    with pytest.raises(KeyError):
        async with workflow("oops", base_url=_base(client)) as wf:
            await think("x")
            think("a long answer that is still being written")
            await asyncio.sleep(0)
            raise KeyError("the app's own bug")
    run = runs.get(wf.run_id)
    await asyncio.wait_for(asyncio.wait([run.task]), 10)
    assert run.trace.status == "cancelled" and wf.status in ("cancelled", "abandoned")

    def sync() -> Workflow:
        with pytest.raises(KeyError), workflow("oops", base_url=_base(client)) as swf:
            think("y").get()
            raise KeyError("again")
        return swf

    swf = await asyncio.to_thread(sync)
    run = runs.get(swf.run_id)
    await asyncio.wait_for(asyncio.wait([run.task]), 10)
    assert run.trace.status == "cancelled"


# -- the wire: append, validate, close ------------------------------------------------
async def test_append_validates_against_the_run_and_close_finishes_it(client, engine):
    engine.delay_s = 0.02
    resp = await client.post("/v1/workflows", json={"open": True, "nodes": [
        _llm("a", "slow first step with a longer answer")]})
    assert resp.status == 200
    events_task = asyncio.ensure_future(resp.text())
    await asyncio.sleep(0.05)
    runs = client.server.app[STATE].runs
    (run_id,) = runs.active
    bad = await client.post(f"/v1/workflows/{run_id}/nodes", json={"nodes": [
        _llm("a", "duplicate id"),
        _llm("b", "reads ", {"ref": "ghost"}),
        _llm("c", {"ref": "d"}), _llm("d", {"ref": "c"}),
        _llm("e", "x", model="no-such-model")]})
    assert bad.status == 400
    problems = (await bad.json())["error"]["problems"]
    assert len(problems) == 4, problems
    for words in ("duplicate node id 'a'", "unknown node 'ghost'", "dependency cycle",
                  "unknown model 'no-such-model'"):
        assert any(words in p for p in problems), (words, problems)
    assert [n.id for n in runs.get(run_id).graph.nodes] == ["a"]  # nothing appended
    ok = await client.post(f"/v1/workflows/{run_id}/nodes", json={
        "nodes": [_llm("b", "after ", {"ref": "a"})], "awaited": ["b"]})
    assert ok.status == 200 and (await ok.json())["appended"] == ["b"]
    again = await client.post(f"/v1/workflows/{run_id}/nodes", json={
        "nodes": [_llm("b", "after ", {"ref": "a"})]})  # a re-sent flush: skipped
    assert (await again.json())["appended"] == []
    status = await (await client.get(f"/v1/workflows/{run_id}")).json()
    assert status["open"] is True and status["report"]["open"] is True
    assert status["report"]["steps"] == 2
    while "b" not in runs.get(run_id).outputs:
        await asyncio.sleep(0.01)
    assert not events_task.done() and runs.get(run_id).trace.status == "running"
    closed = await client.post(f"/v1/workflows/{run_id}/close")
    assert closed.status == 200
    events = parse_sse(await events_task)
    names = [e for e, _ in events]
    assert names[-1] == "run.finished" and events[-1][1]["status"] == "succeeded"
    assert names.count("nodes.appended") == 1 and "run.closed" in names
    assert "problems" not in json.dumps(events)  # the rejected append left no trace
    late = await client.post(f"/v1/workflows/{run_id}/nodes", json={"nodes": [_llm("z", "z")]})
    assert late.status == 409 and (await late.json())["error"]["code"] == "run_closed"
    assert (await client.post(f"/v1/workflows/{run_id}/close")).status == 200  # no-op
    status = await (await client.get(f"/v1/workflows/{run_id}")).json()
    assert status["open"] is False and status["report"]["open"] is False


async def test_a_whole_graph_takes_no_appends_and_unknown_runs_are_404(client):
    events = parse_sse(await (await client.post("/v1/workflows", json={
        "nodes": [_llm("a", "x")]})).text())
    run_id = events[0][1]["run_id"]
    resp = await client.post(f"/v1/workflows/{run_id}/nodes", json={"nodes": [_llm("b", "y")]})
    assert resp.status == 409 and "submitted whole" in (await resp.json())["error"]["message"]
    for route in ("nodes", "close"):
        resp = await client.post(f"/v1/workflows/wf-nope/{route}", json={"nodes": []})
        error = (await resp.json())["error"]
        assert resp.status == 404 and error["code"] == "run_not_found", error
        assert error["param"] == "run_id"


async def test_an_open_run_left_by_its_client_is_swept():
    registry = RunRegistry(RunStore(":memory:"), detached_timeout_s=0.0)
    graph = Graph.model_validate({"open": True, "nodes": [_llm("a", "hi")]})
    backends = Backends({"m": FakeEngine(["m"])})
    run = await registry.start(graph, backends, CostTracker(),
                         compile_graph(graph, CompileOptions(default_model="m")))
    while "a" not in run.outputs:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert not run.finished, "an open run finished before it was closed"
    await registry.sweep()
    await registry.sweep()
    await asyncio.wait([run.task])
    assert run.trace.status == "cancelled"
    with pytest.raises(RunClosed):
        run.append([], None, ())


# -- scheduling: the awaited step goes first -------------------------------------------
async def _started_order(workflow_class: str, awaited_with_append: bool) -> list[str]:
    engine = FakeEngine(["m"], delay_s=0.01)
    backends = Backends({"m": engine}, DispatchSettings(max_concurrency=1))
    opts = CompileOptions(default_model="m")
    graph = Graph.model_validate({"class": workflow_class, "open": True, "nodes": [
        _llm("head", "the head step runs first and holds the only slot for a while")]})
    run = Run(graph, backends, compile_graph(graph, opts))
    task = run.start()
    while not engine.requests:
        await asyncio.sleep(0.001)
    siblings = [Graph.model_validate({"nodes": [n]}).nodes[0] for n in (
        _llm("s1", "alpha asks a rather long question about many things at once"),
        _llm("s2", "bravo asks a question about some other things"),
        _llm("s3", "charlie: short"))]
    bigger = grown(run.graph, siblings)
    if awaited_with_append:
        run.append(siblings, compile_graph(bigger, opts), ["s3"])
    else:
        run.append(siblings, compile_graph(bigger, opts))
        await asyncio.sleep(0.02)  # all three queue behind the head
        run.mark_awaited(["s3"])
    run.close_input()
    await task
    assert run.trace.status == "succeeded"
    return [r.request_id.split(":")[1] for r in engine.requests]


@pytest.mark.parametrize("workflow_class", ["interactive", "batch"])
@pytest.mark.parametrize("awaited_with_append", [True, False])
async def test_awaited_step_is_dispatched_before_earlier_queued_siblings(
        workflow_class, awaited_with_append):
    order = await _started_order(workflow_class, awaited_with_append)
    assert order[0] == "head"
    assert order[1] == "s3", order


# -- durability: a restarted proxy resumes an open run --------------------------------
def _serve(port: int, db: Path, log: Path):  # type: ignore[no-untyped-def]
    return running_proxy("--engine", "fake", "--state-db", str(db), "--fake-delay-s", "0.05",
                         log_path=log, port=port, ready_timeout_s=60)


def test_restart_with_an_open_run_resumes_and_keeps_appending(tmp_path):
    port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
    wf = workflow("durable open", base_url=f"http://127.0.0.1:{port}", reconnect_s=60)
    flushed, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    values: list[str] = []

    def app() -> None:
        try:
            with wf:
                first = think("alpha").get()
                b = think(f"beta after {first}")
                c = think(b)
                values.append(b.get())  # flush 2: b and c appended; c still running
                flushed.set()
                go.wait(60)
                d = think(c)  # appended to the resumed run
                values.append(d.get())
                think(f"end {values[-1][:20]}")  # shipped at exit, then closed
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=app)
    with _serve(port, db, log) as (_, proc):
        thread.start()
        assert flushed.wait(60), "the open run did not get going"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    run_id = wf.run_id
    stored = RunStore(db).load(run_id)
    assert stored.status == "running" and "run.closed" not in [n for _, n, _ in stored.events]
    assert "think_3" not in stored.outputs(), "killed too late: nothing was left running"
    with _serve(port, db, log):
        go.set()
        thread.join(timeout=90)
    assert not thread.is_alive() and not errors, errors
    assert wf.status == "succeeded" and wf.run_id == run_id
    assert len(wf._outputs) == 5
    stored = RunStore(db).load(run_id)
    names = [n for _, n, _ in stored.events]
    assert names.count("run.resumed") == 1 and names.count("run.closed") == 1
    appended = [n["id"] for _, name, d in stored.events if name == "nodes.appended"
                for n in d["nodes"]]
    assert appended == ["think_2", "think_3", "think_4", "think_5"]
    finished = [d["step_id"] for _, n, d in stored.events if n == "step.finished"]
    assert sorted(set(finished)) == [f"think_{i}" for i in range(1, 6)]
    assert stored.status == "succeeded"
    assert len([r for r in wf.trace if r["type"] == "step"]) == 5


def test_report_of_an_open_graph_is_marked_open():
    graph = Graph.model_validate({"open": True, "nodes": [_llm("a", "x")]})
    assert compile_graph(graph, CompileOptions(default_model="m")).report.open is True
    closed = Graph.model_validate({"nodes": [_llm("a", "x")]})
    assert compile_graph(closed, CompileOptions(default_model="m")).report.open is False


def test_an_awaited_step_drags_what_it_waits_for_onto_the_critical_path():
    growth = Growth(True)
    deps = {"a": frozenset(), "b": frozenset({"a"}), "c": frozenset({"b"}),
            "lead": frozenset(), "x": frozenset()}
    marked = growth.blocking(["c"], deps, finished=lambda s: s == "a",
                             warmer=lambda s: "lead" if s == "c" else None)
    assert sorted(marked) == ["b", "c", "lead"]  # not the finished input, not a bystander
    assert growth.blocking(["c"], deps, lambda s: False, lambda s: None) == []
    base = Priority.of("batch", remaining_ms=5.0)
    assert growth.priority("c", base) < Priority.of("interactive", remaining_ms=1e6)
    assert growth.priority("x", base) == base


def test_a_resumed_open_run_is_rebuilt_from_its_log():
    store = RunStore(":memory:")
    store.create("wf-grow", {"open": True, "nodes": [_llm("a", "x")]})
    store.append("wf-grow", 1, "run.started", {"run_id": "wf-grow"})
    store.append("wf-grow", 2, "nodes.appended", {"nodes": [_llm("b", {"ref": "a"})],
                                                  "awaited": ["b"]})
    stored = store.load("wf-grow")
    graph = stored_graph(stored)
    assert [n.id for n in graph.nodes] == ["a", "b"] and graph.open
    growth = Growth(graph.open, stored.events)
    assert not growth.closed and growth.awaited == {"b"}
    store.append("wf-grow", 3, "run.closed", {"steps": 2})
    assert Growth(True, store.load("wf-grow").events).closed


def test_prefix_groups_keep_their_numbers_when_the_plan_is_recompiled():
    plan = compile_graph(Graph.model_validate({"nodes": [_llm("p1", "x")]}),
                         CompileOptions(default_model="m"))
    old = dataclasses.replace(plan, prefix_group={"p1": 0, "p2": 0}, group_leader={0: "p1"})
    recompiled = dataclasses.replace(  # the compiler numbers groups afresh each time
        plan, prefix_group={"q1": 0, "q2": 0, "p1": 1, "p2": 1, "p3": 1},
        group_leader={0: "q1", 1: "p1"})
    new = stable_plan(old, recompiled)
    assert new.prefix_group["p1"] == new.prefix_group["p3"] == 0  # as before
    assert new.prefix_group["q1"] == new.prefix_group["q2"] == 1  # a fresh number
    assert new.group_leader == {0: "p1", 1: "q1"}
