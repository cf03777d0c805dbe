"""Service tiers under one deadline: a 7-stage pipeline over 1,000 items, 24 hours.

A simulation in simulated time on the fake Batch API
(:class:`flowlift.testing.FakeBatchAPI`, served over HTTP on localhost, driven by
flowlift's batch client :class:`flowlift.proxy.dispatch.batch.api.BatchClient`). The fake's
clock is a virtual clock the simulation advances (the client's polling sleeps, 2 to 15
simulated minutes apart, and the calls' simulated durations), not a scaled wall clock: a
scaled wall clock on a shared 2-core machine stretched simulated time by whatever the
machine was doing. Three strategies, each over ``--runs`` runs, one after another:

* ``stagewise``: every stage is one batch, submitted when the previous stage's batch
  ends (lines that failed or expired go into another batch of the same stage);
* ``standard``: every call on the standard tier (64 in flight);
* ``flowlift``: before each stage the planner (:func:`flowlift.tiers.plan_tiers`) picks
  the stage's tier from the slack left (batch, flex or standard; turnaround p50/p90
  learned across runs by :class:`flowlift.tiers.TurnaroundBook`, priors 7 min / 1 h);
  the watchdog (:func:`flowlift.tiers.must_move`) cancels a batch whose stage reached
  its latest start and sends the lines still missing to standard (lines the batch
  finished are kept, and billed at the batch price); failed and malformed lines are
  retried on standard at once; a flex call answered 429 moves to standard.

Batch turnaround: a log-normal with OpenRouter's published median (7 min) and 90th
percentile (1 h) over 230k batches, plus a tail: with probability ``--tail-share``
(default 0.02) a batch draws log-uniformly between 1 h and 24.5 h (past 24 h it expires;
the published figures say there is a tail to the 24-hour limit but not how heavy). Per
line: 0.5% fail with a 500, 0.2% come back malformed (``status_code: 0``). Standard
call latency: log-normal, median 4 s, p90 12 s; flex: median 20 s, p90 2 min, 10% of
calls answered 429 (capacity). Prices per 1k tokens: standard 1.0 in / 4.0 out; flex
and batch half. 800 prompt and 200 completion tokens per call.

    .venv/bin/python bench/tiers.py                  # 200 runs x 3 strategies, 1,000 items
    .venv/bin/python bench/tiers.py --smoke          # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiohttp.test_utils import TestServer

from flowlift.proxy.config import BatchSpec
from flowlift.proxy.dispatch.batch.api import Advice, BatchClient, BatchLine, Outcome, pack
from flowlift.testing import MALFORMED, FakeBatchAPI, LineError, lognormal_turnaround
from flowlift.tiers import StepEstimate, TierProfile, TurnaroundBook, must_move, plan_tiers

HOUR = 3600.0
IN_TOK, OUT_TOK = 800, 200
STANDARD = TierProfile("standard", 1.0, 4.0)
FLEX_CALL = (20.0, 120.0)  # one flex call's latency: median, p90 (s)
FLEX_PRIOR = (900.0, 1800.0)  # a flex stage's time over the standard estimate: p50, p90
BATCH_PRIOR = (420.0, 3600.0)


@dataclass
class Setup:
    items: int
    stages: int
    deadline_s: float
    concurrency: int = 64
    guard_s: float = 600.0  # the watchdog moves a batch this long before its latest start
    batch_margin_s: float = HOUR
    flex_margin_s: float = 300.0
    fast_stage_s: float = 0.0  # the planner's estimate of a stage on standard

    def __post_init__(self) -> None:
        # p90 of a standard stage: waves of `concurrency` calls, ~p90 latency each
        self.fast_stage_s = math.ceil(self.items / self.concurrency) * 12.0 + 30.0


@dataclass
class Result:
    strategy: str
    makespan_s: float
    cost: float
    standard_cost: float
    tiers: list[str] = field(default_factory=list)
    moved_lines: int = 0
    stage_ends_h: list[float] = field(default_factory=list)


class WatchdogFired(Exception):
    """The watchdog's time came while a batch was still running."""


