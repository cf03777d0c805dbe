"""Mixed load: interactive workflows arriving while a large batch runs.

For each scheduler -- flowlift's (``--scheduling priority``: class, remaining critical
path, deadline slack, reserved interactive slots, prefix-grouped dispatch) and
first-come-first-served (``--scheduling fcfs``) -- on the real engine:

1. interactive alone: short two-step workflows, one after another (unloaded latency);
2. batch alone: the example's extract -> classify over N documents (makespan);
3. mixed: the same batch, and an interactive workflow arriving every ``--every-s``
   seconds while it runs (open loop: arrivals do not wait for earlier ones to finish).

Reported: interactive p50/p99 latency loaded vs unloaded, batch throughput (steps/s)
mixed vs alone, for both schedulers.

    .venv/bin/python bench/mixed_load.py [--docs 24] [--interactive 8]
    .venv/bin/python bench/mixed_load.py --smoke   # seconds, fake engine: plumbing only

The proxies serve the example's config (examples/stdlib_docs/flowlift.toml): its
``classify`` is a ``small -> large`` cascade, so those model names must exist.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import EXAMPLE_CONFIG, pct, proxy, save
from examples.stdlib_docs import pipeline as ex
from examples.stdlib_docs.corpus import load_documents
from flowlift import step, workflow


@step(max_tokens=8)
def ask(question: str):
    return f"Answer in three words: {question}"


@step(max_tokens=8)
def follow_up(answer: Any):
    return f"Say it again more briefly: {answer}"


def interactive(base: str, i: int) -> float:
    t0 = time.monotonic()
    with workflow(f"interactive-{i}", base_url=base, workflow_class="interactive"):
        follow_up(ask(f"what is module number {i} for?"))
    return time.monotonic() - t0


def batch(base: str, docs: list[Any], tag: str) -> dict[str, Any]:
    ex.PREAMBLE = f"[{tag}]\n" + BASE_PREAMBLE
    t0 = time.monotonic()
    with workflow("batch", base_url=base, workflow_class="batch"):
        for doc in docs:
            ex.classify(doc, ex.extract(doc))
    makespan = time.monotonic() - t0
    return {"makespan_s": round(makespan, 1), "steps": 2 * len(docs),
            "steps_per_s": round(2 * len(docs) / makespan, 3)}


BASE_PREAMBLE = ex.PREAMBLE


def scenario(scheduling: str, docs: list[Any], n_interactive: int,
             every_s: float, engine: str = "vllm",
             extra: tuple[str, ...] = ()) -> dict[str, Any]:
    with proxy("--scheduling", scheduling, *extra, "--config", str(EXAMPLE_CONFIG),
               name=f"mixed_{scheduling}", engine=engine) as base:
        interactive(base, -1)  # warm-up
        alone = [interactive(base, i) for i in range(4)]
        batch_alone = batch(base, docs, f"{scheduling} alone")
        mixed: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: mixed.update(
            batch(base, docs, f"{scheduling} mixed")))
        thread.start()
        loaded: list[float] = []
        arrivals = []
        for i in range(n_interactive):
            time.sleep(every_s)
            if not thread.is_alive():
                break
            arrival = threading.Thread(target=lambda i=i: loaded.append(
                interactive(base, 100 + i)))
            arrival.start()
            arrivals.append(arrival)
        thread.join()
        for arrival in arrivals:
            arrival.join()
    out = {"interactive_alone_s": {"p50": round(pct(alone, 50), 2),
                                   "p99": round(pct(alone, 99), 2), "n": len(alone)},
           "interactive_loaded_s": {"p50": round(pct(loaded, 50), 2),
                                    "p99": round(pct(loaded, 99), 2), "n": len(loaded)},
           "batch_alone": batch_alone, "batch_mixed": mixed}
    out["batch_throughput_mixed_over_alone"] = round(
        mixed["steps_per_s"] / batch_alone["steps_per_s"], 2)
    out["interactive_p50_loaded_over_alone"] = round(
        out["interactive_loaded_s"]["p50"] / out["interactive_alone_s"]["p50"], 2)
    print(scheduling, out, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--interactive", type=int, default=8)
    parser.add_argument("--every-s", type=float, default=4.0)
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine (0.03 s a token), 4 documents, 2 arrivals 0.1 s "
                             "apart, nothing saved")
    args = parser.parse_args()
    extra: tuple[str, ...] = ()
    if args.smoke:
        args.docs, args.interactive, args.every_s = 4, 2, 0.1
        extra = ("--fake-delay-s", "0.03")  # the batch still runs when the arrivals come
    docs = load_documents(args.docs)
    results: dict[str, Any] = {"documents": len(docs), "batch_steps": 2 * len(docs)}
    for scheduling in ("priority", "fcfs"):
        results[scheduling] = scenario(scheduling, docs, args.interactive, args.every_s,
                                       engine="fake" if args.smoke else "vllm", extra=extra)
    p, f = results["priority"], results["fcfs"]
    results["fcfs_over_priority_interactive_p50_loaded"] = round(
        f["interactive_loaded_s"]["p50"] / p["interactive_loaded_s"]["p50"], 2)
    results["priority_over_fcfs_batch_throughput_mixed"] = round(
        p["batch_mixed"]["steps_per_s"] / f["batch_mixed"]["steps_per_s"], 2)
    save("mixed_load", results, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
