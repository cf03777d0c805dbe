"""Mixed load: interactive workflows arriving while a large batch runs.

For each scheduler -- flowlift's (``--scheduling priority``: class, remaining critical
path, deadline slack, reserved interactive slots, prefix-grouped dispatch), the same
with preemption (``--scheduling preempt``: running batch requests above the batch cap
are aborted when interactive work arrives and resumed later as continuations) and
first-come-first-served (``--scheduling fcfs``) -- on the real engine:

1. interactive alone: short two-step workflows, one after another (unloaded latency);
2. batch alone: N documents (makespan), either ``--batch free`` (one free-text step per
   document: what can be preempted) or ``--batch example`` (the example's extract ->
   classify: JSON- and choice-constrained, so never preempted: vLLM cannot resume a
   grammar mid-way, see flowlift.local_engine.continuation);
3. mixed: the same batch, and an interactive workflow arriving every ``--every-s``
   seconds while it runs (open loop: arrivals do not wait for earlier ones to finish).

Reported: interactive p50/p99 latency loaded vs unloaded, batch throughput (steps/s)
mixed vs alone and vs FCFS's, preemptions (the proxy's ``flowlift_preemptions``), and
greedy divergence: batch outputs of the mixed run that differ from the same arm's batch
alone (temperature 0; FCFS's count is the control: vLLM's own batch-dependent numerics).

    .venv/bin/python bench/mixed_load.py [--docs 24] [--interactive 8] [--batch free]
    .venv/bin/python bench/mixed_load.py --smoke   # seconds, fake engine: plumbing only

With ``--batch example`` the proxies serve the example's config
(examples/stdlib_docs/flowlift.toml: its ``classify`` is a ``small -> large`` cascade, so
those model names must exist; since they became two Qwen2.5-Coder engines in bfloat16,
that batch runs on them). The free-text batch runs on the default model alone
(SmolLM2-135M-Instruct, float32), as the preemption figures in bench/RESULTS.md were.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import urllib.request
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


def describe_prompt(doc: Any):
    return (f"Explain in detail, in about 150 words, what the Python module {doc.name} "
            f"is for and how it is used.\n\n{doc.text}")



def batch(base: str, docs: list[Any], tag: str, kind: Any) -> dict[str, Any]:
    """The batch workflow: ``kind`` is the free-text step (a ``@step``) or
    ``"example"`` (extract -> classify)."""
    ex.PREAMBLE = f"[{tag}]\n" + BASE_PREAMBLE
    t0 = time.monotonic()
    with workflow("batch", base_url=base, workflow_class="batch"):
        if kind != "example":
            outs = [kind(doc) for doc in docs]
        else:
            outs = [ex.classify(doc, ex.extract(doc)) for doc in docs]
    makespan = time.monotonic() - t0
    steps = len(docs) * (1 if kind != "example" else 2)
    return {"makespan_s": round(makespan, 1), "steps": steps,
            "steps_per_s": round(steps / makespan, 3),
            "outputs": [str(out.value) for out in outs]}


BASE_PREAMBLE = ex.PREAMBLE


def preemptions(base: str) -> int:
    """The proxy's ``flowlift_preemptions_total``, summed over its backends."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(int(float(v)) for v in re.findall(
        r"^flowlift_preemptions_total\{[^}]*\} (\S+)$", text, re.M))