class VirtualClock:
    """Simulated seconds: the fake server's clock, advanced by the simulation itself
    (the batch client's polling sleeps advance it), so a day takes no real time and a
    busy machine cannot stretch it. ``watch_at``: a sleep that would pass it stops
    there and raises :class:`WatchdogFired`."""

    def __init__(self) -> None:
        self.t = 0.0
        self.watch_at: float | None = None

    def __call__(self) -> float:
        return self.t

    def now(self) -> float:
        return self.t

    async def sleep(self, sim_s: float) -> None:
        if self.watch_at is not None and self.t + sim_s >= self.watch_at:
            self.t = max(self.t, self.watch_at)
            raise WatchdogFired
        self.t += max(sim_s, 0.0)
        await asyncio.sleep(0)


def _lognormal(rng: random.Random, median: float, p90: float) -> float:
    sigma = (math.log(p90) - math.log(median)) / 1.2815515655446004
    return rng.lognormvariate(math.log(median), sigma)


def lanes_duration(latencies: list[float], concurrency: int) -> float:
    """Makespan of calls run ``concurrency`` at a time, in order."""
    free = [0.0] * min(concurrency, max(len(latencies), 1))
    for x in latencies:
        heapq.heappush(free, heapq.heappop(free) + x)
    return max(free, default=0.0)


def call_cost(tier: str, calls: int) -> float:
    price = 1.0 if tier == "standard" else 0.5
    return price * calls * (IN_TOK * STANDARD.input_price_per_1k
                            + OUT_TOK * STANDARD.output_price_per_1k) / 1000.0


