"""Workflow steps on their planned tier (flowlift.proxy.workflows.tiering): batch steps
through the fake Batch API, durable step.batch records, the watchdog, resuming."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from flowlift.local_engine.base import ChatMessage, GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.batch.api import BatchLine, pack
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.state import STATE
from flowlift.proxy.workflows.tiering import TieredDispatcher
from flowlift.testing import MALFORMED, FakeBatchAPI, LineError, parse_sse
from tests.upstream_fake import FakeUpstream, chunk, sse_bytes


def config(std_url: str, batch_url: str, **batch: Any) -> dict[str, Any]:
    return {"backends": {
        "std": {"kind": "openai", "base_url": std_url},
        "b": {"kind": "openai-batch", "base_url": batch_url, "poll_initial_s": 0.02,
              "poll_max_s": 0.05, **batch}},
        "models": {"up": {"backends": ["std"], "batch": "b", "price_per_1k_tokens": 1.0}}}


def chain(n: int, deadline_s: float) -> dict[str, Any]:
    nodes = []
    for i in range(n):
        content: list[dict[str, Any]] = [{"text": f"step {i} "}]
        if i:
            content.append({"ref": f"s{i - 1}"})
        nodes.append({"kind": "llm", "id": f"s{i}", "model": "up",
                      "messages": [{"role": "user", "content": content}],
                      "params": {"max_tokens": 16}})
    return {"deadline_s": deadline_s, "nodes": nodes}


def standard_answer() -> FakeUpstream:
    return FakeUpstream([FakeUpstream.stream(sse_bytes(
        chunk({"role": "assistant", "content": "from standard"}), chunk({}, "stop"),
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}))])


async def batch_text(dispatcher: TieredDispatcher, request: GenerationRequest) -> str:
    """The whole answer of ``request`` through ``dispatcher`` at batch priority."""
    text = ""
    async with contextlib.aclosing(dispatcher.generate(
            request, priority=Priority.of("batch"))) as chunks:
        async for c in chunks:
            text += c.text
    return text


async def proxy(aiohttp_client: Any, aiohttp_server: Any, api: FakeBatchAPI,
                std: FakeUpstream, **batch: Any) -> Any:
    std_url = str((await aiohttp_server(std.app())).make_url("/v1"))
    batch_url = str((await aiohttp_server(api.app())).make_url("/v1"))
    app = create_app({}, file_config=parse_config(config(std_url, batch_url, **batch)))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def test_a_day_of_deadline_runs_the_chain_on_the_batch_tier(
        aiohttp_client: Any, aiohttp_server: Any) -> None:
    api = FakeBatchAPI(turnaround=lambda rng: 0.05)
    std = standard_answer()
    client = await proxy(aiohttp_client, aiohttp_server, api, std)
    compiled = await (await client.post("/v1/workflows:compile", json=chain(3, 86400))).json()
    assert compiled["tier_plan"]["by_tier"] == {"batch": 3}
    events = parse_sse(await (await client.post("/v1/workflows", json=chain(3, 86400))).text())
    values = {d["step_id"]: d["value"] for e, d in events if e == "step.finished"}
    assert values == {f"s{i}": f"echo: step {i} " + ("" if i == 0 else values[f"s{i - 1}"])
                      for i in range(3)}
    assert not std.received  # nothing on the standard tier
    assert len(api.batches) == 3  # one batch per stage (each step waits for its parent)
    records = [d for e, d in events if e == "step.batch"]
    assert [r["state"] for r in records if r["step_id"] == "s0"] == [
        "uploaded", "submitted", "finished"]
    finished = next(r for r in records if r["state"] == "finished")
    assert finished["kind"] == "ok" and finished["usage"]["completion_tokens"] > 0
    costs = [d for e, d in events if e == "step.cost"]
    assert [d["served"] for d in costs] == ["batch"] * 3
    first = costs[0]  # the model's price (1.0 per 1k tokens), halved on batch
    assert first["cost"] == (first["prompt_tokens"] + first["completion_tokens"]) * 0.0005


async def test_the_watchdog_moves_a_late_batch_step_to_standard_and_cancels_the_batch(
        aiohttp_client: Any, aiohttp_server: Any) -> None:
    api = FakeBatchAPI(turnaround=lambda rng: 600.0)  # never back in time
    std = standard_answer()
    client = await proxy(aiohttp_client, aiohttp_server, api, std, turnaround_p50_s=0.2,
                         turnaround_p90_s=0.5, margin_s=0.2, watchdog_guard_s=1.0)
    events = parse_sse(await (await client.post("/v1/workflows", json=chain(1, 4.0))).text())
    assert [d["value"] for e, d in events if e == "step.finished"] == ["from standard"]
    assert len(std.received) == 1
    (batch,) = api.batches.values()
    assert batch.cancelled_sim is not None  # its only line was abandoned
    assert events[-1][1]["status"] == "succeeded"
    states = [d["state"] for e, d in events if e == "step.batch"]
    assert states[:2] == ["uploaded", "submitted"]


@pytest.mark.parametrize("finished_before", [False, True])
async def test_a_restarted_run_waits_for_its_submitted_line_and_submits_nothing(
        finished_before: bool) -> None:
    api = FakeBatchAPI(turnaround=lambda rng: 0.05)
    server = TestServer(api.app())
    await server.start_server()
    url = str(server.make_url("/v1"))
    backends = Backends({}, config=parse_config(config("http://std.invalid/v1", url)))
    pool = backends.batch_pools["b"]
    # before the restart: the line was submitted and journaled as a step.batch event
    (file,) = pack([BatchLine("run1:s0:1", {"model": "up", "messages": [
        {"role": "user", "content": "earlier"}]})])
    file_id, batch_id = await pool.client.submit(file)
    history = [(1, "step.batch", {"state": "uploaded", "custom_id": "run1:s0:1",
                                  "step_id": "s0", "model": "up", "file_id": file_id}),
               (2, "step.batch", {"state": "submitted", "custom_id": "run1:s0:1",
                                  "step_id": "s0", "model": "up", "file_id": file_id,
                                  "batch_id": batch_id})]
    if finished_before:  # the batch ended, the step's answer was not recorded yet
        await pool.client.wait(batch_id)
        history.append((3, "step.batch", {"state": "finished", "custom_id": "run1:s0:1",
                                          "step_id": "s0", "batch_id": batch_id,
                                          "status": "completed", "kind": "ok"}))
    emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(name: str, data: dict[str, Any]) -> int:
        emitted.append((name, data))
        return len(emitted)
    dispatcher = TieredDispatcher(backends, run_id="run1", tiers={"s0": "batch"},
                                  slack_s=lambda step: 3600.0, emit=emit, history=history)
    posts_before = [r for r in api.requests if r[0] == "POST"]
    request = GenerationRequest("run1:s0:1", "up", [ChatMessage("user", "earlier")],
                                service_tier="batch")
    text = await batch_text(dispatcher, request)
    assert text == "echo: earlier"
    assert [r for r in api.requests if r[0] == "POST"] == posts_before  # nothing new
    assert [d["state"] for e, d in emitted if e == "step.batch"] == ["finished"]
    assert [d["served"] for e, d in emitted if e == "step.cost"] == ["batch"]
    dispatcher.close()
    await backends.aclose()
    await server.close()
    await asyncio.sleep(0)


async def test_a_step_planned_on_flex_moves_to_standard_when_flex_has_no_capacity(
        aiohttp_client: Any, aiohttp_server: Any) -> None:
    from aiohttp import web
    ok = FakeUpstream.stream(sse_bytes(
        chunk({"role": "assistant", "content": "from standard"}), chunk({}, "stop")))
    busy = FakeUpstream.json({"error": {"message": "flex capacity", "type": "rate_limit"}},
                             status=429, headers={"retry-after": "0"})

    async def answer(request: web.Request) -> web.StreamResponse:
        flex = (await request.json()).get("service_tier") == "flex"
        return await (busy if flex else ok)(request)
    std = FakeUpstream([answer])
    url = str((await aiohttp_server(std.app())).make_url("/v1"))
    app = create_app({}, file_config=parse_config({
        "backends": {"std": {"kind": "openai", "base_url": url, "offers_flex": True}},
        "models": {"up": {"backends": ["std"], "max_attempts": 2,
                          "price_per_1k_tokens": 1.0}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    compiled = await (await client.post("/v1/workflows:compile", json=chain(1, 1200))).json()
    assert compiled["tier_plan"]["by_tier"] == {"flex": 1}
    events = parse_sse(await (await client.post("/v1/workflows", json=chain(1, 1200))).text())
    assert [d["value"] for e, d in events if e == "step.finished"] == ["from standard"]
    tiers = [r.json().get("service_tier") for r in std.received]
    assert tiers == ["flex", "flex", None]  # backed off once on flex, then standard
    assert [d["to"] for e, d in events if e == "step.tier"] == ["standard"]
    assert [(d["asked"], d["served"]) for e, d in events if e == "step.cost"] == [
        ("standard", "standard")]


@pytest.mark.parametrize("said,served,price", [("flex", "flex", 0.0005),
                                               ("default", "standard", 0.001)])
async def test_a_flex_answer_is_priced_at_the_tier_it_says_served_it(
        aiohttp_client: Any, aiohttp_server: Any, said: str, served: str,
        price: float) -> None:
    std = FakeUpstream([FakeUpstream.stream(sse_bytes(
        chunk({"role": "assistant", "content": "ok"}, service_tier=said),
        chunk({}, "stop", service_tier=said),
        {"choices": [], "service_tier": said,
         "usage": {"prompt_tokens": 600, "completion_tokens": 400}}))])
    url = str((await aiohttp_server(std.app())).make_url("/v1"))
    app = create_app({}, file_config=parse_config({
        "backends": {"std": {"kind": "openai", "base_url": url, "offers_flex": True}},
        "models": {"up": {"backends": ["std"], "price_per_1k_tokens": 1.0}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    events = parse_sse(await (await client.post("/v1/workflows", json=chain(1, 1200))).text())
    (cost,) = [d for e, d in events if e == "step.cost"]
    assert (cost["asked"], cost["served"]) == ("flex", served)
    assert cost["cost"] == pytest.approx(1000 * price)


@pytest.mark.parametrize("kind,answer,turnaround_s", [
    ("invalid", LineError(400, "invalid_request_error", "bad"), 0.05),
    ("failed", LineError(500, "server_error", "boom"), 0.05),
    ("malformed", MALFORMED, 0.05),
    ("expired", "late", 2 * 86400.0)])
async def test_a_batch_line_that_fails_is_answered_on_the_fast_tier(
        aiohttp_client: Any, aiohttp_server: Any, kind: str, answer: Any,
        turnaround_s: float) -> None:
    api = FakeBatchAPI(turnaround=lambda rng: turnaround_s, time_scale=2e5,
                       responder=lambda body: answer)
    std = standard_answer()
    client = await proxy(aiohttp_client, aiohttp_server, api, std)
    events = parse_sse(await (await client.post("/v1/workflows", json=chain(1, 86400))).text())
    assert [d["value"] for e, d in events if e == "step.finished"] == ["from standard"]
    assert len(std.received) == 1 and len(api.batches) == 1  # never the batch tier again
    finished = [d for e, d in events if e == "step.batch" and d["state"] == "finished"]
    assert [d["kind"] for d in finished] == [kind]


async def test_a_contract_failure_on_the_batch_tier_is_retried_on_the_fast_tier(
        aiohttp_client: Any, aiohttp_server: Any) -> None:
    api = FakeBatchAPI(turnaround=lambda rng: 0.05)  # answers "echo: ...": not yes|no
    std = FakeUpstream([FakeUpstream.stream(sse_bytes(
        chunk({"role": "assistant", "content": "yes"}), chunk({}, "stop")))])
    client = await proxy(aiohttp_client, aiohttp_server, api, std)
    graph = chain(1, 86400)
    graph["nodes"][0].update(contract={"regex": "yes|no"}, retries=2)
    events = parse_sse(await (await client.post("/v1/workflows", json=graph)).text())
    assert [d["value"] for e, d in events if e == "step.finished"] == ["yes"]
    assert len(api.batches) == 1 and len(std.received) == 1


async def test_a_batch_step_ready_too_late_for_batch_is_planned_again_on_the_fast_tier(
        aiohttp_server: Any) -> None:
    api = FakeBatchAPI(turnaround=lambda rng: 0.05)
    std = standard_answer()
    std_url = str((await aiohttp_server(std.app())).make_url("/v1"))
    batch_url = str((await aiohttp_server(api.app())).make_url("/v1"))
    backends = Backends({}, config=parse_config(config(std_url, batch_url)))
    emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(name: str, data: dict[str, Any]) -> int:
        emitted.append((name, data))
        return len(emitted)
    slack = {"s0": 600.0}  # its parents ran late: ten minutes left, not a batch window
    dispatcher = TieredDispatcher(backends, run_id="r", tiers={"s0": "batch"},
                                  slack_s=slack.get, emit=emit)
    request = GenerationRequest("r:s0:1", "up", [ChatMessage("user", "hi")],
                                service_tier="batch")
    text = await batch_text(dispatcher, request)
    assert text == "from standard" and not api.batches
    assert [x for x in emitted if x[0] == "step.tier"] == [
        ("step.tier", {"step_id": "s0", "from": "batch", "to": "standard",
                       "why": "600 s of slack left when the step was ready"})]
    dispatcher.close()
    await backends.aclose()


async def test_finished_batches_teach_the_planner_their_turnaround(
        aiohttp_client: Any, aiohttp_server: Any) -> None:
    api = FakeBatchAPI(turnaround=lambda rng: 50.0, time_scale=1000.0)  # 50 ms real
    client = await proxy(aiohttp_client, aiohttp_server, api, standard_answer())
    await (await client.post("/v1/workflows", json=chain(3, 86400))).read()
    backends = client.app[STATE].backends
    assert list(backends.turnarounds._seen["batch"]) == [50.0, 50.0, 50.0]


async def test_a_step_with_hours_of_slack_waits_in_the_engines_idle_class(
        aiohttp_client: Any) -> None:
    from flowlift.testing import FakeEngine
    engine = FakeEngine(["m"])
    app = create_app({"m": engine}, file_config=parse_config({
        "backends": {"local": {"kind": "embedded", "idle": True}},
        "models": {"m": {"backends": ["local"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    graph = chain(2, 86400)
    for node in graph["nodes"]:
        node["model"] = "m"
    compiled = await (await client.post("/v1/workflows:compile", json=graph)).json()
    assert compiled["tier_plan"]["by_tier"] == {"idle": 2}
    events = parse_sse(await (await client.post("/v1/workflows", json=graph)).text())
    assert len([e for e, _ in events if e == "step.finished"]) == 2
    # the engine's queue order: idle after every batch step (rank 2 of the class)
    assert all(r.priority >= 2_000_000_000 - 1_000_000_000 for r in engine.requests)
    assert [d["served"] for e, d in events if e == "step.cost"] == ["idle", "idle"]
    tight = parse_sse(await (await client.post("/v1/workflows", json={
        **graph, "deadline_s": 120})).text())  # minutes: local, in the run's own class
    assert all(r.priority < 1_000_000_000 for r in engine.requests[2:])
    assert len([e for e, _ in tight if e == "step.finished"]) == 2


async def test_the_run_listing_shows_progress_deadline_and_spend_so_far(
        aiohttp_client: Any, aiohttp_server: Any, capsys: Any) -> None:
    from flowlift.cli import main
    from flowlift.cli.runs import runs_row
    api = FakeBatchAPI(turnaround=lambda rng: 60.0, time_scale=100.0)  # 0.6 s a stage
    client = await proxy(aiohttp_client, aiohttp_server, api, standard_answer())
    base = str(client.make_url("")).rstrip("/")
    started = asyncio.ensure_future(client.post("/v1/workflows", json=chain(3, 86400)))
    while not api.batches:  # the first stage is out on the batch tier
        await asyncio.sleep(0.02)
    (item,) = (await (await client.get("/v1/workflows")).json())["data"]
    assert item["status"] == "running" and (item["steps"], item["done"]) == (3, 0)
    assert item["deadline_s"] == 86400 and 86000 < item["deadline_left_s"] <= 86400
    assert item["spent"] is None  # nothing answered yet
    events = parse_sse(await (await started).text())
    (item,) = (await (await client.get("/v1/workflows")).json())["data"]
    costs = [d for e, d in events if e == "step.cost"]
    assert (item["done"], item["failed"], item["deadline_left_s"]) == (3, 0, None)
    assert item["spent"] == pytest.approx(sum(d["cost"] for d in costs))
    assert item["standard_cost"] == pytest.approx(2 * item["spent"])  # batch: half
    assert all(d["standard_cost"] == pytest.approx(2 * d["cost"]) for d in costs)
    run = await (await client.get(f"/v1/workflows/{item['id']}")).json()
    assert run["spend"]["cost"] == item["spent"]
    assert {s: d["served"] for s, d in run["spend"]["by_step"].items()} == {
        "s0": "batch", "s1": "batch", "s2": "batch"}
    assert await asyncio.to_thread(main, ["runs", "--base-url", base]) == 0
    out = capsys.readouterr().out
    assert "PROGRESS" in out and "DEADLINE" in out and "SPENT" in out
    assert runs_row(item) in out and "3/3" in out and "24.0 h" in out
    assert f"{item['spent']:.4f} (0.50x std)" in out
    assert "60 min left" in runs_row({**item, "status": "running", "deadline_left_s": 3600})


def test_a_stored_run_is_listed_with_its_appended_steps_and_spend() -> None:
    from flowlift.proxy.store.base import StoredRun
    from flowlift.proxy.workflows.progress import stored_listing
    events = [(1, "run.started", {}),
              (2, "nodes.appended", {"nodes": [{"id": "x"}, {"id": "y"}]}),
              (3, "step.cost", {"step_id": "a", "asked": "batch", "served": "batch",
                                "cost": 0.25, "standard_cost": 0.5}),
              (4, "step.finished", {"step_id": "a", "value": "v"}),
              (5, "step.failed", {"step_id": "x", "error": "boom"}),
              (6, "step.cost", {"step_id": "y", "asked": "flex", "served": "standard",
                                "cost": 1.0, "standard_cost": 1.0})]
    stored = StoredRun("wf-1", {"nodes": [{"id": "a"}], "deadline_s": 7200}, "running",
                       events)
    assert stored_listing(stored) == {"steps": 3, "done": 1, "failed": 1, "deadline_s": 7200,
                                      "deadline_left_s": None, "spent": 1.25,
                                      "standard_cost": 1.5}
    plain = StoredRun("wf-2", {"nodes": [{"id": "a"}]}, "succeeded", events[:1])
    assert stored_listing(plain)["spent"] is None
    assert stored_listing(plain)["deadline_s"] is None


async def test_a_batch_line_that_finishes_after_the_watchdogs_answer_is_billed_too(
        aiohttp_server: Any) -> None:
    api = FakeBatchAPI(turnaround=lambda rng: 1.5)  # one batch for both runs' lines
    std = standard_answer()
    std_url = str((await aiohttp_server(std.app())).make_url("/v1"))
    batch_url = str((await aiohttp_server(api.app())).make_url("/v1"))
    backends = Backends({}, config=parse_config(config(
        std_url, batch_url, turnaround_p90_s=0.5, margin_s=0.2, watchdog_guard_s=0.3)))
    emitted: dict[str, list[tuple[str, dict[str, Any]]]] = {"late": [], "calm": []}
    dispatchers = {}
    t0 = time.monotonic()
    # "late": 1 s of slack, enough to go to batch (0.7 s), not to wait 1.5 s there: the
    # watchdog moves it after 0.7 s, once its line is out
    for run, budget in (("late", 1.0), ("calm", 3600.0)):
        def emit(name: str, data: dict[str, Any], run: str = run) -> int:
            emitted[run].append((name, data))
            return len(emitted[run])
        dispatchers[run] = TieredDispatcher(
            backends, run_id=run, tiers={"s0": "batch"}, emit=emit,
            slack_s=lambda step, budget=budget: budget - (time.monotonic() - t0))

    async def answer(run: str) -> str:
        request = GenerationRequest(f"{run}:s0:1", "up", [ChatMessage("user", run)],
                                    service_tier="batch")
        return await batch_text(dispatchers[run], request)
    late, calm = await asyncio.gather(answer("late"), answer("calm"))
    assert (late, calm) == ("from standard", "echo: calm")
    assert len(api.batches) == 1 and next(iter(api.batches.values())).cancelled_sim is None
    costs = [d for e, d in emitted["late"] if e == "step.cost"]
    assert [(d["served"], d.get("late", False)) for d in costs] == [
        ("standard", False), ("batch", True)]  # the fast answer, then its batch line
    assert costs[1]["cost"] == pytest.approx(costs[1]["standard_cost"] / 2)
    assert len(std.received) == 1  # only the late run's step went to standard
    for d in dispatchers.values():
        d.close()
    await backends.aclose()


async def test_flowlift_compile_through_the_proxy_shows_the_tier_plan_cost_and_risk(
        aiohttp_client: Any, aiohttp_server: Any, tmp_path: Any, capsys: Any) -> None:
    import json

    from flowlift.cli import main
    client = await proxy(aiohttp_client, aiohttp_server, FakeBatchAPI(), standard_answer())
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(chain(3, 86400)))
    base = str(client.make_url("")).rstrip("/")
    assert await asyncio.to_thread(main, ["compile", str(path), "--base-url", base]) == 0
    text = capsys.readouterr().out
    assert "tiers: batch 3; expected cost" in text and "(0.50x)" in text
    assert "risk that the watchdog moves a step" in text
    assert text.count("tier=batch") == 3  # the plan per step
    path.write_text(json.dumps(chain(3, 30)))  # half a minute: nothing can wait
    assert await asyncio.to_thread(main, ["compile", str(path), "--base-url", base]) == 0
    assert "tiers: standard 3; expected cost" in capsys.readouterr().out
