"""The proxy on a PostgreSQL state database (``--state-db postgresql://...``): the flag,
the runs and the learned outcomes in the database (a real server: tests/pg.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowlift.cli import build_parser, serve_flags
from flowlift.errors import EngineError, LeaseLost
from flowlift.proxy import ProxyConfig
from flowlift.proxy.state import STATE
from flowlift.proxy.store.location import open_store
from flowlift.proxy.store.outcomes import StepOutcomes
from flowlift.proxy.store.postgres import PostgresRunStore
from flowlift.proxy.store.sqlite import SQLiteRunStore
from flowlift.testing import parse_sse


def llm(node_id: str, text: str) -> dict[str, object]:
    return {"kind": "llm", "id": node_id, "model": "fake-model",
            "messages": [{"role": "user", "content": [{"text": text}]}]}


def test_state_db_url_stays_a_url_and_other_schemes_are_refused(tmp_path: Path) -> None:
    url = "postgresql://flowlift:pw@db.example:5432/runs"
    args = build_parser().parse_args(["serve", "--state-db", url])
    assert serve_flags(args)["state_path"] == url  # not Path(url): that folds the //
    args = build_parser().parse_args(["serve", "--state-db", str(tmp_path / "s.db")])
    assert serve_flags(args)["state_path"] == tmp_path / "s.db"
    with pytest.raises(EngineError, match="postgresql://"):
        open_store("mysql://h/db")
    assert isinstance(open_store(tmp_path / "s.db"), SQLiteRunStore)


@pytest.mark.parametrize("ttl", ["0", "0.2", "-1", "nan", "inf", "soon"])
def test_a_lease_shorter_than_a_second_is_refused_by_name(
        ttl: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lease-ttl-s", ttl])
    assert "--lease-ttl-s: must be a number of seconds >= 1" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--lease-ttl-s", "1.5"])
    assert serve_flags(args)["lease_ttl_s"] == 1.5


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_outcomes_persist_and_two_proxies_add_up(kind: str, tmp_path: Path,
                                                 request: pytest.FixtureRequest) -> None:
    where = (str(tmp_path / "state.sqlite") if kind == "sqlite"
             else request.getfixturevalue("pg_url"))
    first, second = StepOutcomes(where), StepOutcomes(where)
    first.record("extract", "small", accepted=True, attempts=1)
    second.record("extract", "small", accepted=False, attempts=3)
    first.record_output("extract", "small", 40)
    first.record_output("extract", "small", 60)
    first.close()
    second.close()
    again = StepOutcomes(where)
    counts = again.counts("extract", "small")
    assert (counts.items, counts.failures, counts.attempts) == (2, 1, 4)
    lengths = again.lengths("extract", "small")
    assert lengths is not None and lengths.p50 == 50.0
    assert again.counts("extract", None).items == 0
    again.close()


def test_proxies_starting_together_on_a_new_database_all_open_their_outcome_store(
        pg_url: str) -> None:
    """Replicas of a gateway start at once: ``CREATE TABLE IF NOT EXISTS`` is not atomic
    on PostgreSQL, so without the schema lock some of them failed to start."""
    from concurrent.futures import ThreadPoolExecutor

    for _ in range(3):  # the race was lost in 4 of 5 tries of 4 at once
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS flowlift_step_outcomes, "
                         "flowlift_step_output_tokens")
        with ThreadPoolExecutor(6) as pool:
            stores = list(pool.map(lambda _: StepOutcomes(pg_url), range(6)))
        for store in stores:
            store.close()


def test_serve_on_an_unreachable_database_exits_2_with_one_line() -> None:
    import subprocess
    import sys

    from flowlift.testing import free_port

    done = subprocess.run(
        [sys.executable, "-m", "flowlift.cli", "serve", "--engine", "fake", "--port",
         str(free_port()), "--state-db", "postgresql://flowlift:s3cret@127.0.0.1:1/runs"],
        capture_output=True, text=True, timeout=120)
    err = done.stderr
    assert done.returncode == 2, err
    assert "cannot open the run store postgresql://flowlift@127.0.0.1:1/runs" in err
    assert "s3cret" not in err and "Traceback" not in err


def test_an_unreachable_outcome_database_is_an_engine_error() -> None:
    with pytest.raises(EngineError) as caught:
        StepOutcomes("postgresql://u:s3cret@127.0.0.1:1/db")
    assert "s3cret" not in str(caught.value)


async def test_a_proxy_on_postgres_keeps_its_runs_in_the_database(
        aiohttp_client, make_app, pg_url: str) -> None:
    app = make_app(ProxyConfig(state_path=pg_url))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    assert isinstance(app[STATE].runs.store, PostgresRunStore)
    resp = await client.post("/v1/workflows", json={
        "name": "pg", "id": "wf-pg-1", "nodes": [llm("a", "hello"), llm("b", "world")]})
    events = parse_sse(await resp.text())
    assert events[-1][0] == "run.finished" and events[-1][1]["status"] == "succeeded"
    listed = await (await client.get("/v1/workflows", params={"name": "pg"})).json()
    assert [r["id"] for r in listed["data"]] == ["wf-pg-1"]
    await client.close()  # the app's cleanup closes the store and the outcomes

    store = open_store(pg_url)  # what another proxy on the database sees
    stored = store.load("wf-pg-1")
    assert stored is not None and stored.status == "succeeded"
    assert stored.outputs() == {"a": "echo: hello", "b": "echo: world"}
    store.close()
    outcomes = StepOutcomes(pg_url, default_model="fake-model")
    assert outcomes.counts("a", "fake-model").items == 1  # learned in the database
    outcomes.close()


# -- two proxies on one database: one dies mid-run, the other takes its runs over -------

RUNS = 50


def chain(i: int) -> dict[str, object]:
    """Three dependent steps (each about 1.8-3.6 s on proxy A's fake engine at 0.3 s a chunk).

    Slow enough that a loaded CI machine still kills A with half the runs unfinished: at
    0.1 s a chunk, all three steps of every run had finished (CI stop 39) before the test
    saw every first step stored and slept its 0.5 s.
    """
    ref = {"kind": "llm", "model": "fake-model"}
    return {"name": "takeover", "id": f"wf-t-{i}", "nodes": [
        llm("s0", f"run {i} begins"),
        {**ref, "id": "s1", "messages": [{"role": "user", "content": [{"ref": "s0"}]}]},
        {**ref, "id": "s2", "messages": [{"role": "user", "content": [{"ref": "s1"}]}]}]}


def _finished_steps(store: PostgresRunStore) -> dict[str, set[str]]:
    out = {}
    for i in range(RUNS):
        stored = store.load(f"wf-t-{i}")
        out[f"wf-t-{i}"] = set() if stored is None else set(stored.outputs())
    return out


async def _submit(base: str, i: int) -> None:
    """POST a run to proxy A and follow it until A dies (the stream breaks then)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=60) as http, http.stream(
                "POST", f"{base}/v1/workflows", json=chain(i)) as resp:
            async for _ in resp.aiter_bytes():
                pass
    except httpx.HTTPError:
        return


