"""Per-proxy routing state at 3 proxy replicas (issue 37 item 3): the same agent
sessions through one flowlift proxy, against three proxies each with its own routing
state (in-flight counts, latency models, cache beliefs), over the same fake engine
replicas, side by side in one run.

The engines are simulated (one process, no model): each replica runs ``--slots``
requests at once, first come first served; a request's prefill takes
``prefill_s_per_ktok`` per 1,000 prompt tokens (characters / 4) that its prefix cache
does not hold, its decode ``max_tokens`` steps of ``tpot_s`` slowed by
``batch_slowdown`` per other running request. The prefix cache is keyed by the
conversation's first message (one per session) and holds the last prompt and answer
of it; a request's cached tokens are the common prefix with that text. The cache holds
``--cache-ktok`` thousand tokens per replica, least recently used evicted first (a
session on two replicas takes room on both). Every answer reports
``usage.prompt_tokens_details.cached_tokens``, as vLLM does with
``--enable-prompt-tokens-details``, so each proxy's cache belief learns from it.

Agent sessions: ``--sessions`` of them arrive over ``--ramp-s``; each runs ``--turns``
turns, a turn's prompt being the whole conversation so far plus a new tool result of
``--growth-chars``; between turns the "tool" takes an exponential time of mean
``--tool-s``. Every request carries ``X-Flowlift-Session`` (the proxies' affinity key).

Deployments, per scenario (the replicas' speeds):

* ``one``: one proxy carries every request: one routing state, the reference (what
  sharing the state through the store could at best reach);
* ``3-rr``: three proxies behind a load balancer that sends each request to the next
  proxy (no session stickiness: a Kubernetes Service over keep-alive-less clients);
  each proxy sees a third of the requests and only its own answers;
* ``3-sticky``: three proxies behind a load balancer that hashes the session to a
  proxy (ingress session affinity on the header).

Reported per deployment: the share of later turns served by the replica of the
session's previous turn (affinity hits), the share of later turns' prompt tokens served
from cache, request end-to-end seconds p50/p90, session completion seconds mean, and
requests per replica. Rounds rotate the deployments' order; every deployment starts
fresh (new replicas, empty caches, new proxies).

    .venv/bin/python bench/proxy_replicas.py            # ~4 min
    .venv/bin/python bench/proxy_replicas.py --smoke    # seconds, nothing saved

Writes ``bench/results/proxy_replicas.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import free_port, pct, save
from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE

DEPLOYMENTS = ("one", "3-rr", "3-sticky")
SCENARIOS = {  # replica name -> (prefill s per 1k uncached tokens, s per output token)
    "2 equal": {"a": (0.4, 0.01), "b": (0.4, 0.01)},
    "3 mixed": {"fast1": (0.4, 0.01), "fast2": (0.4, 0.01), "slow": (0.8, 0.02)},
}


@dataclass
class CacheReplica:
    """One simulated engine with a prefix cache (see the module doc)."""

    name: str
    prefill_s_per_ktok: float
    tpot_s: float
    slots: int
    cache_tokens: int
    batch_slowdown: float = 0.05
    running: int = 0
    served: int = 0
    cache: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _slots: asyncio.Semaphore | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    def cached_tokens(self, key: str, prompt: str) -> int:
        """Tokens of ``prompt`` its cached conversation ``key`` covers (0: none)."""
        held = self.cache.get(key)
        if held is None:
            return 0
        self.cache.move_to_end(key)
        return len(os.path.commonprefix([held, prompt])) // 4  # noqa: RUF071 (characters)

    def keep(self, key: str, text: str) -> None:
        """Cache ``text`` as conversation ``key``, evicting the least recently used."""
        self.cache[key] = text
        self.cache.move_to_end(key)
        while sum(len(t) for t in self.cache.values()) // 4 > self.cache_tokens:
            self.cache.popitem(last=False)

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        messages = body["messages"]
        prompt = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        key = str(messages[0]["content"])
        n = int(body.get("max_tokens") or 16)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.slots)
        async with self._slots:
            self.running += 1
            try:
                cached = self.cached_tokens(key, prompt)
                await asyncio.sleep((len(prompt) // 4 - cached) / 1000
                                    * self.prefill_s_per_ktok)
                for _ in range(n):
                    await asyncio.sleep(self.tpot_s * (1 + self.batch_slowdown
                                                       * max(self.running - 1, 0)))
                answer = " ".join(f"{self.name}{self.served}w{i}" for i in range(n))
                self.served += 1
                self.keep(key, prompt + f"<assistant>{answer}")
            finally:
                self.running -= 1
        tokens = len(prompt) // 4
        return web.json_response({
            "id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": answer}}],
            "usage": {"prompt_tokens": tokens, "completion_tokens": n,
                      "total_tokens": tokens + n,
                      "prompt_tokens_details": {"cached_tokens": cached}}})


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class Fleet:
    """The replicas and proxies of one deployment, started; :meth:`close` stops them."""

    replicas: list[CacheReplica]
    proxies: list[str]
    runners: list[web.AppRunner]

    @classmethod
    async def start(cls, scenario: dict[str, tuple[float, float]], proxies: int,
                    a: argparse.Namespace) -> Fleet:
        replicas = [CacheReplica(name, prefill, tpot, a.slots, a.cache_ktok * 1000)
                    for name, (prefill, tpot) in scenario.items()]
        runners, roots = [], []
        for r in replicas:
            runner, root = await _serve(r.app())
            runners.append(runner)
            roots.append(root)
        config = parse_config({
            "backends": {r.name: {"kind": "openai", "base_url": f"{root}/v1",
                                  "max_connections": 256}
                         for r, root in zip(replicas, roots, strict=True)},
            "models": {"m": {"backends": [r.name for r in replicas],
                             "routing": "predicted-latency"}}})
        bases = []
        for _ in range(proxies):
            app = create_app({}, file_config=config)
            runner, base = await _serve(app)
            await app[STATE].ready.wait()
            runners.append(runner)
            bases.append(base)
        return cls(replicas, bases, runners)

    async def close(self) -> None:
        for runner in reversed(self.runners):
            await runner.cleanup()


@dataclass
class Turn:
    session: int
    turn: int
    backend: str
    prompt_tokens: int
    cached_tokens: int
    e2e_s: float


def _proxy_of(deployment: str, session: int, counter: list[int], n: int) -> int:
    if deployment == "3-sticky":
        return session % n
    counter[0] += 1
    return counter[0] % n


async def _session(http: aiohttp.ClientSession, fleet: Fleet, deployment: str, s: int,
                   a: argparse.Namespace, rng: random.Random, counter: list[int],
                   out: list[Turn]) -> float:
    """Run session ``s``'s turns; its completion time, seconds."""
    await asyncio.sleep(rng.uniform(0, a.ramp_s))
    t0 = time.monotonic()
    convo = [{"role": "system", "content": f"session {s}: " + "You are an agent. " * (
        a.system_chars // 18)}]
    for turn in range(a.turns):
        convo.append({"role": "user", "content": f"tool result {turn}: "
                      + rng.choice("abcdefgh") * a.growth_chars})
        base = fleet.proxies[_proxy_of(deployment, s, counter, len(fleet.proxies))]
        started = time.monotonic()
        async with http.post(f"{base}/v1/chat/completions", json={
                "model": "m", "max_tokens": a.max_tokens, "messages": convo},
                headers={"X-Flowlift-Session": f"sess-{s}"}) as resp:
            doc = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {doc}")
            backend = resp.headers.get("X-Flowlift-Backend", "?")
        usage = doc["usage"]
        out.append(Turn(s, turn, backend, usage["prompt_tokens"],
                        usage["prompt_tokens_details"]["cached_tokens"],
                        time.monotonic() - started))
        convo.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
        await asyncio.sleep(rng.expovariate(1 / a.tool_s))
    return time.monotonic() - t0


def summarise(turns: list[Turn], completions: list[float], replicas: list[str]
              ) -> dict[str, Any]:
    """The figures of one deployment's run (see the module doc)."""
    by_session: dict[int, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: (t.session, t.turn)):
        by_session.setdefault(t.session, []).append(t)
    later = [(prev, t) for ts in by_session.values() for prev, t in itertools.pairwise(ts)]
    e2e = [t.e2e_s for t in turns]
    served = Counter(t.backend for t in turns)
    return {
        "affinity_hits": sum(p.backend == t.backend for p, t in later) / len(later),
        "cache_hit_share": (sum(t.cached_tokens for _, t in later)
                            / sum(t.prompt_tokens for _, t in later)),
        "e2e_p50_s": pct(e2e, 50), "e2e_p90_s": pct(e2e, 90),
        "session_mean_s": statistics.fmean(completions),
        "served": {r: served.get(r, 0) for r in replicas},
        "moved_sessions": sum(len({t.backend for t in ts}) > 1
                              for ts in by_session.values()),
    }


async def run_one(scenario: dict[str, tuple[float, float]], deployment: str,
                  a: argparse.Namespace, seed: int) -> dict[str, Any]:
    fleet = await Fleet.start(scenario, 1 if deployment == "one" else 3, a)
    turns: list[Turn] = []
    counter = [0]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            completions = await asyncio.gather(*(
                _session(http, fleet, deployment, s, a, random.Random(seed * 1000 + s),
                         counter, turns) for s in range(a.sessions)))
    finally:
        await fleet.close()
    return summarise(turns, list(completions), list(scenario))


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def table(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = ["| scenario | deployment | affinity hits | cache hit share | e2e p50 s | "
             "e2e p90 s | session mean s | moved sessions | requests per replica |",
             "|---|---|---|---|---|---|---|---|---|"]
    for scenario, per in results.items():
        for deployment, runs in per.items():
            served = Counter[str]()
            for r in runs:
                served.update(r["served"])
            lines.append(
                f"| {scenario} | {deployment} | {_mean(runs, 'affinity_hits'):.3f} | "
                f"{_mean(runs, 'cache_hit_share'):.3f} | {_mean(runs, 'e2e_p50_s'):.3f} | "
                f"{_mean(runs, 'e2e_p90_s'):.3f} | {_mean(runs, 'session_mean_s'):.2f} | "
                f"{_mean(runs, 'moved_sessions'):.1f} | "
                + " / ".join(f"{k} {v // len(runs)}" for k, v in served.items()) + " |")
    return "\n".join(lines)


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    scenarios = {name: SCENARIOS[name] for name in a.scenario}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {d: [] for d in DEPLOYMENTS} for name in scenarios}
    for rnd in range(a.rounds):
        for name, scenario in scenarios.items():
            order = DEPLOYMENTS[rnd % 3:] + DEPLOYMENTS[:rnd % 3]
            for deployment in order:
                r = await run_one(scenario, deployment, a, seed=rnd)
                results[name][deployment].append(r)
                print(f"round {rnd} {name} {deployment}: " + ", ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in r.items()), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--ramp-s", type=float, default=3.0)
    p.add_argument("--tool-s", type=float, default=0.3)
    p.add_argument("--system-chars", type=int, default=1600)
    p.add_argument("--growth-chars", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--cache-ktok", type=float, default=14.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                   help="the replicas' speeds (repeatable; default: all)")
    p.add_argument("--smoke", action="store_true", help="seconds; nothing saved")
    a = p.parse_args()
    a.scenario = a.scenario or list(SCENARIOS)
    if a.smoke:
        a.sessions, a.turns, a.ramp_s, a.tool_s, a.rounds = 4, 2, 0.1, 0.01, 1
        a.scenario = a.scenario[:1]
    results = asyncio.run(main_async(a))
    print(table(results))
    save("proxy_replicas", {"args": vars(a), "results": results}, smoke=a.smoke)


if __name__ == "__main__":
    main()
