"""The long soak (issue 16 item 10; not in CI): unique ids against one proxy for minutes.

Run from the repository root::

    .venv/bin/python tests/reliability/soak_long.py --minutes 30

An in-process proxy (``fake-model`` on a :class:`~flowlift.testing.FakeEngine`, ``up`` on a
fake OpenAI upstream on a real socket, a SQLite run store in a temporary folder, three
tenants) gets, round after round, with ids never used before: chats on both models in
a new ``X-Flowlift-Session`` and ``X-Flowlift-Workflow`` (one streamed), a
``/v1/responses`` call, a workflow run, an open run (``"open": true``, then ``/nodes``,
then ``/close``), reads of the run and the session, a guess at another tenant's run id
(must be 404) and a request with an unknown key (must be 401). Each tenant in turn.

Every ``--sample-s`` seconds (60) it prints RSS, live Python objects, the named tables
and the largest containers reachable from the proxy's state (the walker of
``test_soak.py``). At the end it prints the plateau (the peaks of the middle and last
thirds) and exits 1 when a table passed its bound, a container kept growing over the
second half, or the last third's peaks are above the middle third's beyond the same
margins ``test_soak.py`` allows (live objects 2% + 1,000; RSS 5% + 8 MiB).

The bounds are ``--bound`` (1,000) for sessions, inferred workflows, finished runs in
memory and finished runs in the store, so tables reach them within minutes (the
defaults are 1,024 to 10,000).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: `tests` importable from the repo root
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402
from cachetools import TTLCache  # noqa: E402

from flowlift.proxy import ProxyConfig, create_app  # noqa: E402
from flowlift.proxy.config import parse_config  # noqa: E402
from flowlift.proxy.lifecycle import DRAIN  # noqa: E402
from flowlift.proxy.sessions.table import SESSIONS  # noqa: E402
from flowlift.proxy.state import STATE  # noqa: E402
from flowlift.proxy.telemetry.observer import TELEMETRY  # noqa: E402
from flowlift.proxy.tenants import Tenant  # noqa: E402
from flowlift.proxy.workflows.inferred import InferredWorkflows  # noqa: E402
from flowlift.testing import FakeEngine  # noqa: E402
from flowlift.tracing.logging import configure_logging  # noqa: E402
from tests.reliability.faults import rss_mib  # noqa: E402
from tests.reliability.test_soak import sizes  # noqa: E402
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes  # noqa: E402

TENANTS = tuple(Tenant(f"t{k}", frozenset({f"sk-soak-t{k}"}), max_active_runs=64,
                       requests_per_s=10_000.0, burst=10_000) for k in range(3))
SWEEP_S = 5.0
"""The proxy's sweep period (``proxy/app.py``): the run store is pruned at each sweep."""
RESPONSE = {"id": "resp_soak", "object": "response", "status": "completed",
            "model": "up-model", "output": [{"type": "message", "role": "assistant",
                                             "content": [{"type": "output_text",
                                                          "text": "ok"}]}],
            "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}


async def upstream_answer(request: web.Request) -> web.StreamResponse:
    """Whatever ``up`` is asked: a response object, a stream with usage, or a chat."""
    body = json.loads(await request.read())
    if request.path.endswith("/responses"):
        return await FakeUpstream.json(RESPONSE)(request)
    if body.get("stream") is True:
        return await FakeUpstream.stream(sse_bytes(
            chunk({"content": "ok"}), chunk({}, "stop"),
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}))(request)
    return await FakeUpstream.json(chat_json("ok"))(request)


async def start(bound: int, state_db: Path) -> tuple[web.Application, str, list[Any]]:
    """The fake upstream and the proxy on real ports; (proxy app, base URL, runners)."""
    fake = FakeUpstream([upstream_answer])
    fake.received = deque(maxlen=64)  # type: ignore[assignment]  # the double's own log
    up = web.AppRunner(fake.app())
    await up.setup()
    up_site = web.TCPSite(up, "127.0.0.1", 0)
    await up_site.start()
    up_port = up_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    engine = FakeEngine(["fake-model"])
    engine.requests = deque(maxlen=64)  # type: ignore[assignment]  # the double's own log
    app = create_app({"fake-model": engine},
                     ProxyConfig(max_concurrency=32, max_sessions=bound, tenants=TENANTS,
                                 state_path=state_db),
                     file_config=parse_config({
                         "backends": {"b0": {"kind": "openai",
                                             "base_url": f"http://127.0.0.1:{up_port}/v1"}},
                         "models": {"up": {"backends": ["b0"], "price_per_1k_tokens": 1.0}}}))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state = app[STATE]
    await state.ready.wait()
    state.inferred = InferredWorkflows(max_workflows=bound)
    state.runs.finished = TTLCache(maxsize=bound, ttl=3600)
    state.runs.store_keep = bound
    return app, f"http://127.0.0.1:{port}", [runner, up]


