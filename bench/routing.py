"""Routing among replicas of different speeds: predicted-latency vs least-loaded vs
round-robin, side by side in one run, through the real proxy.

Three fake replicas of one model (``bench/fake_replicas.py``, one process, each a
simulated engine with a batch of ``--slots``, a queue, prefill per uncached prompt
token, a prefix cache keyed by the request's ``user``, decode slowing down as the
batch fills): ``fast``; ``slow`` (3x the prefill and per-token time); ``flaky`` (as fast,
but ``--flaky-errors`` of its requests fail with a 500 after 50 ms, which the proxy
retries on another replica). Listed to the proxy in that order.

One ``flowlift serve --engine none`` per strategy (``[models.m] routing = ...``), all
started before measuring. Load is open-loop: Poisson arrivals at ``--rate`` per second
(the same arrival times and requests for every strategy in a round), each a streamed
chat completion of ``--prompt-chars`` characters and ``--max-tokens`` output tokens;
``--session-share`` of them belong to one of ``--sessions`` agent sessions
(``X-Flowlift-Session``, and the session as ``user`` so the fake's prefix cache sees
it). Rounds rotate the order of the strategies; each strategy's proxy gets a warm-up
of ``--warmup`` sequential requests first.

Reported per strategy: end-to-end time (arrival to the last byte) p50, p99 and mean,
errors (a non-200 answer or a stream without its end), the share each replica served
(``X-Flowlift-Backend``).

    .venv/bin/python bench/routing.py            # ~4 min: 2 scenarios x 3 rounds
    .venv/bin/python bench/routing.py --smoke    # seconds, nothing saved

Writes ``bench/results/routing.json`` (``--tag T``: ``routing.T.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import free_port, pct, save
from flowlift.testing import running_proxy

BENCH = Path(__file__).resolve().parent
STRATEGIES = ("predicted-latency", "least-loaded", "round-robin")


def replica_specs(a: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    """(name, prefill s per 1,000 tokens, TPOT s, error rate) of fast, slow, flaky."""
    return [("fast", a.prefill_s, a.tpot_s, 0.0),
            ("slow", 3 * a.prefill_s, 3 * a.tpot_s, 0.0),
            ("flaky", a.prefill_s, a.tpot_s, a.flaky_errors)]


def config_toml(ports: dict[str, int], strategy: str) -> str:
    lines = []
    for name, port in ports.items():
        lines += [f"[backends.{name}]", 'kind = "openai"',
                  f'base_url = "http://127.0.0.1:{port}/v1"', "max_connections = 256", ""]
    lines += ["[models.m]", f"backends = {list(ports)!r}".replace("'", '"'),
              f'routing = "{strategy}"', "max_attempts = 4", ""]
    return "\n".join(lines)


def wait_port(port: int, timeout_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"fake replica on port {port} did not start")
        time.sleep(0.1)


def workload(a: argparse.Namespace, seed: int) -> list[tuple[float, str | None]]:
    """(arrival s from the start, session or None) of one round's requests."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(a.requests):
        t += rng.expovariate(a.rate)
        session = (f"s{rng.randrange(a.sessions)}" if rng.random() < a.session_share
                   else None)
        out.append((t, session))
    return out


async def one(http: aiohttp.ClientSession, base: str, a: argparse.Namespace,
              session: str | None, body_text: str) -> tuple[bool, str | None]:
    """(ok, the backend that answered) of one streamed request."""
    body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": a.max_tokens,
                            "messages": [{"role": "user", "content": body_text}]}
    headers = {}
    if session is not None:
        body["user"] = session
        headers["X-Flowlift-Session"] = session
    try:
        async with http.post(f"{base}/v1/chat/completions", json=body,
                             headers=headers) as resp:
            data = await resp.read()
            ok = resp.status == 200 and data.rstrip().endswith(b"[DONE]") \
                and b'"error"' not in data
            return ok, resp.headers.get("X-Flowlift-Backend")
    except (aiohttp.ClientError, TimeoutError):
        return False, None