class Sim:
    def __init__(self, setup: Setup, client: BatchClient, clock: VirtualClock,
                 seed: int) -> None:
        self.setup, self.client, self.clock = setup, client, clock
        self.rng = random.Random(seed)
        self.book = TurnaroundBook({"batch": BATCH_PRIOR, "flex": FLEX_PRIOR},
                                   min_observations=30)

    # -- the tiers as the simulation runs them ------------------------------------------
    async def standard(self, calls: int) -> float:
        lat = [_lognormal(self.rng, 4.0, 12.0) for _ in range(calls)]
        await self.clock.sleep(lanes_duration(lat, self.setup.concurrency))
        return call_cost("standard", calls)

    async def flex(self, calls: int) -> float:
        busy = sum(1 for _ in range(calls) if self.rng.random() < 0.10)
        lat = [_lognormal(self.rng, *FLEX_CALL) for _ in range(calls - busy)]
        flex_s = lanes_duration(lat, self.setup.concurrency)
        await self.clock.sleep(flex_s)
        # what the planner needs is the stage's time on flex over its standard estimate
        self.book.observe("flex", max(flex_s - self.setup.fast_stage_s, 0.0))
        cost = call_cost("flex", calls - busy)
        if busy:  # capacity 429s move to standard: accounted at the tier that served them
            cost += await self.standard(busy)
        return cost

    async def batch(self, run: int, stage: int, items: list[int],
                    watch_at: float | None) -> tuple[float, list[int], int]:
        """Submit ``items`` as one stage's batch; wait until it ends or ``watch_at``
        (simulated seconds; then cancel). Returns (cost, items still to do, lines moved)."""
        lines = [BatchLine(f"r{run}:s{stage}-{i}:1", {"model": "m", "messages": [
            {"role": "user", "content": f"{run} {stage} {i}"}]}) for i in items]
        ids: dict[str, int] = {}
        subs = []
        for file in pack(lines):
            file_id = await self.client.upload(file.data)
            batch = await self.client.create(file_id)
            subs.append((str(batch["id"]), file.custom_ids))
            ids.update({c: int(c.rsplit("-", 1)[1].split(":")[0]) for c in file.custom_ids})
        cost, todo, moved = 0.0, [], 0
        for batch_id, cids in subs:
            final = await self._wait(batch_id, watch_at)
            if final is None:  # the watchdog: cancel, keep what finished
                await self.client.cancel(batch_id)
                final = await self.client.wait(batch_id)
            else:
                self.book.observe("batch", _turnaround(final))
            outcomes = await self.client.outcomes(final, cids)
            done = sum(1 for o in outcomes.values() if o.advice is Advice.ACCEPT)
            cost += call_cost("batch", done)
            todo += [ids[c] for c, o in outcomes.items() if o.advice is not Advice.ACCEPT]
            moved += sum(1 for o in outcomes.values() if _late(o))
        return cost, todo, moved

    async def _wait(self, batch_id: str, watch_at: float | None) -> dict[str, Any] | None:
        self.clock.watch_at = watch_at
        try:
            return await self.client.wait(batch_id)
        except WatchdogFired:
            return None
        finally:
            self.clock.watch_at = None

    # -- strategies ---------------------------------------------------------------------
    async def run_standard(self, run: int) -> Result:
        t0, cost = self.clock.now(), 0.0
        for _ in range(self.setup.stages):
            cost += await self.standard(self.setup.items)
        return Result("standard", self.clock.now() - t0, cost, cost,
                      ["standard"] * self.setup.stages)

    async def run_stagewise(self, run: int) -> Result:
        t0, cost = self.clock.now(), 0.0
        for stage in range(self.setup.stages):
            todo = list(range(self.setup.items))
            while todo:
                spent, todo, _ = await self.batch(run, stage, todo, None)
                cost += spent
        base = self.setup.stages * call_cost("standard", self.setup.items)
        return Result("stagewise", self.clock.now() - t0, cost, base,
                      ["batch"] * self.setup.stages)

    def tiers(self) -> list[TierProfile]:
        batch = self.book.profile(TierProfile("batch", 0.5, 2.0,
                                              margin_s=self.setup.batch_margin_s))
        flex = self.book.profile(TierProfile("flex", 0.5, 2.0,
                                             margin_s=self.setup.flex_margin_s))
        return [STANDARD, flex, batch]

    async def run_flowlift(self, run: int) -> Result:
        s = self.setup
        t0, cost, chosen, moved = self.clock.now(), 0.0, [], 0
        ends: list[float] = []
        for stage in range(s.stages):
            now = self.clock.now() - t0
            steps = [StepEstimate(f"s{k}", frozenset({f"s{k - 1}"} if k > stage else ()),
                                  s.fast_stage_s, IN_TOK * s.items, OUT_TOK * s.items)
                     for k in range(stage, s.stages)]
            plan = plan_tiers(steps, s.deadline_s, self.tiers(), now_s=now)
            step = plan.steps[f"s{stage}"]
            chosen.append(step.tier)
            todo = list(range(s.items))
            if step.tier == "batch":
                watch_at = t0 + step.latest_start_s - s.guard_s
                assert not must_move(now, step, s.guard_s)
                spent, todo, late = await self.batch(run, stage, todo, watch_at)
                cost += spent
                moved += late
                if todo:  # failed, malformed or late lines: a cheap retry, faster tier
                    cost += await self.standard(len(todo))
            elif step.tier == "flex":
                cost += await self.flex(len(todo))
            else:
                cost += await self.standard(len(todo))
            ends.append(round((self.clock.now() - t0) / HOUR, 2))
        base = s.stages * call_cost("standard", s.items)
        return Result("flowlift", self.clock.now() - t0, cost, base, chosen, moved, ends)


def _late(outcome: Outcome) -> bool:
    return outcome.kind in ("cancelled", "expired")


def _turnaround(batch: dict[str, Any]) -> float:
    from flowlift.proxy.dispatch.batch.pool import turnaround_s
    return turnaround_s(batch)