def _llm(node_id: str, text: str) -> dict[str, Any]:
    return {"kind": "llm", "id": node_id, "model": "fake-model", "params": {"max_tokens": 4},
            "messages": [{"role": "user", "content": [{"text": text}]}]}


async def _ok(resp: aiohttp.ClientResponse, want: int = 200) -> bytes:
    body = await resp.read()
    if resp.status != want:
        raise AssertionError(f"{resp.method} {resp.url.path}: {resp.status}, wanted {want}: "
                             f"{body[:300]!r}")
    return body


async def one_round(s: aiohttp.ClientSession, base: str, i: int) -> None:
    """One round of traffic with ids made from ``i`` (see the module docstring)."""
    tenant = TENANTS[i % len(TENANTS)]
    h = {"Authorization": f"Bearer {next(iter(tenant.keys))}"}
    other = {"Authorization": f"Bearer {next(iter(TENANTS[(i + 1) % len(TENANTS)].keys))}"}
    for model, stream in (("up", False), ("up", True), ("fake-model", i % 2 == 0)):
        await _ok(await s.post(f"{base}/v1/chat/completions", headers={
            **h, "X-Flowlift-Session": f"s-{i}", "X-Flowlift-Workflow": f"w-{i}"}, json={
            "model": model, "stream": stream,
            "messages": [{"role": "user", "content": f"turn {i} of {model}"}]}))
    await _ok(await s.post(f"{base}/v1/responses", headers=h,
                           json={"model": "up", "input": f"responses {i}"}))
    done = await _ok(await s.post(f"{base}/v1/workflows", headers=h, json={
        "id": f"run-{i}", "nodes": [_llm("a", f"go {i}")]}))
    assert b'"succeeded"' in done, done[-300:]
    opened = await s.post(f"{base}/v1/workflows", headers=h, json={
        "id": f"open-{i}", "open": True, "nodes": [_llm("a", f"open {i}")]})
    await _ok(await s.post(f"{base}/v1/workflows/open-{i}/nodes", headers=h,
                           json={"nodes": [_llm("b", f"more {i}")]}))
    await _ok(await s.post(f"{base}/v1/workflows/open-{i}/close", headers=h))
    assert b'"succeeded"' in await _ok(opened)
    await _ok(await s.get(f"{base}/v1/workflows/run-{i}", headers=h))
    await _ok(await s.get(f"{base}/v1/sessions/s-{i}", headers=h))
    await _ok(await s.get(f"{base}/v1/workflows/run-{i}", headers=other), 404)
    await _ok(await s.get(f"{base}/v1/workflows/w-{i}", headers=other), 404)
    await _ok(await s.get(f"{base}/v1/models",
                          headers={"Authorization": f"Bearer sk-guess-{i}"}), 401)


def tables(app: web.Application) -> dict[str, int]:
    """The named tables the proxy keeps (the run store counted in rows)."""
    state = app[STATE]
    db = state.runs.store._db  # type: ignore[attr-defined]
    return {"sessions": len(app[SESSIONS]), "inferred": len(state.inferred),
            "runs.active": len(state.runs.active), "runs.finished": len(state.runs.finished),
            "store.runs": db.execute("SELECT count(*) FROM runs").fetchone()[0],
            "store.events": db.execute("SELECT count(*) FROM events").fetchone()[0],
            "tenants.buckets": len(state.tenants._buckets),
            "costs": len(state.costs.snapshot())}


def walk(app: web.Application) -> dict[str, int]:
    """Sizes of every container reachable from the proxy's app keys (``sizes``)."""
    return sizes({"state": app[STATE], "sessions": app[SESSIONS], "drain": app[DRAIN],
                  "telemetry": app[TELEMETRY]})


