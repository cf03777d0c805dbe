"""Issue 19's takeover: two proxies on one PostgreSQL database (a real server, tests/pg.py),
50 SDK workflows with ``@tool`` steps running on proxy A, ``kill -9`` of A in the middle:
every run finishes on B, the SDK follows each run there by itself
(``base_url=[A, B]``), no finished step runs again and no tool runs twice."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from flowlift import step, tool, workflow
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.state import STATE
from flowlift.proxy.store.postgres import PostgresRunStore
from flowlift.testing import FakeEngine, running_proxy

RUNS = 50
TOOL_CALLS: Counter[tuple[int, str]] = Counter()  # (workflow, tool) -> times it ran


@step(model="fake-model", max_tokens=64)
def draft(topic: str) -> str:
    return f"Draft a note on {topic}"


@step(model="fake-model", max_tokens=64)
def refine(note: str, facts: object) -> str:
    return f"Refine {note} with {facts}"


@tool
async def look_up(note: str, i: int) -> dict[str, object]:
    TOOL_CALLS[(i, "look_up")] += 1
    await asyncio.sleep(0.3)  # the app holds the ball for a while: kills land here too
    return {"run": i, "seen": len(note)}


@tool
async def check(note: str, i: int) -> int:
    TOOL_CALLS[(i, "check")] += 1
    await asyncio.sleep(0.3)
    return i


async def one_workflow(i: int, urls: list[str], run_ids: dict[int, str]) -> tuple[object, str]:
    """draft -> look_up (tool) -> refine -> check (tool) -> refine; its last output and the
    replica the SDK followed it on at the end."""
    async with workflow(f"takeover-{i}", base_url=urls, reconnect_s=60) as wf:
        first = draft(f"topic {i}")
        facts = look_up(first, i)
        second = refine(first, facts)
        checked = check(second, i)
        final = refine(second, checked)
    run_ids[i] = wf.run_id or ""
    assert wf.status == "succeeded", (i, wf.status, wf.failures)
    return final.value, wf.base_url


async def _wait_for(check_fn: Callable[[], bool], timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not check_fn():
        assert time.monotonic() - t0 < timeout_s, what
        await asyncio.sleep(0.1)


def _finished(store: PostgresRunStore) -> dict[str, list[str]]:
    """Run id -> the step ids of its ``step.finished`` events (repeats kept)."""
    out: dict[str, list[str]] = {}
    for summary in store.recent(limit=100)[0]:
        stored = store.load(summary.run_id)
        assert stored is not None
        out[summary.run_id] = [d["step_id"] for _, n, d in stored.events
                               if n == "step.finished"]
    return out


async def test_kill_9_of_one_proxy_in_50_runs_with_tools_every_run_finishes_on_the_other(
        aiohttp_client, pg_url: str, tmp_path: Path) -> None:
    TOOL_CALLS.clear()
    engine_b = FakeEngine(["fake-model"], delay_s=0.01)
    app_b = create_app({"fake-model": engine_b}, ProxyConfig(state_path=pg_url,
                                                             lease_ttl_s=1.0))
    client_b = await aiohttp_client(app_b)
    await app_b[STATE].ready.wait()
    base_b = str(client_b.make_url("")).rstrip("/")
    runs_b = app_b[STATE].runs
    outcomes: Counter[str] = Counter()  # what B answered to tool results
    take = runs_b.post_tool_result

    async def counted(*args: object, **kwargs: object) -> str:
        outcomes[answer := await take(*args, **kwargs)] += 1  # type: ignore[arg-type]
        return answer

    runs_b.post_tool_result = counted  # type: ignore[method-assign]
    reader = PostgresRunStore(pg_url)
    run_ids: dict[int, str] = {}
    with running_proxy("--engine", "fake", "--fake-delay-s", "0.1", "--state-db", pg_url,
                       "--max-concurrency", "64", "--lease-ttl-s", "2",
                       "--log-level", "warning", log_path=tmp_path / "proxy-a.log",
                       ready_timeout_s=60) as (base_a, proc):
        runs = [asyncio.create_task(one_workflow(i, [base_a, base_b], run_ids))
                for i in range(RUNS)]
        await _wait_for(lambda: len(_finished(reader)) == RUNS and all(
            _finished(reader).values()), 30, "proxy A did not finish a first step of each run")
        # the runs whose first step finished last wait for their first tool now
        assert not runs_b.active and not engine_b.requests  # B steals nothing
        proc.kill()  # kill -9: no lease released, nothing more written
        proc.wait(timeout=10)
    done_on_a = {rid: set(steps) for rid, steps in _finished(reader).items()}
    unfinished = [rid for rid, steps in done_on_a.items() if len(steps) < 5]
    assert len(unfinished) >= RUNS // 2, f"A finished too much before the kill: {done_on_a}"

    ended = await asyncio.wait_for(asyncio.gather(*runs), timeout=60)
    assert [value for value, _ in ended] == [
        f'echo: Refine echo: Refine echo: Draft a note on topic {i} with {{"run": {i}, '
        f'"seen": {len(f"echo: Draft a note on topic {i}")}}} with {i}' for i in range(RUNS)]
    followed_on = {run_ids[i]: url for i, (_, url) in enumerate(ended)}
    assert {followed_on[rid] for rid in unfinished} == {base_b}  # the SDK moved by itself
    assert sorted(TOOL_CALLS.values()) == [1] * (2 * RUNS), "a tool ran twice (or never)"
    # results of tools that were out when A died went to B before B held their runs
    assert outcomes["queued"] >= 1 and outcomes["delivered"] >= 1, outcomes

    asked = [tuple(r.request_id.rsplit(":", 2)[:2]) for r in engine_b.requests]
    assert {rid for rid, _ in asked} <= set(unfinished)
    assert len(asked) == len(set(asked)), "B ran a step twice"
    for rid, step_id in asked:
        assert step_id not in done_on_a[rid], f"{rid}:{step_id} finished on A, ran on B"
    for rid, steps in _finished(reader).items():
        stored = reader.load(rid)
        assert stored is not None and stored.status == "succeeded", rid
        assert len(steps) == len(set(steps)) == 5, (rid, steps)  # each step finished once
    taken = set(unfinished) & {rid for rid, _ in asked}
    assert taken, "B executed none of A's unfinished runs"
    reader.close()