async def _wait_for(check, timeout_s: float, what: str) -> None:
    import asyncio
    import time

    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, what
        await asyncio.sleep(0.05)


async def test_a_killed_proxys_runs_finish_on_the_other_without_rerunning_steps(
        aiohttp_client, pg_url: str, tmp_path: Path) -> None:
    import asyncio

    from flowlift.proxy import create_app
    from flowlift.testing import FakeEngine, running_proxy

    engine_b = FakeEngine(["fake-model"], delay_s=0.02)
    app_b = create_app({"fake-model": engine_b},
                       ProxyConfig(state_path=pg_url, lease_ttl_s=1.0))
    client_b = await aiohttp_client(app_b)
    await app_b[STATE].ready.wait()
    reader = PostgresRunStore(pg_url)
    with running_proxy("--engine", "fake", "--fake-delay-s", "0.3", "--state-db", pg_url,
                       "--max-concurrency", "64",
                       "--lease-ttl-s", "1", "--log-level", "warning",
                       log_path=tmp_path / "proxy-a.log", ready_timeout_s=60) as (base, proc):
        clients = [asyncio.create_task(_submit(base, i)) for i in range(RUNS)]
        await _wait_for(lambda: all(len(s) >= 1 for s in _finished_steps(reader).values()),
                        30, "proxy A did not finish a first step of every run")
        await asyncio.sleep(0.5)  # B beats at least once while A is alive...
        assert not app_b[STATE].runs.active and not engine_b.requests  # ...and steals none
        proc.kill()  # kill -9: no suspend, no lease released, nothing more written
        proc.wait(timeout=10)
    await asyncio.gather(*clients)
    done_on_a = _finished_steps(reader)
    unfinished = [rid for rid, steps in done_on_a.items() if len(steps) < 3]
    assert len(unfinished) >= RUNS // 2, f"A finished too much before the kill: {done_on_a}"

    runs_b = app_b[STATE].runs
    await _wait_for(lambda: set(unfinished) <= set(runs_b.active), 10,
                    "proxy B did not take the runs over after A's leases expired")

    async def reconnect(rid: str) -> None:  # a client back, on B: a parked run resumes
        events = parse_sse(await (await client_b.get(f"/v1/workflows/{rid}/events")).text())
        assert events[-1][0] == "run.finished", rid
        assert events[-1][1]["status"] == "succeeded", (rid, events[-1])

    await asyncio.gather(*(reconnect(rid) for rid in done_on_a))

    asked = [r.request_id.rsplit(":", 2)[:2] for r in engine_b.requests]
    assert sorted({rid for rid, _ in asked}) == sorted(unfinished)
    assert len(asked) == len({tuple(a) for a in asked}), "B ran a step twice"
    for rid, step in asked:
        assert step not in done_on_a[rid], f"{rid}:{step} finished on A and ran again on B"
    for rid in done_on_a:
        stored = reader.load(rid)
        assert stored is not None and stored.status == "succeeded"
        assert set(stored.outputs()) == {"s0", "s1", "s2"}
        finished = [d["step_id"] for _, n, d in stored.events if n == "step.finished"]
        assert len(finished) == len(set(finished)) == 3, (rid, finished)
    reader.close()