def verdict(samples: list[dict[str, Any]], bound: int) -> list[str]:
    """What went wrong (nothing: a plateau), from the per-minute samples."""
    problems = []
    bounds = {"sessions": bound, "inferred": bound, "runs.finished": bound,
              "runs.active": TENANTS[0].max_active_runs or 64,
              "tenants.buckets": len(TENANTS), "costs": 2}
    for sample in samples:
        problems += [f"{name} = {sample['tables'][name]} > {limit} at {sample['t']:.0f} s"
                     for name, limit in bounds.items() if sample["tables"][name] > limit]
        # the store is pruned at each 5 s sweep: what finished since may be there too
        runs, per_s = sample["tables"]["store.runs"], 2 * sample["rounds"] / sample["t"]
        if runs > bound + sample["tables"]["runs.active"] + 2 * SWEEP_S * per_s:
            problems.append(f"store.runs = {runs} at {sample['t']:.0f} s")
    if len(samples) >= 3:
        mid, end = samples[len(samples) // 2]["walk"], samples[-1]["walk"]
        problems += [f"{path} grew {mid.get(path, 0)} -> {n} over the second half"
                     for path, n in end.items() if n > max(mid.get(path, 0), bound)]
    third = len(samples) // 3
    if third:
        middle, last = samples[third:2 * third], samples[2 * third:]
        rss = [max(x["rss"] for x in part) for part in (middle, last)]
        objs = [max(x["objects"] for x in part) for part in (middle, last)]
        if objs[1] > 1.02 * objs[0] + 1000:
            problems.append(f"live objects peak {objs[0]} -> {objs[1]}")
        if rss[1] > 1.05 * rss[0] + 8.0:
            problems.append(f"RSS peak {rss[0]:.1f} -> {rss[1]:.1f} MiB")
    return problems


async def soak(minutes: float, sample_s: float, bound: int, concurrency: int) -> int:
    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "state.sqlite"
        app, base, runners = await start(bound, db)
        ids = itertools.count()
        samples: list[dict[str, Any]] = []
        t0 = time.monotonic()
        next_at = 0.0
        try:
            async with aiohttp.ClientSession() as s:
                while (now := time.monotonic() - t0) < minutes * 60:
                    await asyncio.gather(*[one_round(s, base, next(ids))
                                           for _ in range(concurrency)])
                    if now >= next_at or time.monotonic() - t0 >= minutes * 60:
                        next_at += sample_s
                        gc.collect()
                        sample = {"t": time.monotonic() - t0, "rounds": next(ids),
                                  "rss": rss_mib(), "objects": len(gc.get_objects()),
                                  "db_mib": sum(p.stat().st_size for p in
                                                Path(folder).glob("state.sqlite*")) / 2**20,
                                  "tables": tables(app), "walk": walk(app)}
                        samples.append(sample)
                        top = sorted(sample["walk"].items(), key=lambda kv: -kv[1])[:4]
                        print(f"{sample['t']:6.0f} s  rounds {sample['rounds']:7d}  "
                              f"RSS {sample['rss']:7.1f} MiB  objects {sample['objects']:8d}"
                              f"  db {sample['db_mib']:6.1f} MiB  {sample['tables']}  "
                              f"largest: {top}", flush=True)
        finally:
            for runner in runners:
                await runner.cleanup()
    rounds = samples[-1]["rounds"] if samples else 0
    third = len(samples) // 3
    print(f"\n{minutes:g} min, {rounds} rounds of unique ids ({rounds * 13} requests, "
          f"{rounds * 2} workflow runs, half of them open runs), bound {bound}")
    if third:
        for label, part in (("middle third", samples[third:2 * third]),
                            ("last third", samples[2 * third:])):
            print(f"  {label}: peak RSS {max(x['rss'] for x in part):.1f} MiB, "
                  f"peak live objects {max(x['objects'] for x in part)}, "
                  f"store {max(x['db_mib'] for x in part):.1f} MiB")
    problems = verdict(samples, bound)
    print("plateau: every table at or under its bound" if not problems
          else "NOT BOUNDED:\n  " + "\n  ".join(problems))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--bound", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8,
                        help="rounds in flight at once")
    parser.add_argument("--log-level", default="warning", help="the proxy's log level")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, json=False)
    return asyncio.run(soak(args.minutes, args.sample_s, args.bound, args.concurrency))


if __name__ == "__main__":
    sys.exit(main())
