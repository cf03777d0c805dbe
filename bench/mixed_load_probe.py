"""Where interactive latency goes under batch load (a diagnosis, not a benchmark).

Runs ``bench/mixed_load.py``'s scenario on one scheduler arm with the engine's own step
timings recorded: the proxy is ``flowlift serve`` started through this file
(``--serve``), which appends every engine iteration
(:mod:`flowlift.local_engine.step_log`) to a JSON-lines file; the client keeps each
interactive workflow's trace (per step: queue, prefill = slot to first token, decode).
The report joins them: for each interactive step, the engine steps inside its prefill
and decode windows (how many, their time, the prompt tokens they computed beside it,
the batch size they decoded at).

    flock /tmp/bench.lock .venv/bin/python bench/mixed_load_probe.py --arm preempt:2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import mixed_load as ml
from bench.harness import RESULTS, pct
from examples.stdlib_docs.corpus import load_documents
from flowlift import step, workflow
from flowlift.testing import free_port


def serve(argv: list[str]) -> int:
    """``flowlift serve`` with each engine's steps appended to ``$PROBE_STEPS``."""
    from flowlift import cli
    from flowlift.local_engine import vllm_engine

    out = open(os.environ["PROBE_STEPS"], "a", buffering=1)  # noqa: SIM115
    init = vllm_engine.VLLMEngine.__init__

    def patched(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, dataclasses.replace(config, step_timings=True), *args, **kwargs)
        if self.steps is not None:
            self.steps.listeners.append(lambda s: out.write(json.dumps(
                [time.time(), s.prefill_requests, s.prefill_tokens, s.decode_requests,
                 round(s.elapsed_ms, 2)]) + "\n"))

    vllm_engine.VLLMEngine.__init__ = patched  # type: ignore[method-assign]
    return cli.main(argv)


def interactive(base: str, i: int, traces: list[Any]) -> float:
    t0 = time.monotonic()
    with workflow(f"interactive-{i}", base_url=base, workflow_class="interactive") as wf:
        ml.follow_up(ml.ask(f"what is module number {i} for?"))
    traces.append(wf.trace)
    return time.monotonic() - t0


def steps_in(steps: list[list[float]], t0: float, t1: float) -> dict[str, Any]:
    """The engine steps recorded in [t0, t1] (epoch s)."""
    inside = [s for s in steps if t0 <= s[0] <= t1]
    return {"n": len(inside), "ms": round(sum(s[4] for s in inside)),
            "prefill_tok": sum(s[2] for s in inside),
            "prefill_ms": round(sum(s[4] for s in inside if s[2] > 0)),
            "decode_batch": (round(statistics.mean(s[3] for s in inside), 1)
                             if inside else None),
            "max_step_ms": round(max((s[4] for s in inside), default=0))}


def breakdown(traces: list[Any], steps: list[list[float]]) -> list[dict[str, Any]]:
    rows = []
    for trace in traces:
        run = next(r for r in trace if r["type"] == "run")
        t0 = run["started_at"]
        for st in (r for r in trace if r["type"] == "step" and r["kind"] == "llm"):
            ready, start = st["ready_ms"], st["started_ms"]
            first, end = st["first_token_ms"], st["finished_ms"]
            if None in (ready, start, first, end):
                continue
            rows.append({"run": run["run_id"][-6:], "step": st["name"] or st["step_id"],
                         "queue_ms": round(start - ready), "ttft_ms": round(first - start),
                         "decode_ms": round(end - first),
                         "tokens": st["completion_tokens"],
                         "prompt": st["prompt_tokens"],
                         "during_ttft": steps_in(steps, t0 + start / 1e3, t0 + first / 1e3),
                         "during_decode": steps_in(steps, t0 + first / 1e3,
                                                   t0 + end / 1e3)})
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 1) if rows else float("nan")
    tpot = [r["decode_ms"] / max(r["tokens"] - 1, 1) for r in rows]
    return {"steps": len(rows), "queue_ms_p50": med("queue_ms"),
            "queue_ms_max": max((r["queue_ms"] for r in rows), default=0),
            "ttft_ms_p50": med("ttft_ms"),
            "ttft_ms_max": max((r["ttft_ms"] for r in rows), default=0),
            "decode_ms_p50": med("decode_ms"),
            "decode_ms_max": max((r["decode_ms"] for r in rows), default=0),
            "tpot_ms_p50": round(statistics.median(tpot), 1) if tpot else None,
            "prefill_tok_in_ttft_p50": (statistics.median(r["during_ttft"]["prefill_tok"]
                                                          for r in rows) if rows else None),
            "prefill_ms_in_decode_mean": (round(statistics.mean(
                r["during_decode"]["prefill_ms"] for r in rows)) if rows else None),
            "decode_batch_in_decode_p50": (statistics.median(
                r["during_decode"]["decode_batch"] or 0 for r in rows) if rows else None)}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return serve(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", default="preempt:2")
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--interactive", type=int, default=20)
    parser.add_argument("--every-s", type=float, default=2.0)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--extra", default="", help="more serve flags, space-separated")
    args = parser.parse_args()
    scheduling, _, cap = args.arm.partition(":")
    extra = [*(["--batch-cap-when-interactive", cap] if cap else []),
             *args.extra.split()]
    tag = args.arm.replace(":", "") + "".join(args.extra.split()).replace("-", "_")
    steps_path = RESULTS / f"probe_steps_{tag}.jsonl"
    steps_path.unlink(missing_ok=True)
    os.environ["PROBE_STEPS"] = str(steps_path)
    kind = step(max_tokens=args.batch_tokens, name="describe")(ml.describe_prompt)
    docs = load_documents(args.docs)
    log = RESULTS / f"probe_{tag}.log"
    log.unlink(missing_ok=True)
    serve_args = ("--state-db", ":memory:", "--log-level", "warning", "--scheduling",
                  scheduling, *extra)  # the default model (see bench/mixed_load.py)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", "serve", "--port",
                                 str(port), *serve_args], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(log.read_text()[-3000:])
            time.sleep(0.5)
        alone_traces: list[Any] = []
        interactive(base, -1, [])
        alone = [interactive(base, i, alone_traces) for i in range(8)]
        mixed: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: mixed.update(
            ml.batch(base, docs, "mixed", kind)))
        thread.start()
        loaded: list[float] = []
        traces: list[Any] = []
        arrivals = []
        for i in range(args.interactive):
            time.sleep(args.every_s)
            if not thread.is_alive():
                break
            a = threading.Thread(target=lambda i=i: loaded.append(
                interactive(base, 100 + i, traces)))
            a.start()
            arrivals.append(a)
        thread.join()
        for a in arrivals:
            a.join()
        pre = ml.preemptions(base)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    steps = [json.loads(line) for line in steps_path.read_text().splitlines()]
    rows_alone, rows = breakdown(alone_traces, steps), breakdown(traces, steps)
    mixed.pop("outputs", None)
    result = {"arm": args.arm, "extra": args.extra,
              "interactive_alone_s": [round(x, 2) for x in alone],
              "interactive_loaded_s": [round(x, 2) for x in loaded],
              "p99_loaded_over_alone": round(pct(loaded, 99) / pct(alone, 99), 2),
              "batch_mixed": mixed, "preemptions": pre,
              "alone": summary(rows_alone), "loaded": summary(rows),
              "rows_loaded": rows}
    out_path = RESULTS / f"probe_{tag}.json"
    out_path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows_loaded"}, indent=1))
    worst = sorted(rows, key=lambda r: -(r["queue_ms"] + r["ttft_ms"] + r["decode_ms"]))[:6]
    for r in worst:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