async def test_heartbeats_hand_a_run_over_and_the_loser_stops_it(pg_url: str) -> None:
    import asyncio

    from flowlift.costs import CostTracker
    from flowlift.graph import Graph
    from flowlift.proxy.dispatch.backends import Backends
    from flowlift.proxy.workflows.planning import plan
    from flowlift.proxy.workflows.registry import RunRegistry
    from flowlift.testing import FakeEngine

    graph = Graph.model_validate({"id": "wf-h", "nodes": [
        {"kind": "llm", "id": "a", "messages": [{"role": "user", "content": [
            {"text": "a long prompt " * 20}]}]}]})
    stores = [PostgresRunStore(pg_url), PostgresRunStore(pg_url)]
    backends = [Backends({"m": FakeEngine(["m"], delay_s=0.2)}) for _ in stores]
    reg_a, reg_b = (RunRegistry(s, lease_ttl_s=0.5) for s in stores)
    costs = CostTracker()
    run_a = await reg_a.start(graph, backends[0], costs, plan(graph, backends[0], costs))
    assert await reg_b.heartbeat(backends[1], costs) == []  # A's lease is alive
    assert await reg_a.heartbeat(backends[0], costs) == [] and "wf-h" in reg_a.active  # renewed
    await asyncio.sleep(0.8)  # A misses its beats (a stalled event loop): the lease expires
    (run_b,) = await reg_b.heartbeat(backends[1], costs)
    assert run_b.run_id == "wf-h" and "wf-h" in reg_b.active
    assert await reg_a.heartbeat(backends[0], costs) == []  # A learns it lost the run...
    await asyncio.wait([run_a.task], timeout=5)
    assert "wf-h" not in reg_a.active and run_a.task.done()  # ...and stops it
    assert stores[0].load("wf-h").status == "running"  # type: ignore[union-attr]
    assert not stores[0].claim("wf-h", reg_a.owner, 30)  # B holds it
    run_b.suspend()  # B shuts down cleanly: the lease is released as the run stops
    await asyncio.wait([run_b.task], timeout=5)
    await reg_b.io.flush()  # (the release lands on B's store worker after the run ends)
    (again,) = await reg_a.resume_all(backends[0], costs)  # at once, no expiry to wait for
    assert again.run_id == "wf-h"
    again.cancel()
    await asyncio.wait([again.task], timeout=5)
    for store in stores:
        store.close()


