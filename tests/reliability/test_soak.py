"""Every table the proxy keeps is bounded, and memory plateaus under endless unique ids.

Quick (always run): traffic with unique session, workflow and run ids past each table's
bound -- sessions, inferred workflows, finished runs, the run store -- must stop at the
bound; and a walk over every container reachable from the proxy's state finds nothing
else that grew with the ids (replica affinity is rendezvous hashing: no table at all).

Soak (``--soak`` or ``FLOWLIFT_SOAK_S``): the same traffic for that many seconds, RSS and
live Python objects sampled every 5 s; the last third's peaks must stay within 2% (objects)
and 5% + 8 MiB (RSS) of the middle third's (a plateau), with every table at or under its
bound throughout.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from cachetools import TTLCache

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.sessions.table import SESSIONS, SessionTable
from flowlift.proxy.state import STATE
from flowlift.proxy.workflows.inferred import InferredWorkflows
from flowlift.testing import FakeEngine
from tests.reliability.faults import config_for, rss_mib, serve
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes

BOUND = 40  # each table's bound in these tests (the defaults are 1,024 to 10,000)


async def answer_anything(request):  # type: ignore[no-untyped-def]
    import json
    body = json.loads(await request.read())
    if body.get("stream") is True:
        return await FakeUpstream.stream(sse_bytes(chunk({"content": "ok"}), chunk({}, "stop"),
                                                   {"choices": [], "usage": {
                                                       "prompt_tokens": 3,
                                                       "completion_tokens": 1}}))(request)
    return await FakeUpstream.json(chat_json("ok"))(request)


async def small_proxy(aiohttp_server: Any) -> tuple[Any, str]:
    """A proxy (``fake-model`` embedded, ``up`` on a fake upstream) whose tables are all
    bounded at :data:`BOUND`; (app, base URL)."""
    fake = FakeUpstream([answer_anything])
    fake.received = deque(maxlen=64)  # type: ignore[assignment]  # the test doubles
    engine = FakeEngine(["fake-model"])  # record every request: not what is measured
    engine.requests = deque(maxlen=64)  # type: ignore[assignment]
    (url,) = await serve(aiohttp_server, [fake.app()])
    app = create_app({"fake-model": engine},
                     ProxyConfig(max_concurrency=32),
                     file_config=parse_config(config_for({"up": {"backends": ["b0", "b1"]}},
                                                         {"b0": url, "b1": url})))
    app[SESSIONS] = SessionTable(max_sessions=BOUND)
    server = await aiohttp_server(app)
    state = app[STATE]
    await state.ready.wait()
    state.inferred = InferredWorkflows(max_workflows=BOUND)
    state.runs.finished = TTLCache(maxsize=BOUND, ttl=3600)
    state.runs.store_keep = BOUND
    state.backends.latency.max_prefixes = BOUND  # affinity keys per replica (routing)
    return app, str(server.make_url("")).rstrip("/")


async def traffic(session: aiohttp.ClientSession, base: str, ids: Iterator[int],
                  n: int) -> None:
    """``n`` rounds of: a chat on each model with a new session and workflow id (one
    streamed), and a two-step workflow run with a new run id."""
    async def one(i: int) -> None:
        for model, stream in (("up", False), ("up", True), ("fake-model", i % 2 == 0)):
            async with session.post(f"{base}/v1/chat/completions", json={
                    "model": model, "stream": stream,
                    "messages": [{"role": "user", "content": f"turn {i} of {model}"}]},
                    headers={"X-Flowlift-Session": f"s-{i}-{model}",
                             "X-Flowlift-Workflow": f"w-{i}-{model}"}) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
        graph = {"id": f"run-{i}", "nodes": [
            {"kind": "llm", "id": "a", "model": model, "params": {"max_tokens": 4},
             "messages": [{"role": "user", "content": [{"text": f"go {i}"}]}]}
            for model in ("fake-model",)]}
        async with session.post(f"{base}/v1/workflows", json=graph) as resp:
            assert resp.status == 200, await resp.text()
            assert b'"succeeded"' in await resp.read()
    await asyncio.gather(*[one(next(ids)) for _ in range(n)])


POOLED = ("._loop._transports", "._loop._selector")
"""The event loop's open sockets: the test's client, the proxy, its upstream client and
the fake upstream share one loop, and each side's keep-alive pool is bounded by its
connector's limit (more of them open at once now that store calls leave the loop free).
The loop's timers (``_scheduled``) are still measured: the live ones, less each open
connection's keep-alive timer (a cancelled timer stays in the heap until asyncio sweeps
it)."""


def sizes(root: Any, *, depth: int = 6) -> dict[str, int]:
    """``path -> len`` of every sized container reachable from ``root`` through object
    attributes and the items of small dicts and lists, ``depth`` levels deep (breadth
    first: each object under its shortest path)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    todo: deque[tuple[Any, str, int]] = deque([(root, "app", 0)])
    while todo:
        obj, path, level = todo.popleft()
        # (the FakeEngine test double records every request: not the proxy's state)
        if id(obj) in seen or level > depth or isinstance(
                obj, str | bytes | int | float | FakeEngine):
            continue
        seen.add(id(obj))
        if isinstance(obj, deque) and obj.maxlen is not None:
            continue  # bounded by construction (e.g. the last output lengths of a step)
        if path.endswith(POOLED):
            continue  # open connections: bounded by each connector's limit, not by BOUND
        if path.endswith("._loop._scheduled"):  # live timers, but a connection's own
            out[path] = sum(1 for h in obj if not h.cancelled()
                            and "_process_keepalive" not in repr(h))
            continue
        if isinstance(obj, dict | list | set | tuple | TTLCache | frozenset | deque):
            out[path] = len(obj)
            if len(obj) < 64 and isinstance(obj, dict):
                todo.extend((v, f"{path}[{k!r}]", level + 1) for k, v in list(obj.items()))
            elif len(obj) < 64 and isinstance(obj, list | tuple):
                todo.extend((v, f"{path}[{k}]", level + 1) for k, v in enumerate(obj))
            continue
        attrs = getattr(obj, "__dict__", None)
        names = list(attrs) if attrs is not None else [
            s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
        for name in names:
            value = getattr(obj, name, None)
            if value is not None:
                todo.append((value, f"{path}.{name}", level + 1))
    return out


def stored_runs(app: Any) -> int:
    return app[STATE].runs.store._db.execute("SELECT count(*) FROM runs").fetchone()[0]


def assert_bounded(app: Any) -> None:
    state = app[STATE]
    assert len(app[SESSIONS]) <= BOUND
    assert len(state.inferred) <= BOUND
    assert len(state.runs.finished) <= BOUND
    assert len(state.costs.snapshot()) <= len(state.backends.routes)
    assert stored_runs(app) <= BOUND + len(state.runs.active)


async def test_every_table_is_bounded_under_unique_ids(aiohttp_server):
    app, base = await small_proxy(aiohttp_server)
    state = app[STATE]
    ids = itertools.count()
    async with aiohttp.ClientSession() as s:
        await traffic(s, base, ids, 10)  # warm-up: every table has entries
        await state.runs.sweep()
        before = sizes({"state": state, "sessions": app[SESSIONS]})
        for _ in range(3):
            await traffic(s, base, ids, BOUND)
        await state.runs.sweep()
    assert len(app[SESSIONS]) == BOUND and len(state.inferred) == BOUND
    assert len(state.runs.finished) == BOUND and stored_runs(app) == BOUND
    assert_bounded(app)
    after = sizes({"state": state, "sessions": app[SESSIONS]})
    grew = {k: (before.get(k), v) for k, v in after.items()
            if v > max(before.get(k, 0), BOUND)}
    assert not grew, f"grew with unique ids: {grew}"


def test_the_store_keeps_the_newest_finished_runs_and_every_running_one(tmp_path):
    from flowlift.proxy.store.sqlite import RunStore

    store = RunStore(tmp_path / "s.sqlite")
    for i in range(30):
        store.create(f"r{i}", {"nodes": []})
        if i % 3:
            store.append(f"r{i}", 1, "run.finished", {"status": "succeeded"})
    assert store.prune(older_than_s=3600, keep=5) == 20 - 5
    left = {r[0] for r in store._db.execute("SELECT run_id FROM runs")}
    assert {f"r{i}" for i in range(0, 30, 3)} <= left  # running: never pruned
    assert {f"r{i}" for i in (25, 26, 28, 29)} <= left and len(left) == 15
    assert store._db.execute("SELECT count(DISTINCT run_id) FROM events").fetchone()[0] == 5


@pytest.mark.timeout(0)
async def test_soak_memory_plateaus(aiohttp_server, soak_s, capsys):
    app, base = await small_proxy(aiohttp_server)
    ids = itertools.count()
    samples: list[tuple[float, float, int]] = []  # (s, RSS MiB, live Python objects)
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while (now := time.monotonic() - t0) < soak_s:
            await traffic(s, base, ids, 20)
            if not samples or now - samples[-1][0] >= 5:
                await app[STATE].runs.sweep()
                gc.collect()
                samples.append((now, rss_mib(), len(gc.get_objects())))
                assert_bounded(app)
    rounds = next(ids)
    third = len(samples) // 3
    middle, last = samples[third:2 * third], samples[2 * third:]
    rss = [max(x[1] for x in part) for part in (middle, last)]
    objects = [max(x[2] for x in part) for part in (middle, last)]
    with capsys.disabled():
        print(f"\nsoak {soak_s:.0f} s: {rounds} rounds ({rounds * 4} requests, "
              f"{rounds} workflow runs, unique ids); RSS MiB / live objects over time:")
        print("  " + ", ".join(f"{t:.0f}s {r:.0f}/{n}" for t, r, n in samples))
        print(f"  peak of the middle third {rss[0]:.1f} MiB / {objects[0]} objects, "
              f"of the last third {rss[1]:.1f} MiB / {objects[1]} objects")
    assert len(samples) >= 6, "too short a soak to judge a plateau"
    # live objects are the exact measure (a leak of any table grows them); RSS also
    # drifts with the allocator's fragmentation, hence its looser bound
    assert objects[1] <= 1.02 * objects[0] + 1000, samples
    assert rss[1] <= 1.05 * rss[0] + 8.0, samples


# -- the paced soak against a `flowlift serve` process (issue 28 item 4) ---------------------

TWO_MINUTES = {"minutes": 2.0, "rate_per_min": 1000.0, "window_s": 30.0, "sample_s": 2.0,
               "warmup_s": 60.0, "bound": 300}
"""The suite's soak: 2,000 workflows in 2 minutes, tables bounded at 300 so that they are
full by the end of the first minute (the warm-up); 30 s windows, a sample every 2 s."""


@pytest.mark.timeout(400)
async def test_a_two_minute_soak_at_1000_workflows_a_minute_plateaus(capsys):
    from tests.reliability.soak_long import Options, show, soak

    report = await soak(Options(**TWO_MINUTES))  # type: ignore[arg-type]
    with capsys.disabled():
        show(report)
    windows = report["windows"]
    assert len(windows) == 4 and set(report["slopes"]) == {"rss_mib", "fds", "open_runs",
                                                           "objects"}
    ended = {k: sum(w["ended"].get(k, 0) for w in [*windows, report["after_last_window"]])
             for k in ("succeeded", "cancelled")}
    started = sum(w["started"] for w in windows)
    assert started == 2000 and ended["cancelled"] >= 100, (started, ended)
    assert ended["succeeded"] + ended["cancelled"] == started, ended  # every run ended
    assert not report["problems"], report["problems"]


def _report(samples: list[dict[str, float]], **extra: Any) -> dict[str, Any]:
    windows = [{"window": k + 1, "t1": 30.0 * (k + 1), "errors": 0, "rate_per_min": 1000.0,
                "objects": 200_000, "tables": {}, "walk": {"app.x": 10}} for k in range(4)]
    report = {"windows": windows, "samples": samples, "warmup_s": 60.0, "bound": 0,
              "rate_per_min": 1000.0, "errors": [], "left_open": 0, **extra}
    from tests.reliability.soak_verdict import slopes
    report["slopes"] = slopes(samples, windows, 60.0)
    return report


def _samples(rss: Any, fds: Any, runs: Any = lambda t: 10 + t % 7) -> list[dict[str, float]]:
    return [{"t": float(t), "rss_mib": rss(t), "fds": fds(t), "open_runs": runs(t)}
            for t in range(0, 121, 2)]


def test_the_soak_verdict_calls_a_flat_noisy_line_a_plateau():
    from tests.reliability.soak_verdict import verdict

    noisy = _samples(lambda t: 130 + (t * 7919 % 11) / 5, lambda t: 40 + t * 31 % 35)
    assert verdict(_report(noisy)) == []


def test_the_soak_verdict_catches_a_slope_in_rss_fds_or_open_runs():
    from tests.reliability.soak_verdict import verdict

    flat_rss, flat_fds = (lambda t: 130.0), (lambda t: 40 + t * 31 % 35)
    # one finished run kept (~45 KiB) or one fd per workflow, at 1,000 workflows a minute
    kept_runs = verdict(_report(_samples(lambda t: 130 + 0.75 * t, flat_fds)))
    assert [p.split(":")[0] for p in kept_runs] == ["rss_mib"], kept_runs
    fds = verdict(_report(_samples(flat_rss, lambda t: 40 + 16 * t)))
    assert [p.split(":")[0] for p in fds] == ["fds"], fds
    runs = verdict(_report(_samples(flat_rss, flat_fds, lambda t: 10 + t)))
    assert [p.split(":")[0] for p in runs] == ["open_runs"], runs


def test_the_soak_verdict_fails_errors_slow_rates_open_runs_and_growing_tables():
    from tests.reliability.soak_verdict import verdict

    flat = _samples(lambda t: 130.0, lambda t: 40.0)
    report = _report(flat, errors=["chat 5: Expected: 500"], left_open=3)
    report["windows"][1]["errors"] = 1
    report["windows"][2]["rate_per_min"] = 600.0
    report["windows"][3]["walk"] = {"app.x": 500}
    assert verdict(report) == [
        "1 error(s) in window 2", "chat 5: Expected: 500",
        "window 3: 600 workflows/min, under 90% of 1000",
        "app.x grew 10 -> 500 after the warm-up",
        "3 run(s) still open after every client finished"]
    short = _report(flat, warmup_s=200.0)
    short["slopes"] = {}
    assert verdict(short) == ["too short a soak: no window after the warm-up to judge"]