def scenario(scheduling: str, docs: list[Any], n_interactive: int,
             every_s: float, kind: Any, engine: str = "vllm",
             extra: tuple[str, ...] = ()) -> dict[str, Any]:
    # the batch's tag is the same in every arm: its prompts (and greedy outputs) too
    # the example's config only for its batch (its classify names the cascade's models);
    # the free-text batch runs on the default model, SmolLM2-135M in float32, alone on
    # the machine (the config now loads two Qwen2.5-Coder engines in bfloat16)
    config = ("--config", str(EXAMPLE_CONFIG)) if kind == "example" else ()
    with proxy("--scheduling", scheduling, *extra, *config,
               name=re.sub(r"[^\w.=]+", "_", f"mixed_{scheduling}_{'_'.join(extra)}"),
               engine=engine) as base:
        interactive(base, -1)  # warm-up
        alone = [interactive(base, i) for i in range(8)]
        batch_alone = batch(base, docs, "alone", kind)
        mixed: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: mixed.update(
            batch(base, docs, "mixed", kind)))
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
        preempted = preemptions(base)
        with urllib.request.urlopen(f"{base}/readyz", timeout=10) as r:
            plans = json.loads(r.read()).get("batch_plans")
    # the alone and mixed batches differ only in their tag line: compare the outputs of
    # each run against this arm's other batch, which ran without interactive arrivals
    differ = sum(a != b for a, b in zip(batch_alone.pop("outputs"), mixed.pop("outputs"),
                                        strict=True))
    out = {"interactive_alone_s": {"p50": round(pct(alone, 50), 2),
                                   "p99": round(pct(alone, 99), 2), "n": len(alone)},
           "interactive_loaded_s": {"p50": round(pct(loaded, 50), 2),
                                    "p99": round(pct(loaded, 99), 2), "n": len(loaded)},
           "batch_alone": batch_alone, "batch_mixed": mixed, "preemptions": preempted,
           "batch_outputs_mixed_differing_from_alone": differ}
    if plans:  # the dynamic cap's fitted step model and plan at the end of the run
        out["batch_plans"] = plans
    out["batch_throughput_mixed_over_alone"] = round(
        mixed["steps_per_s"] / batch_alone["steps_per_s"], 2)
    for q in ("p50", "p99"):
        out[f"interactive_{q}_loaded_over_alone"] = round(
            out["interactive_loaded_s"][q] / out["interactive_alone_s"][q], 2)
    print(scheduling, *extra, out, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--interactive", type=int, default=8)
    parser.add_argument("--every-s", type=float, default=4.0)
    parser.add_argument("--batch", choices=("free", "example"), default="free",
                        help="free: one free-text step per document (preemptible); "
                             "example: extract -> classify (constrained: never preempted)")
    parser.add_argument("--batch-tokens", type=int, default=128,
                        help="max_tokens of the free-text batch step")
    parser.add_argument("--arms", default="priority,preempt,fcfs",
                        help="schedulers to run, comma-separated (fcfs is the reference); "
                             "NAME:N also sets --batch-cap-when-interactive N (or auto), "
                             "NAME:auto@X also --interactive-slowdown X, NAME/T "
                             "--max-step-tokens T, and each +FLAG=V (last) --FLAG V (e.g. "
                             "preempt:auto@1.5/64+batch-cap=auto+block-size=32)")
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine (0.03 s a token), 4 documents, 2 arrivals 0.1 s "
                             "apart, nothing saved")
    parser.add_argument("--out", default=None,
                        help="results name in bench/results (default mixed_load_BATCH; a "
                             "second run under the default name replaces the first)")
    args = parser.parse_args()
    extra: tuple[str, ...] = ()
    if args.smoke:
        args.docs, args.interactive, args.every_s, args.batch_tokens = 4, 2, 0.1, 32
        # the batch still runs when the arrivals come; one batch slot while they run, so
        # the preempt arm preempts
        extra = ("--fake-delay-s", "0.03", "--batch-cap-when-interactive", "1")
    kind = (step(max_tokens=args.batch_tokens, name="describe")(describe_prompt)
            if args.batch == "free" else "example")
    docs = load_documents(args.docs)
    arms = [a for a in args.arms.split(",") if a]
    results: dict[str, Any] = {"documents": len(docs), "batch": args.batch,
                               "batch_tokens": args.batch_tokens, "every_s": args.every_s}
    for arm in arms:  # "preempt:2": --scheduling preempt --batch-cap-when-interactive 2
        arm_flags, *more = arm.split("+")  # "+batch-cap=12": --batch-cap 12
        flags = tuple(x for kv in more for x in (f"--{kv.partition('=')[0]}",
                                                 kv.partition("=")[2]))
        head, _, step_tokens = arm_flags.partition("/")  # "preempt:auto/256": --max-step-tokens
        scheduling, _, cap = head.partition(":")
        cap, _, slowdown = cap.partition("@")  # "auto@1.5": --interactive-slowdown 1.5
        results[arm] = scenario(scheduling, docs, args.interactive, args.every_s,
                                kind, engine="fake" if args.smoke else "vllm",
                                extra=(*extra, *(("--batch-cap-when-interactive", cap)
                                                 if cap else ()),
                                       *(("--interactive-slowdown", slowdown)
                                         if slowdown else ()),
                                       *(("--max-step-tokens", step_tokens)
                                         if step_tokens and not args.smoke else ()),
                                       *flags))
    if "fcfs" in results:
        f = results["fcfs"]
        for arm in arms:
            r = results[arm]
            r["interactive_p50_loaded_fcfs_over_this"] = round(
                f["interactive_loaded_s"]["p50"] / r["interactive_loaded_s"]["p50"], 2)
            r["batch_throughput_mixed_over_fcfs"] = round(
                r["batch_mixed"]["steps_per_s"] / f["batch_mixed"]["steps_per_s"], 2)
    save(args.out or f"mixed_load_{args.batch}", results, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