async def test_a_proxy_that_wakes_up_after_losing_its_lease_writes_nothing(
        pg_url: str) -> None:
    """A stalls past its lease (it never beats) while B takes the run over; when A's step
    finishes, the store refuses A's event (fenced by the lease epoch): A stops the run,
    its followers' streams end, and the step's only output is B's."""
    import asyncio

    from flowlift.costs import CostTracker
    from flowlift.graph import Graph
    from flowlift.proxy.dispatch.backends import Backends
    from flowlift.proxy.workflows.planning import plan
    from flowlift.proxy.workflows.registry import RunRegistry
    from flowlift.testing import FakeEngine

    graph = Graph.model_validate({"id": "wf-f", "nodes": [
        {"kind": "llm", "id": "a", "model": "m", "messages": [{"role": "user", "content": [
            {"text": "slow words " * 8}]}]}]})
    stores = [PostgresRunStore(pg_url), PostgresRunStore(pg_url)]
    engines = [FakeEngine(["m"], delay_s=0.1), FakeEngine(["m"], delay_s=0.01)]
    backends = [Backends({"m": engine}) for engine in engines]
    reg_a, reg_b = (RunRegistry(s, lease_ttl_s=0.3) for s in stores)
    costs = CostTracker()
    run_a = await reg_a.start(graph, backends[0], costs, plan(graph, backends[0], costs))
    follower = run_a.log.follow(0)
    assert (await anext(follower))[1] == "run.started"
    await asyncio.sleep(0.5)  # A's step still runs; its lease expired unrenewed
    assert not run_a.task.done()  # type: ignore[union-attr]
    (run_b,) = await reg_b.heartbeat(backends[1], costs)  # B takes the run over (parked)
    await asyncio.wait([run_a.task], timeout=10)  # type: ignore[list-item]
    assert run_a.task.done() and "wf-f" not in reg_a.active  # type: ignore[union-attr]
    assert [e[1] async for e in follower] == ["step.prompt"]  # what it had; then it ends
    stored = stores[1].load("wf-f")
    assert stored is not None and stored.outputs() == {} and stored.status == "running"
    assert [n for _, n, _ in stored.events] == ["run.started", "step.prompt"]
    run_b.log.listened.set()  # a client follows the run on B: it runs there
    await asyncio.wait([run_b.task], timeout=10)  # type: ignore[list-item]
    await reg_b.io.flush()  # (B's last writes land after its run's task ends)
    done = stores[0].load("wf-f")
    assert done is not None and done.status == "succeeded"
    finished = [d for _, n, d in done.events if n == "step.finished"]
    assert len(finished) == 1 and len(engines[1].requests) == 1
    for store in stores:
        store.close()


async def _replica(aiohttp_client, pg_url: str):  # type: ignore[no-untyped-def]
    """A proxy on the database (in this process): its app, test client and engine."""
    from flowlift.proxy import create_app
    from flowlift.testing import FakeEngine

    engine = FakeEngine(["fake-model"], delay_s=0.01)
    app = create_app({"fake-model": engine}, ProxyConfig(state_path=pg_url, lease_ttl_s=1.0))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return app, client, engine


async def _events(client, run_id: str, after: int = 0):  # type: ignore[no-untyped-def]
    """The run's event stream read to its end (from the event after ``after``)."""
    resp = await client.get(f"/v1/workflows/{run_id}/events", params={"after": str(after)})
    return parse_sse(await resp.text())