def responder(rng: random.Random) -> Callable[[dict[str, Any]], Any]:
    def answer(body: dict[str, Any]) -> Any:
        x = rng.random()
        if x < 0.005:
            return LineError(500, "server_error", "upstream failure")
        if x < 0.007:
            return MALFORMED
        return "ok"
    return answer


async def simulate(args: argparse.Namespace) -> dict[str, Any]:
    setup = Setup(args.items, args.stages, args.deadline_h * HOUR)
    rng = random.Random(args.seed)
    clock = VirtualClock()
    api = FakeBatchAPI(responder=responder(rng), clock=clock, seed=args.seed,
                       turnaround=lognormal_turnaround(tail_share=args.tail_share,
                                                       cap_s=24.5 * HOUR))
    server = TestServer(api.app())
    await server.start_server()
    spec = BatchSpec(kind="openai-batch", base_url=str(server.make_url("/v1")),
                     poll_initial_s=120.0, poll_max_s=900.0)  # simulated seconds
    client = BatchClient(spec, sleep=clock.sleep)
    out: dict[str, list[Result]] = {}
    try:
        for strategy in args.strategies.split(","):
            sim = Sim(setup, client, clock, args.seed)
            runner: Callable[[int], Awaitable[Result]] = getattr(sim, f"run_{strategy}")
            started = time.monotonic()
            out[strategy] = [await runner(r) for r in range(args.runs)]
            print(f"{strategy}: {args.runs} runs in {time.monotonic() - started:.1f} s real",
                  file=sys.stderr)
    finally:
        await client.aclose()
        await server.close()
    drawn = sorted(b.turnaround_s for b in api.batches.values())
    return summarize(setup, out, drawn, args)


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else 0.0


def summarize(setup: Setup, out: dict[str, list[Result]], drawn: list[float],
              args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for name, results in out.items():
        spans = [r.makespan_s / HOUR for r in results]
        tiers: dict[str, int] = {}
        for r in results:
            for t in r.tiers:
                tiers[t] = tiers.get(t, 0) + 1
        rows[name] = {
            "cost_vs_standard": round(sum(r.cost for r in results)
                                      / sum(r.standard_cost for r in results), 3),
            "worst_run_cost_vs_standard": round(max(r.cost / r.standard_cost
                                                    for r in results), 3),
            "makespan_h": {"p50": round(_q(spans, 0.5), 2), "p90": round(_q(spans, 0.9), 2),
                           "p99": round(_q(spans, 0.99), 2), "max": round(max(spans), 2)},
            "deadline_misses": sum(1 for r in results if r.makespan_s > setup.deadline_s),
            "stage_tiers": tiers,
            "lines_moved_by_watchdog": sum(r.moved_lines for r in results),
            "missed": [{"tiers": r.tiers, "stage_ends_h": r.stage_ends_h}
                       for r in results if r.makespan_s > setup.deadline_s]}
    return {"items": setup.items, "stages": setup.stages, "runs": args.runs,
            "deadline_h": args.deadline_h,
            "tail_share": args.tail_share, "seed": args.seed,
            "batch_turnaround_drawn_min": {
                "n": len(drawn), "p50": round(_q(drawn, 0.5) / 60, 1),
                "p90": round(_q(drawn, 0.9) / 60, 1), "max": round(max(drawn) / 60, 1),
                "expired": sum(1 for d in drawn if d > 24 * HOUR)} if drawn else {},
            "strategies": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=1000)
    p.add_argument("--stages", type=int, default=7)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--deadline-h", type=float, default=24.0)
    p.add_argument("--tail-share", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--strategies", default="standard,stagewise,flowlift")
    p.add_argument("--smoke", action="store_true",
                   help="20 items, 6 runs, no heavy tail: seconds")
    p.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    args = p.parse_args()
    if args.smoke:
        args.items, args.runs, args.tail_share = 20, 6, 0.0
    summary = asyncio.run(simulate(args))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