async def run_load(http: aiohttp.ClientSession, base: str, a: argparse.Namespace,
                   arrivals: list[tuple[float, str | None]]) -> dict[str, Any]:
    text = ("lorem ipsum " * (a.prompt_chars // 12 + 1))[:a.prompt_chars]
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.05
    results: list[tuple[float, bool, str | None]] = []

    async def fire(at: float, session: str | None) -> None:
        await asyncio.sleep(max(t0 + at - loop.time(), 0.0))
        ok, backend = await one(http, base, a, session, text)
        results.append((loop.time() - (t0 + at), ok, backend))

    await asyncio.gather(*(fire(at, s) for at, s in arrivals))
    return {"e2e_s": [r[0] for r in results], "errors": sum(not r[1] for r in results),
            "served": Counter(r[2] or "none" for r in results)}


def summary(parts: list[dict[str, Any]]) -> dict[str, Any]:
    e2e = [t for p in parts for t in p["e2e_s"]]
    served: Counter[str] = Counter()
    for p in parts:
        served.update(p["served"])
    n = len(e2e)
    return {"requests": n, "p50_ms": round(pct(e2e, 50) * 1000, 1),
            "p99_ms": round(pct(e2e, 99) * 1000, 1),
            "mean_ms": round(sum(e2e) / max(n, 1) * 1000, 1),
            "errors": sum(p["errors"] for p in parts),
            "served_share": {k: round(v / max(n, 1), 3) for k, v in sorted(served.items())}}


async def measure(a: argparse.Namespace, bases: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        for base in bases.values():  # warm-up: the replicas' speeds are learned
            for _ in range(a.warmup):
                await one(http, base, a, None, "warm up")
        for share in a.session_share_list:
            a.session_share = share
            parts: dict[str, list[dict[str, Any]]] = {s: [] for s in bases}
            for r in range(a.rounds):
                arrivals = workload(a, seed=1000 * r + int(share * 100))
                order = list(bases)[r % len(bases):] + list(bases)[:r % len(bases)]
                for strategy in order:
                    parts[strategy].append(await run_load(http, bases[strategy], a, arrivals))
                    await asyncio.sleep(a.pause_s)  # queues drained, nothing carries over
            scenario = {s: summary(p) for s, p in parts.items()}
            out[f"session_share_{share}"] = scenario
            print(table(scenario, share), flush=True)
    return out


def table(scenario: dict[str, Any], share: float) -> str:
    rows = [f"session share {share}:",
            f"  {'strategy':<18} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'errors':>6}"
            "  served (fast/slow/flaky)"]
    for s, r in scenario.items():
        sh = r["served_share"]
        rows.append(f"  {s:<18} {r['p50_ms']:>8} {r['p99_ms']:>8} {r['mean_ms']:>8} "
                    f"{r['errors']:>6}  {sh.get('fast', 0):.2f}/{sh.get('slow', 0):.2f}/"
                    f"{sh.get('flaky', 0):.2f}")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="a few requests, nothing saved (tests/project/test_bench_smoke.py)")
    p.add_argument("--rate", type=float, default=20.0, help="arrivals per second")
    p.add_argument("--requests", type=int, default=200, help="per strategy per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--session-share", default="0,0.5",
                   help="scenarios: the share of requests in sessions, comma-separated")
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--prompt-chars", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prefill-s", type=float, default=0.04,
                   help="fast replica: prefill seconds per 1,000 uncached prompt tokens")
    p.add_argument("--tpot-s", type=float, default=0.008, help="fast replica: s per token")
    p.add_argument("--flaky-errors", type=float, default=0.15)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--pause-s", type=float, default=1.0)
    p.add_argument("--tag", default="", help="results in bench/results/routing.<tag>.json")
    a = p.parse_args()
    if a.smoke:
        a.requests, a.rounds, a.warmup, a.rate, a.pause_s = 12, 1, 3, 20.0, 0.1
        a.session_share = "0.5"
    a.session_share_list = [float(x) for x in a.session_share.split(",")]
    specs = replica_specs(a)
    ports = {name: free_port() for name, *_ in specs}
    cmd = [sys.executable, str(BENCH / "fake_replicas.py"), "--slots", str(a.slots)]
    for name, prefill, tpot, errors in specs:
        cmd += ["--replica", f"{name}:{ports[name]}:{prefill}:{tpot}:{errors}"]
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        fake = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        stack.callback(fake.wait)
        stack.callback(fake.terminate)
        for port in ports.values():
            wait_port(port)
        bases = {}
        for strategy in STRATEGIES:
            cfg = Path(tmp) / f"{strategy}.toml"
            cfg.write_text(config_toml(ports, strategy))
            base, _ = stack.enter_context(running_proxy(
                "--engine", "none", "--config", str(cfg), "--state-db", ":memory:",
                "--log-level", "warning", log_path=Path(tmp) / f"{strategy}.log",
                ready_timeout_s=120))
            bases[strategy] = base
        results = asyncio.run(measure(a, bases))
    save("routing" + (f".{a.tag}" if a.tag else ""), {"command": " ".join(sys.argv), "replicas": [
        {"name": n, "prefill_s_per_ktok": pf, "tpot_s": tp, "error_rate": e}
        for n, pf, tp, e in specs], "rate_per_s": a.rate, "requests": a.requests,
        "rounds": a.rounds, "prompt_chars": a.prompt_chars, "max_tokens": a.max_tokens,
        "slots": a.slots, "results": results}, smoke=a.smoke)


if __name__ == "__main__":
    main()