async def test_a_replica_that_does_not_run_a_run_streams_it_and_takes_its_tool_results(
        aiohttp_client, pg_url: str) -> None:
    import asyncio

    (_, b, _), (app_c, c, engine_c) = [await _replica(aiohttp_client, pg_url)
                                       for _ in range(2)]
    graph = {"name": "across", "id": "wf-x", "nodes": [
        llm("a", "hi"), {"kind": "tool", "id": "t", "name": "look", "args": [{"ref": "a"}]},
        {"kind": "llm", "model": "fake-model", "id": "b",
         "messages": [{"role": "user", "content": [{"ref": "t"}]}]}]}
    resp = await b.post("/v1/workflows", json=graph)  # B executes the run
    async for line in resp.content:
        if line.startswith(b"event: tool.wanted"):
            break
    resp.close()  # the client lost B; it comes back through C
    follow = asyncio.create_task(_events(c, "wf-x", after=1))
    posted = await c.post("/v1/workflows/wf-x/steps/t/result", json={"value": "found"})
    assert posted.status == 202 and (await posted.json())["outcome"] == "queued"
    again = await c.post("/v1/workflows/wf-x/steps/t/result", json={"value": "other"})
    assert again.status == 200 and (await again.json())["outcome"] == "duplicate"
    events = await asyncio.wait_for(follow, 10)
    assert events[0][0] == "step.prompt"  # from the event after 1 (run.started) on
    assert events[-1][0] == "run.finished" and events[-1][1]["status"] == "succeeded"
    finished = {d["step_id"]: d["value"] for n, d in events if n == "step.finished"}
    assert finished == {"a": "echo: hi", "t": "found", "b": "echo: found"}  # the first post
    assert "wf-x" not in app_c[STATE].runs.active and not engine_c.requests  # C ran none
    for replica in (b, c):  # after the end: a no-op wherever it lands
        late = await replica.post("/v1/workflows/wf-x/steps/t/result", json={"value": 1})
        assert (await late.json())["outcome"] == "duplicate"
    bad = await c.post("/v1/workflows/wf-x/steps/nope/result", json={"value": 1})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "step_id"
    for step_id, why in (("a", "not a @tool step"), ("nope", "no such step")):
        for replica in (b, c):  # the owner and the other say the same: a model step is no tool
            refused = await replica.post(f"/v1/workflows/wf-x/steps/{step_id}/result",
                                         json={"value": "x"})
            error = (await refused.json())["error"]
            assert refused.status == 400 and error["param"] == "step_id", error
            assert why in error["message"]


async def test_a_replica_refuses_a_result_for_a_model_step_as_the_owner_does(
        aiohttp_client, pg_url: str) -> None:
    (_, a, _), (_, b, _) = [await _replica(aiohttp_client, pg_url) for _ in range(2)]
    graph = {"name": "ask", "id": "wf-m", "nodes": [
        llm("ask_1", "hi"), {"kind": "tool", "id": "t", "name": "look", "args": [{"ref": "ask_1"}]},
        {"kind": "llm", "model": "fake-model", "id": "ask_2",
         "messages": [{"role": "user", "content": [{"ref": "t"}]}]}]}
    resp = await a.post("/v1/workflows", json=graph)  # A executes the run; t waits
    async for line in resp.content:
        if line.startswith(b"event: tool.wanted"):
            break
    answers = [await r.post("/v1/workflows/wf-m/steps/ask_2/result", json={"value": "x"})
               for r in (a, b)]
    bodies = [await r.json() for r in answers]
    assert [r.status for r in answers] == [400, 400], bodies
    assert bodies[0]["error"] == bodies[1]["error"]
    assert "not a @tool step" in bodies[1]["error"]["message"]
    await b.delete("/v1/workflows/wf-m")  # cancelled through B; A stops it
    resp.close()


async def test_a_run_taken_over_starts_when_its_client_follows_it_through_another_replica(
        aiohttp_client, pg_url: str) -> None:
    """B takes over a dead proxy's run and parks it (nobody listens on B); the client
    follows it through C: C marks the follow in the store, B's heartbeat sees it and
    starts the run, and C streams it to its end."""
    import asyncio

    from flowlift.graph import Graph

    seed = PostgresRunStore(pg_url)
    seed.create("wf-p", Graph.model_validate({"id": "wf-p", "name": "parked", "nodes": [
        llm("a", "one"), llm("b", "two")]}).to_wire())
    assert seed.claim("wf-p", "a-dead-proxy", ttl_s=0.05)
    await asyncio.sleep(0.1)  # its proxy is dead: the lease expires unrenewed
    app_b, _, engine_b = await _replica(aiohttp_client, pg_url)
    assert "wf-p" in app_b[STATE].runs.active  # taken over as B started...
    _, c, engine_c = await _replica(aiohttp_client, pg_url)
    await asyncio.sleep(0.8)  # ...and parked: B beats twice, nobody listens there
    assert not engine_b.requests and "wf-p" not in app_b[STATE].runs.finished
    events = await asyncio.wait_for(_events(c, "wf-p"), 10)
    assert events[0][0] == "run.resumed" and events[-1][1]["status"] == "succeeded"
    assert len(engine_b.requests) == 2 and not engine_c.requests
    seed.close()


