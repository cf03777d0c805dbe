"""flowlift against a stock vLLM server, head to head (issue 35, P5 and P7).

The harness starts both servers itself with the same engine arguments
(:mod:`bench.peers.servers`; versions and command lines printed and saved) and runs the
agent-session workload of :mod:`bench.peers.workload` on each:

* **P5** (``--p5 6 35``): one session of 6, then of 35 turns, streamed; the two sides'
  turns interleaved (which side goes first alternates per turn), so machine noise hits
  both alike. Per side: per-turn latency and TTFT (median, p90), the whole session,
  cached tokens; ratios stock / flowlift.
* **P7** (``--p7 16 32``): that many concurrent sessions of 6-35 turns, tool waits
  drawn from 0.2-3 s, arriving ``--arrival-gap-s`` apart; every arm gets the same plan,
  all arms at the same time (``--together``, the default: the shared machine's noise
  hits all alike, and each engine has the cores half the time) or one after another
  (``--no-together``, the order alternating per size). Per arm: mean / p50 / p90
  session time, makespan, turns/s, prompt, cached and re-prefilled tokens, cached
  share; ratios stock / arm.

Arms (``--arms``): ``stock`` (vLLM's OpenAI server), ``flowlift`` (``flowlift serve``,
its defaults), ``flowlift_ws`` (``--working-set``: with the KV working-set admission
of :mod:`flowlift.proxy.dispatch.slots.working_set`, on by default since issue 35's
second round), ``flowlift_lru`` (``--no-working-set``: vLLM's LRU alone) and
``upstream_ws`` (``flowlift serve --engine none --working-set`` in front of its own
stock vLLM server, whose KV cache it reads from ``/metrics``) and ``flowlift_agent``
(P7 c: ``flowlift serve``'s defaults, each session one agent step whose tool runs on
the proxy, :mod:`bench.peers.agent_arm`; its turns' answers are forced tool calls, so
``--agent-max-tokens``). P5 runs the first two chat arms. The runs in
bench/RESULTS.md (issue 35) ran ``flowlift`` while the working set was on by default.

    .venv/bin/python bench/peers/run.py [--p5 6 35] [--p7 16 32] [--kv-cache-gib 1]
    .venv/bin/python bench/peers/run.py --smoke  # seconds: fake engines on both sides

``--smoke`` runs the same code on two ``flowlift serve --engine fake`` (the stock side's
stand-in: no vLLM starts), P5 of 3 turns and P7 of 4 short sessions, writing nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import RESULTS, pct, save
from bench.peers import agent_arm, servers, workload

ARMS: dict[str, tuple[str, ...] | None] = {
    "stock": None, "flowlift": (), "flowlift_ws": ("--working-set",),
    "upstream_ws": ("--working-set",), "flowlift_lru": ("--no-working-set",),
    "flowlift_agent": ()}
"""Arm -> its ``flowlift serve`` flags (None: the stock vLLM server)."""
AGENT_ARMS = frozenset({"flowlift_agent"})
"""Arms whose sessions are agent steps with proxy tools (:mod:`bench.peers.agent_arm`),
not chat turns."""
UPSTREAM_ARMS = frozenset({"upstream_ws"})
"""Arms that are ``flowlift serve --engine none`` in front of their own stock vLLM
server (started beside the stock arm's, with the same arguments)."""


# -- P5: one session, turns interleaved ---------------------------------------------------

async def p5_session(bases: dict[str, tuple[str, str]], turns: int,
                     max_tokens: int) -> dict[str, Any]:
    """One ``turns``-turn session on every side, turn by turn, the order rotating."""
    sides = list(bases)
    convo = {s: workload.first_messages(f"p5-{s}-{turns}") for s in sides}
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    async with contextlib.AsyncExitStack() as stack:
        clients = {s: await stack.enter_async_context(
            httpx.AsyncClient(base_url=b, timeout=900)) for s, (b, _) in bases.items()}
        for n in range(turns):
            order = sides if n % 2 == 0 else sides[::-1]
            for s in order:
                sid = f"p5-{s}-{turns}"
                out = await workload.turn(clients[s], bases[s][1], convo[s], max_tokens,
                                          sid, stream=True)
                prev = rows[s][-1] if rows[s] else None
                out["reusable_tokens"] = (prev["prompt_tokens"] + prev["completion_tokens"]
                                          if prev else 0)
                rows[s].append({k: v for k, v in out.items() if k != "text"})
                convo[s] = workload.advance(convo[s], out["text"], n)
    out: dict[str, Any] = {}
    for s in sides:
        lat = [r["latency_s"] for r in rows[s]]
        ttft = [r["ttft_s"] for r in rows[s]]
        out[s] = {"session_s": round(sum(lat), 3),
                  "turn_p50_s": round(statistics.median(lat), 3),
                  "turn_p90_s": round(pct(lat, 90), 3),
                  "ttft_p50_s": round(statistics.median(ttft), 3),
                  "last_turn": {k: rows[s][-1][k] for k in ("prompt_tokens", "cached_tokens")},
                  **workload.token_totals(rows[s]), "turns": rows[s]}
    if "stock" in out:
        for s in sides:
            if s != "stock":
                a, b = out["stock"], out[s]
                out[f"stock_over_{s}"] = {
                    k: round(a[k] / b[k], 3) if b[k] else None
                    for k in ("session_s", "turn_p50_s", "turn_p90_s", "ttft_p50_s")}
    return out


# -- P7: concurrent sessions, one arm after another ------------------------------------

def p7_plan(sessions: int, args: argparse.Namespace) -> list[workload.SessionPlan]:
    """The seeded plan of ``sessions`` sessions, the same for every arm."""
    return workload.plan(sessions, seed=args.seed, arrival_gap_s=args.arrival_gap_s,
                         tool_s=(args.tool_min_s, args.tool_max_s), tag=f"p7x{sessions}-",
                         turns=args.turns)


def p7(bases: dict[str, tuple[str, str]], sessions: int, args: argparse.Namespace,
       flip: bool) -> dict[str, Any]:
    """``sessions`` concurrent sessions on each arm in turn (reversed when ``flip``)."""
    plans = p7_plan(sessions, args)
    result: dict[str, Any] = {"plan": [(p.sid, p.arrival_s, p.turns) for p in plans],
                              "order": [], "summary": {}, "sessions": {}}
    runs: dict[str, list[dict[str, Any]]] = {}
    arms = list(bases)[::-1] if flip else list(bases)

    def tagged(arm: str) -> list[workload.SessionPlan]:
        return [workload.SessionPlan(f"{arm}-{p.sid}", p.arrival_s, p.tool_waits_s)
                for p in plans]

    async def one(arm: str) -> list[dict[str, Any]]:
        base, model = bases[arm]
        if arm in AGENT_ARMS:  # the plan's own ids name the sessions' tools
            return await agent_arm.run_sessions(base, model, plans, arm,
                                                args.agent_max_tokens)
        return await workload.run_sessions(base, model, tagged(arm), args.max_tokens)

    async def together() -> list[list[dict[str, Any]]]:
        return list(await asyncio.gather(*(one(a) for a in arms)))

    cpu0 = {a: servers.cpu_seconds(bases[a][0]) for a in arms}
    t0 = time.monotonic()
    if args.together:  # every arm at once: the machine's noise hits all alike
        runs = dict(zip(arms, asyncio.run(together()), strict=True))
        result["order"] = ["together"]
    for arm in arms:
        if not args.together:
            t0 = time.monotonic()
            runs[arm] = asyncio.run(one(arm))
            result["order"].append(arm)
        got = runs[arm]
        result["summary"][arm] = s = workload.summarize(got)
        cpu = servers.cpu_seconds(bases[arm][0])
        if cpu is not None and cpu0[arm] is not None and s["turns_done"]:
            # the server's processes (front end and engine core), while this ran
            s["server_cpu_s"] = round(cpu - cpu0[arm], 1)
            s["server_cpu_ms_per_turn"] = round(1000 * (cpu - cpu0[arm]) / s["turns_done"])
        if ARMS[arm] is not None:  # flowlift's own view: programs, working set
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ready = httpx.get(f"{bases[arm][0]}/readyz", timeout=30).json()
                s["server"] = {k: ready.get(k) for k in ("programs", "working_set")}
        if arm in AGENT_ARMS:
            s["agent"] = agent_arm.turn_counts(got)
        result["sessions"][arm] = [{k: v for k, v in x.items() if k != "rows"} for x in got]
        print(f"  P7 x{sessions} {arm:13s} mean {s['mean_s']} p50 {s['p50_s']} p90 "
              f"{s['p90_s']} makespan {s['makespan_s']} turns/s {s['turns_per_s']} cached "
              f"{s['cached_share']} re-prefilled {s['reprefilled_tokens']} errors "
              f"{len(s['errors'])} server CPU {s.get('server_cpu_s')} s "
              f"{s.get('agent') or ''}"
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    stock = result["summary"].get("stock")
    if stock:
        result["stock_over"] = {
            arm: {"mean": round(stock["mean_s"] / s["mean_s"], 2),
                  "p90": round(stock["p90_s"] / s["p90_s"], 2),
                  "turns_per_s": round(s["turns_per_s"] / stock["turns_per_s"], 2)
            if stock["turns_per_s"] else None}
            for arm, s in result["summary"].items() if arm != "stock"}
    return result


def markdown(results: dict[str, Any]) -> str:
    """The P5 and P7 tables."""
    lines = []
    for key, r in results.items():
        if key.startswith("p5_"):
            lines += ["", f"P5, {key[3:]} turns:", "", "| side | session (s) | turn p50 / "
                      "p90 (s) | TTFT p50 (s) | cached / prompt tokens |", "|---|---|---|---|---|"]
            lines += [f"| {s} | {v['session_s']} | {v['turn_p50_s']} / {v['turn_p90_s']} | "
                      f"{v['ttft_p50_s']} | {v['cached_tokens']} / {v['prompt_tokens']} |"
                      for s, v in r.items() if isinstance(v, dict) and "turns" in v]
        if key.startswith("p7_"):
            lines += ["", f"P7, {key[3:]} sessions (order {' then '.join(r['order'])}):", "",
                      "| arm | mean / p50 / p90 session (s) | makespan (s) | turns/s | "
                      "re-prefilled tokens | cached share | stock / arm (mean, p90) |",
                      "|---|---|---|---|---|---|---|"]
            for arm, s in r["summary"].items():
                ratio = r.get("stock_over", {}).get(arm, {})
                lines.append(f"| {arm} | {s['mean_s']} / {s['p50_s']} / {s['p90_s']} | "
                             f"{s['makespan_s']} | {s['turns_per_s']} | "
                             f"{s['reprefilled_tokens']} | {s['cached_share']} | "
                             f"{ratio.get('mean', '-')}, {ratio.get('p90', '-')} |")
            lines += [f"\n{arm}: {s['agent']}" for arm, s in r["summary"].items()
                      if "agent" in s]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--p5", type=int, nargs="*", default=[6, 35], help="P5 session lengths")
    p.add_argument("--p7", type=int, nargs="*", default=[16, 32], help="P7 session counts")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=["stock", "flowlift"])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the "
                   "converted SmolLM2-135M-Instruct in the cache)")
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--kv-cache-blocks", type=int, default=None,
                   help="a cache of exactly N blocks on both sides (smaller than a GiB)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--agent-max-tokens", type=int, default=40,
                   help="flowlift_agent's max_tokens per turn: a forced tool call is "
                        "~20 tokens of JSON, and a call cut off is a turn run again")
    p.add_argument("--arrival-gap-s", type=float, default=0.2)
    p.add_argument("--tool-min-s", type=float, default=0.2)
    p.add_argument("--tool-max-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env", nargs="*", default=[], metavar="K=V",
                   help="more environment for both servers (the same on both sides)")
    p.add_argument("--out", default="peers")
    p.add_argument("--together", action=argparse.BooleanOptionalAction, default=True,
                   help="P7: run the arms' sessions at the same time (default), so the "
                        "shared machine's noise hits all alike; --no-together: one "
                        "arm after another, the order alternating per size")
    p.add_argument("--turns", type=int, nargs="+", default=None,
                   help="P7: the pool of session lengths (default: 6-35, mostly short)")
    p.add_argument("--smoke", action="store_true", help="fake engines, tiny: plumbing")
    args = p.parse_args(argv)
    if args.smoke:
        args.p5, args.p7, args.tool_min_s, args.tool_max_s = [3], [4], 0.01, 0.05
        args.arrival_gap_s, args.max_tokens = 0.02, 6
        args.turns = [2, 3]
        args.arms = ["stock", "flowlift_ws", "upstream_ws", "flowlift_agent"]  # every kind
    return args


