"""PostgreSQL faults under running workflows (issue 28 item 3), on the real server the
suite starts (tests/pg.py): the server restarted, the store's connection pool exhausted,
a 10 s network drop between the proxy and the server. For each: every run finishes and
succeeds, no step runs twice (engine calls and tool side effects counted per step),
meanwhile new runs get a 503 naming the store (OpenAI error shape, ``Retry-After``,
never a 500 or a hang), ``/readyz`` says why it is not ready while ``/healthz`` answers,
and afterwards everything goes on without restarting the proxy."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from flowlift import step, tool, workflow
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.state import STATE
from flowlift.proxy.workflows.registry import ANSWER_WITHIN_S
from flowlift.testing import FakeEngine, parse_sse
from tests.pg import PgServer, Relay

RUNS = 8
SIDE_EFFECTS: Counter[tuple[int, str]] = Counter()  # (workflow, tool) -> times it ran
ANSWER_BOUND_S = ANSWER_WITHIN_S + 2.0  # a new run's answer, whatever the store does


@step(model="fake-model", max_tokens=16)
def outline(topic: str) -> str:
    return f"Outline {topic}"


@step(model="fake-model", max_tokens=16)
def write(plan: str, facts: object) -> str:
    return f"Write {plan} from {facts}"


@tool
async def gather(plan: str, i: int) -> dict[str, object]:
    SIDE_EFFECTS[(i, "gather")] += 1
    await asyncio.sleep(0.2)
    return {"run": i, "size": len(plan)}


@tool
async def review(text: str, i: int) -> int:
    SIDE_EFFECTS[(i, "review")] += 1
    await asyncio.sleep(0.2)
    return i


async def one_run(i: int, base: str) -> object:
    """outline -> gather (tool) -> write -> review (tool) -> write: the last value."""
    async with workflow(f"fault-{i}", base_url=base, reconnect_s=60) as wf:
        plan = outline(f"topic {i}")
        facts = gather(plan, i)
        text = write(plan, facts)
        checked = review(text, i)
        final = write(text, checked)
    assert wf.status == "succeeded", (i, wf.status, wf.failures)
    return final.value


@dataclass
class Probe:
    """What the proxy answered while the fault lasted: each new run's status, code and
    wait; ``/readyz`` reasons; ``/healthz`` waits."""

    posts: list[tuple[int, str | None, float]] = field(default_factory=list)
    ready: list[tuple[int, str | None]] = field(default_factory=list)
    alive_s: list[float] = field(default_factory=list)
    admitted: list[asyncio.Task[list[Any]]] = field(default_factory=list)
    recovered_s: float | None = None  # from the fault's end to the first run admitted


async def probe(client: Any, until: asyncio.Event, probed: Probe, ended: list[float]) -> None:
    """Every 0.1 s until ``until``, each without waiting for the others: a new run (its
    stream read in the background when it is admitted), ``/readyz`` and ``/healthz``."""
    graph = {"name": "probe", "nodes": [{"kind": "llm", "id": "p", "model": "fake-model",
             "messages": [{"role": "user", "content": [{"text": "still there?"}]}]}]}

    async def new_run() -> None:
        t0 = time.monotonic()
        resp = await asyncio.wait_for(client.post("/v1/workflows", json=graph), ANSWER_BOUND_S)
        took = time.monotonic() - t0
        if resp.status == 200:
            probed.admitted.append(asyncio.create_task(read_all(resp)))
            if ended and probed.recovered_s is None:
                probed.recovered_s = time.monotonic() - ended[0]
            probed.posts.append((200, None, took))
            return
        body = await resp.json()
        assert resp.status == 503, (resp.status, body)  # never a 500
        assert body["error"]["code"] == "store_unavailable", body
        assert "run store" in body["error"]["message"], body
        assert int(resp.headers["Retry-After"]) >= 1
        probed.posts.append((503, body["error"]["code"], took))

    async def ready() -> None:
        resp = await asyncio.wait_for(client.get("/readyz"), ANSWER_BOUND_S)
        probed.ready.append((resp.status, (await resp.json())["reason"]))

    async def alive() -> None:
        t0 = time.monotonic()
        resp = await asyncio.wait_for(client.get("/healthz"), 1.0)
        assert resp.status == 200
        probed.alive_s.append(time.monotonic() - t0)

    asked: list[asyncio.Task[None]] = []
    while not until.is_set():
        asked += [asyncio.create_task(check()) for check in (new_run, ready, alive)]
        await asyncio.sleep(0.1)
    await asyncio.gather(*asked)  # (raises what any of them found)


async def read_all(resp: Any) -> list[Any]:
    return parse_sse(await resp.text())


async def under_fault(aiohttp_client: Any, store_url: str,
                      fault: Callable[[Any], Awaitable[None]], what: str) -> Probe:
    """RUNS workflows on one proxy on ``store_url``; once each has finished its first
    step, ``fault(app)`` (it returns when the fault is over), probed all along; then
    every check of the module docstring."""
    SIDE_EFFECTS.clear()
    engine = FakeEngine(["fake-model"], delay_s=0.05)
    app = create_app({"fake-model": engine}, ProxyConfig(state_path=store_url))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    runs = app[STATE].runs
    base = str(client.make_url("")).rstrip("/")
    workflows = [asyncio.create_task(one_run(i, base)) for i in range(RUNS)]
    t0 = time.monotonic()
    while sum(1 for r in engine.requests if ":outline" in r.request_id) < RUNS:
        assert time.monotonic() - t0 < 30, "the runs did not start"
        await asyncio.sleep(0.02)
    stop, probed, ended = asyncio.Event(), Probe(), []
    prober = asyncio.create_task(probe(client, stop, probed, ended))
    fault_t0 = time.monotonic()
    await fault(app)
    ended.append(time.monotonic())
    while probed.recovered_s is None:  # new runs are taken again, with no restart
        assert time.monotonic() - ended[0] < 30, f"{what}: no run admitted after the fault"
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(prober, 30)
    values = await asyncio.wait_for(asyncio.gather(*workflows), 60)
    assert values == [f"echo: Write echo: Write echo: Outline topic {i} from "
                      f'{{"run": {i}, "size": {len(f"echo: Outline topic {i}")}}} from {i}'
                      for i in range(RUNS)]
    for events in await asyncio.wait_for(asyncio.gather(*probed.admitted), 30):
        assert events[-1][0] == "run.finished" and events[-1][1]["status"] == "succeeded"
    asked = Counter(tuple(r.request_id.rsplit(":", 2)) for r in engine.requests)
    twice = [r for r, n in asked.items() if n > 1 or r[2] != "1"]  # (run, step, attempt)
    assert not twice, f"{what}: a step ran twice: {twice}"
    assert len(asked) == 3 * RUNS + len(probed.admitted)  # each step of each run, once
    assert sorted(SIDE_EFFECTS.values()) == [1] * (2 * RUNS), f"{what}: a tool ran twice"
    refused = [p for p in probed.posts if p[0] == 503]
    assert refused, f"{what}: no new run was refused while the store was away"
    assert max(p[2] for p in probed.posts) < ANSWER_BOUND_S
    quick = sorted(p[2] for p in refused)[len(refused) // 2]
    assert quick < 1.0, f"{what}: refusals wait for the store (median {quick:.2f} s)"
    reasons = [r for s, r in probed.ready if s == 503]
    assert reasons and all("run store" in (r or "") for r in reasons), probed.ready
    assert runs.unavailable() is None and (await client.get("/readyz")).status == 200
    print(f"\n{what}: fault {ended[0] - fault_t0:.1f} s; new runs meanwhile: "
          f"{len(refused)} x 503 store_unavailable (median answer {quick * 1000:.0f} ms), "
          f"{len(probed.posts) - len(refused)} admitted; slowest answer "
          f"{max(p[2] for p in probed.posts):.2f} s; /readyz 503 "
          f"x {len(reasons)} (e.g. {reasons[0]!r}); /healthz slowest "
          f"{max(probed.alive_s) * 1000:.0f} ms; first run admitted "
          f"{probed.recovered_s:.2f} s after the fault ended; {RUNS} runs succeeded, "
          f"{len(asked)} engine calls, each once; {sum(SIDE_EFFECTS.values())} tool calls, "
          "each once")
    return probed


async def test_a_server_restart_mid_run(aiohttp_client, pg_url: str,
                                        pg_server: PgServer) -> None:
    """``pg_ctl stop -m fast`` (every connection cut), 2 s without a server, start."""
    async def restart(app: Any) -> None:
        await asyncio.to_thread(pg_server.restart, 2.0)

    await under_fault(aiohttp_client, pg_url, restart, "server restart")


async def test_the_connection_pool_exhausted(aiohttp_client, pg_url: str) -> None:
    """Every connection of the store's pool (its bound: 4) held elsewhere for 4 s."""
    async def exhaust(app: Any) -> None:
        pool = app[STATE].runs.store._pool
        held = [await asyncio.to_thread(pool.getconn, 10.0) for _ in range(pool.max_size)]
        await asyncio.sleep(4.0)
        for conn in held:
            pool.putconn(conn)

    await under_fault(aiohttp_client, pg_url, exhaust, "pool exhausted")


async def test_a_10_s_network_drop(relay: Relay, aiohttp_client, pg_url: str) -> None:
    """The proxy reaches the server through a relay that black-holes everything, both
    ways, for 10 s (new connections too), then lets it through."""
    async def drop(app: Any) -> None:
        relay.hold()
        await asyncio.sleep(10.0)
        relay.flow()

    await under_fault(aiohttp_client, relay.url(pg_url), drop, "10 s network drop")