async def test_an_open_run_grows_and_closes_through_a_replica_that_does_not_run_it(
        aiohttp_client, pg_url: str) -> None:
    import asyncio

    (_, b, _), (app_c, c, engine_c) = [await _replica(aiohttp_client, pg_url)
                                       for _ in range(2)]
    resp = await b.post("/v1/workflows", json={"name": "grows", "id": "wf-o", "open": True,
                                               "nodes": [llm("a", "one")]})
    async for line in resp.content:  # B runs it; the client follows it through C
        if line.startswith(b"event: step.finished"):
            break
    resp.close()
    follow = asyncio.create_task(_events(c, "wf-o"))
    more = {"nodes": [{"kind": "llm", "model": "fake-model", "id": "b", "messages": [
        {"role": "user", "content": [{"ref": "a"}]}]}], "awaited": ["b"]}
    grown = await c.post("/v1/workflows/wf-o/nodes", json=more)
    assert grown.status == 202
    assert await grown.json() == {"run_id": "wf-o", "appended": ["b"], "steps": 2,
                                  "queued": True}
    after = {"nodes": [llm("c", "three"), {"kind": "llm", "model": "fake-model", "id": "d",
             "messages": [{"role": "user", "content": [{"ref": "b"}]}]}]}  # b: queued
    assert (await (await c.post("/v1/workflows/wf-o/nodes", json=after)).json())[
        "appended"] == ["c", "d"]
    bad = await c.post("/v1/workflows/wf-o/nodes", json={"nodes": [llm("a", "again")]})
    assert bad.status == 400 and "a" in str((await bad.json())["error"])  # a duplicate id
    closed = await c.post("/v1/workflows/wf-o/close", json={})
    assert closed.status == 202 and (await closed.json())["closed"] is True
    events = await asyncio.wait_for(follow, 10)
    assert events[-1][0] == "run.finished" and events[-1][1]["status"] == "succeeded"
    finished = {d["step_id"]: d["value"] for n, d in events if n == "step.finished"}
    assert finished == {"a": "echo: one", "b": "echo: echo: one", "c": "echo: three",
                        "d": "echo: echo: echo: one"}
    assert not engine_c.requests and "wf-o" not in app_c[STATE].runs.active
    late = await c.post("/v1/workflows/wf-o/nodes", json={"nodes": [llm("e", "x")]})
    assert late.status == 409  # finished: takes no more steps
    assert (await (await c.delete("/v1/workflows/wf-o")).json())["cancelled"] is False
    reader = PostgresRunStore(pg_url)
    assert reader.requests(["wf-o"]) == []  # carried out and dropped
    reader.close()