def model_dir(given: str | None) -> str:
    if given:
        return given
    from flowlift.local_engine.vllm_engine import VLLMConfig

    return VLLMConfig.for_model(None, dtype="float32").model


def agent_config(args: argparse.Namespace, tmp: Path) -> tuple[str, ...]:
    """The agent arm's ``--config`` flags: every P7 size's sessions as proxy tools
    (:func:`bench.peers.agent_arm.config_text`), their waits in a plan file the proxy
    finds through :data:`~bench.peers.agent_arm.PLAN_ENV` (set here, inherited)."""
    plans = [p for n in args.p7 for p in p7_plan(n, args)]
    agent_arm.write_plan(tmp / "agent_plan.json", plans)
    (tmp / "agent_tools.toml").write_text(agent_arm.config_text(plans), encoding="utf-8")
    os.environ[agent_arm.PLAN_ENV] = str(tmp / "agent_plan.json")
    root = str(Path(__file__).resolve().parents[2])  # the proxy imports bench.peers
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])
    return "--config", str(tmp / "agent_tools.toml")


def start_arm(stack: contextlib.ExitStack, arm: str, engine: servers.EngineArgs,
              args: argparse.Namespace, logs: Path, agent_flags: tuple[str, ...]) -> str:
    """Start ``arm``'s server(s) into ``stack``; its base URL once ready."""
    log = logs / f"{args.out}_{arm}.log"
    log.unlink(missing_ok=True)
    flags = ARMS[arm]
    if arm in UPSTREAM_ARMS:  # its own stock server, flowlift in front of it
        up_log = logs / f"{args.out}_{arm}_vllm.log"
        up_log.unlink(missing_ok=True)
        upstream = stack.enter_context(
            servers.flowlift(engine, up_log, fake=True) if args.smoke
            else servers.stock_vllm(engine, up_log))
        return stack.enter_context(servers.flowlift_upstream(
            engine, log, upstream, *(flags or ()), fake=args.smoke))
    if arm in AGENT_ARMS:  # the sessions' tools on the proxy
        return stack.enter_context(servers.flowlift(
            engine, log, *(flags or ()), *agent_flags, fake=args.smoke))
    if flags is None and not args.smoke:
        return stack.enter_context(servers.stock_vllm(engine, log))
    # the smoke's stand-in for stock vLLM is a fake flowlift too
    return stack.enter_context(servers.flowlift(engine, log, *(flags or ()), fake=args.smoke))


def start_arms(stack: contextlib.ExitStack, args: argparse.Namespace,
               engine: servers.EngineArgs, logs: Path, tmp: Path
               ) -> dict[str, tuple[str, str]]:
    """Every arm's server; arm -> (base URL, model id). With ``--smoke`` (fake engines)
    they start at the same time, each waiting for its own readiness (one that fails
    raises once all have been tried; the started ones stop with ``stack``); real
    engines start one after another, so no engine's load competes with another's
    for the two cores."""
    agent_flags = agent_config(args, tmp) if AGENT_ARMS & set(args.arms) else ()
    with ThreadPoolExecutor(len(args.arms) if args.smoke else 1) as pool:
        started = {arm: pool.submit(start_arm, stack, arm, engine, args, logs, agent_flags)
                   for arm in args.arms}
    return {arm: (f.result(), servers.model_id(f.result())) for arm, f in started.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    engine = servers.EngineArgs("fake" if args.smoke else model_dir(args.model),
                                args.kv_cache_gib, args.max_num_seqs,
                                kv_cache_blocks=args.kv_cache_blocks,
                                extra_env=tuple(tuple(kv.split("=", 1))  # type: ignore[misc]
                                                for kv in args.env))
    results: dict[str, Any] = {
        "command": "python bench/peers/run.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv),
        "vllm": servers.vllm_version(), "engine_args": vars(engine) if hasattr(
            engine, "__dict__") else {f: getattr(engine, f) for f in engine.__slots__},
        "stock_command": " ".join(servers.stock_command(engine, 0)[1:]),
        "flowlift_command": "flowlift serve " + " ".join(servers.flowlift_args(engine)),
        "arms": {a: ARMS[a] for a in args.arms},
        "machine": "2 CPU cores, shared with other helpers' work while measuring"}
    print(f"{results['vllm']}; stock: {results['stock_command']}", flush=True)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        logs = tmp if args.smoke else RESULTS
        logs.mkdir(parents=True, exist_ok=True)
        bases = start_arms(stack, args, engine, logs, tmp)
        for turns in args.p5:
            pair = {a: bases[a] for a in [a for a in args.arms if a not in AGENT_ARMS][:2]}
            results[f"p5_{turns}"] = r = asyncio.run(p5_session(pair, turns, args.max_tokens))
            print(f"  P5 {turns} turns: " + ", ".join(
                f"{s} {v['session_s']} s" for s, v in r.items() if "turns" in v)
                  + f"; {({k: v for k, v in r.items() if k.startswith('stock_over')})}",
                  flush=True)
            save(args.out, results, smoke=args.smoke)
        for i, n in enumerate(args.p7):
            results[f"p7_{n}"] = p7(bases, n, args, flip=i % 2 == 1)
            save(args.out, results, smoke=args.smoke)
    print(markdown(results))
    errors = [e for k, r in results.items() if k.startswith("p7_")
              for s in r["summary"].values() for e in s["errors"]]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