@pytest.mark.parametrize("form", ["async", "sync"])
async def test_an_sdk_open_run_moves_to_another_replica_when_its_proxy_dies(
        form: str, aiohttp_client, pg_url: str, tmp_path: Path) -> None:
    """``await var`` (``var.get()``) in an open run on proxy A, then ``kill -9`` of A: the
    SDK follows the run to B (``base_url=[A, B]``), its next append goes there, and B
    (once A's lease expired) takes the run over and runs it to the end."""
    import asyncio

    from flowlift import step, workflow
    from flowlift.testing import running_proxy

    @step(model="fake-model")
    def say(text: str) -> str:
        return f"say {text}"

    app_b, b, engine_b = await _replica(aiohttp_client, pg_url)
    base_b = str(b.make_url("")).rstrip("/")
    with running_proxy("--engine", "fake", "--state-db", pg_url, "--lease-ttl-s", "1",
                       "--log-level", "warning", log_path=tmp_path / "proxy-a.log",
                       ready_timeout_s=60) as (base_a, proc):

        def kill_a() -> None:
            proc.kill()  # kill -9
            proc.wait(timeout=10)

        if form == "async":
            async with workflow("moves", base_url=[base_a, base_b], reconnect_s=30) as wf:
                first = await say("one")
                assert first == "echo: say one" and wf.base_url == base_a
                kill_a()
                second = say(first)
                assert await asyncio.wait_for(second, 20) == "echo: say echo: say one"
        else:
            def app() -> tuple[Any, Any]:
                with workflow("moves", base_url=[base_a, base_b], reconnect_s=20) as wf:
                    first = say("one").get()
                    assert first == "echo: say one" and wf.base_url == base_a
                    kill_a()
                    second = say(first)
                    assert second.get() == "echo: say echo: say one"
                return wf, second

            wf, second = await asyncio.wait_for(asyncio.to_thread(app), 30)
    assert wf.status == "succeeded" and wf.base_url == base_b
    assert [r.request_id.split(":")[1] for r in engine_b.requests] == [second.step_id]
    stored = app_b[STATE].runs.store.load(wf.run_id or "")
    assert stored is not None and stored.status == "succeeded"


def test_leases_of_an_older_schema_get_an_epoch_of_their_own(pg_url: str) -> None:
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:  # a lease before fencing
        conn.execute("CREATE TABLE flowlift_leases (run_id TEXT PRIMARY KEY, owner TEXT "
                     "NOT NULL, expires_at DOUBLE PRECISION NOT NULL)")
        conn.execute("INSERT INTO flowlift_leases VALUES ('old', 'proxy-a', 1e12)")
    store = PostgresRunStore(pg_url)
    store.create("old", {"name": "old", "nodes": []})
    epoch = store.claim("old", "proxy-a", ttl_s=30)  # its holder renews: same epoch
    assert epoch is not None and epoch >= 1
    store.append("old", 0, "run.started", {}, epoch=epoch)
    with pytest.raises(LeaseLost):  # no lease has epoch 0 (the registry's "none known")
        store.append("old", 1, "run.started", {}, epoch=0)
    store.close()


def test_a_new_run_is_never_seen_unowned_by_another_replica(pg_url: str) -> None:
    """The run's row and its creator's lease land in one transaction: between two
    statements another replica's heartbeat claimed fresh runs as orphans and ran them
    (two runs of this file in ten failed from it)."""
    store = PostgresRunStore(pg_url)
    store.create("fresh", {"name": "fresh", "nodes": []}, owner="proxy-a", ttl_s=30)
    assert "fresh" not in store.orphans("proxy-b")
    assert store.claim("fresh", "proxy-b", ttl_s=30) is None
    epoch = store.claim("fresh", "proxy-a", ttl_s=30)
    assert epoch is not None and epoch >= 1
    store.create("unowned", {"name": "unowned", "nodes": []})  # (no owner: an orphan)
    assert "unowned" in store.orphans("proxy-b")
    store.close()


async def test_a_run_is_cancelled_through_a_replica_that_does_not_run_it(
        aiohttp_client, pg_url: str) -> None:
    import asyncio

    (app_b, b, _), (_, c, _) = [await _replica(aiohttp_client, pg_url) for _ in range(2)]
    resp = await b.post("/v1/workflows", json={"id": "wf-k", "nodes": [
        llm("a", "one"), {"kind": "tool", "id": "t", "name": "never", "args": []}]})
    async for line in resp.content:  # B runs it; t waits for a tool that never comes
        if line.startswith(b"event: tool.wanted"):
            break
    resp.close()
    follow = asyncio.create_task(_events(c, "wf-k"))
    cancel = await c.delete("/v1/workflows/wf-k")
    assert cancel.status == 202 and (await cancel.json())["cancelled"] is True
    events = await asyncio.wait_for(follow, 10)
    assert events[-1][0] == "run.finished" and events[-1][1]["status"] == "cancelled"
    assert "wf-k" not in app_b[STATE].runs.active
