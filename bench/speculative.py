"""n-gram (prompt-lookup) speculative decoding on vs off, for steps whose output copies
from their prompt (extraction into JSON), side by side in one run: two proxies, the same
model, the second with ``--speculative-ngram K``, the third also with
``--speculative-max-batch 1`` (speculation only while one request decodes).

vLLM's ``speculative_config={"method": "ngram"}`` proposes up to K tokens per step by
finding the last 2-4 generated tokens earlier in the prompt and copying what followed
(prompt lookup decoding, Saxena 2023); the model checks all of them in one forward
pass, so a copied span costs one step instead of K.

Workloads (documents: the example's corpus, real Python standard-library docstrings):

* ``copy_json``: the documentation's first sentence and the names it mentions, copied
  verbatim into JSON (schema-constrained): mostly copying;
* ``extract``: the example pipeline's ``extract`` (a purpose sentence that starts with
  a verb, up to three key terms): some copying;
* ``free_text``: a one-sentence description in the model's own words: little copying
  (what speculation costs when it misses).

Each runs ``sequential`` (one step at a time: per-step latency and one stream's
decode tokens/s) and ``concurrent`` (all steps of the workload in one run: aggregate
completion tokens/s). Outputs are greedy: the share that came out identical on and off
is reported too.

    python bench/speculative.py             # real engine
    python bench/speculative.py --interleave --configs off on --docs 4
    python bench/speculative.py --smoke     # fake engine (the flags are not passed)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import BaseModel, Field

from bench.harness import proxy, save
from examples.stdlib_docs import pipeline
from examples.stdlib_docs.corpus import Document, load_documents
from flowlift import WorkflowFailed, step, workflow


class Copied(BaseModel):
    """What ``copy_json`` copies out of a docstring."""

    first_sentence: str = Field(max_length=300)
    names: list[str] = Field(max_length=6)


@step(output=Copied, max_tokens=160, name="copy_json")
def copy_json(doc: Document) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You copy facts out of documentation exactly."},
            {"role": "user", "content": (
                f"Documentation of the {doc.name} module:\n{doc.text}\n\nAnswer in JSON: "
                "first_sentence is the documentation's first sentence, copied word for "
                "word; names are the function and class names it mentions, as written.")}]


@step(max_tokens=48, name="free_text", stop=["\n"])
def free_text(doc: Document) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You describe Python modules in plain words."},
            {"role": "user", "content": (
                f"Documentation of the {doc.name} module:\n{doc.text}\n\n"
                f"In your own words, one sentence: why would someone use {doc.name}?")}]


WORKLOADS = {"copy_json": copy_json, "extract": pipeline.extract, "free_text": free_text}


def _rows(wf: Any, name: str) -> list[dict[str, Any]]:
    rows = []
    for r in wf.trace:
        if r.get("type") != "step" or r.get("name") != name or not r.get("attempts"):
            continue
        a = r["attempts"][-1]
        if a.get("first_token_ms") is None or a.get("finished_ms") is None:
            continue
        decode_s = (a["finished_ms"] - a["first_token_ms"]) / 1000.0
        rows.append({"step": r["step_id"], "latency_ms": a["finished_ms"] - a["started_ms"],
                     "completion_tokens": a["completion_tokens"],
                     "decode_tps": (a["completion_tokens"] - 1) / decode_s if decode_s > 0
                     else None})
    return rows


def run(base: str, name: str, docs: list[Document], concurrent: bool) -> dict[str, Any]:
    """One pass of workload ``name`` over ``docs``: its steps' rows, wall time, outputs."""
    fn = WORKLOADS[name]
    rows: list[dict[str, Any]] = []
    outputs: dict[str, Any] = {}
    t0 = time.perf_counter()
    for batch in ([docs] if concurrent else [[d] for d in docs]):
        vars_ = []
        try:
            with workflow(f"bench-spec-{name}", base_url=base, progress=False) as wf:
                vars_ = [(doc.name, fn(doc)) for doc in batch]
        except WorkflowFailed:
            pass  # a failed step (contract) is left out of the figures
        rows += _rows(wf, name)
        for doc_name, var in vars_:
            if var.step_id not in wf.failures:
                outputs[doc_name] = var.value
    return {"rows": rows, "wall_s": time.perf_counter() - t0, "outputs": outputs}


def summarize(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures over one or more passes of a workload (tokens/s: all tokens over all
    wall time; medians over all steps; outputs of the first pass)."""
    rows = [r for p in passes for r in p["rows"]]
    wall_s = sum(p["wall_s"] for p in passes)
    tokens = sum(r["completion_tokens"] for r in rows)
    tps = [r["decode_tps"] for r in rows if r["decode_tps"] is not None]
    latency = [r["latency_ms"] for r in rows]
    return {"steps": len(rows), "wall_s": round(wall_s, 2),
            "completion_tokens": tokens, "tokens_per_s": round(tokens / wall_s, 1),
            "step_latency_median_ms": round(statistics.median(latency), 1) if latency else None,
            "decode_tps_median": round(statistics.median(tps), 1) if tps else None,
            "outputs": {k: v if isinstance(v, str) else repr(v)
                        for k, v in passes[0]["outputs"].items()}}


KEYS = [(name, mode) for name in WORKLOADS for mode in ("sequential", "concurrent")]


def measure(base: str, docs: list[Document]) -> dict[str, Any]:
    run(base, "free_text", docs[:1], concurrent=False)  # warm-up
    return {f"{name}_{mode}": summarize([run(base, name, docs, mode == "concurrent")])
            for name, mode in KEYS}


def measure_interleaved(bases: dict[str, str], docs: list[Document],
                        reps: int) -> dict[str, dict[str, Any]]:
    """Every proxy up at once; each workload runs on each in turn, the order rotated
    every pass, so drift in the machine's load falls on all of them alike."""
    labels = list(bases)
    for base in bases.values():
        run(base, "free_text", docs[:1], concurrent=False)  # warm-up
    out: dict[str, dict[str, Any]] = {label: {} for label in labels}
    for name, mode in KEYS:
        passes: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
        for rep in range(reps):
            for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
                passes[label].append(run(bases[label], name, docs, mode == "concurrent"))
        for label in labels:
            out[label][f"{name}_{mode}"] = summarize(passes[label])
    return out


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Per workload: ``on``'s tokens/s and step latency over ``off``'s, identical outputs."""
    out = {}
    for key in on:
        a, b = on[key], off[key]
        same = [d for d in a["outputs"] if b["outputs"].get(d) == a["outputs"][d]]
        out[key] = {
            "tokens_per_s_on_over_off": round(a["tokens_per_s"] / b["tokens_per_s"], 2),
            "step_latency_off_over_on": (
                round(b["step_latency_median_ms"] / a["step_latency_median_ms"], 2)
                if a["step_latency_median_ms"] and b["step_latency_median_ms"] else None),
            "identical_outputs": f"{len(same)}/{len(a['outputs'])}"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=8, help="documents per workload")
    parser.add_argument("--k", type=int, default=4, help="tokens proposed per step")
    parser.add_argument("--configs", nargs="+", default=["off", "on", "solo"],
                        choices=["off", "on", "solo"],
                        help="off; on (--speculative-ngram K); solo (also "
                             "--speculative-max-batch 1: only while one request decodes)")
    parser.add_argument("--out", default="speculative", help="results name")
    parser.add_argument("--interleave", action="store_true",
                        help="all proxies up at once, each workload on each in turn")
    parser.add_argument("--reps", type=int, default=2,
                        help="with --interleave: passes per workload and proxy")
    parser.add_argument("--smoke", action="store_true", help="fake engine, 2 documents")
    args = parser.parse_args(argv)
    if args.smoke:
        args.docs = 2
    docs = load_documents(None)[:args.docs]
    engine = "fake" if args.smoke else "vllm"
    results: dict[str, Any] = {
        "command": "python bench/speculative.py " + " ".join(argv or sys.argv[1:]),
        "engine": "fake (smoke)" if args.smoke else
        "embedded vLLM CPU build, SmolLM2-135M-Instruct, 2 CPU cores shared with others",
        "k": args.k, "docs": [d.name for d in docs]}
    spec = () if args.smoke else ("--speculative-ngram", str(args.k))
    flags_of = {"off": (), "on": spec,
                "solo": (*spec, "--speculative-max-batch", "1") if spec else ()}
    if args.interleave:
        with contextlib.ExitStack() as stack:
            bases = {label: stack.enter_context(proxy(
                "--max-concurrency", "8", *flags_of[label], name=f"speculative_{label}",
                engine=engine)) for label in args.configs}
            results.update(measure_interleaved(bases, docs, args.reps))
    for label in [] if args.interleave else args.configs:
        with proxy("--max-concurrency", "8", *flags_of[label], name=f"speculative_{label}",
                   engine=engine) as base:
            results[label] = measure(base, docs)
    for label in args.configs:
        print(label, {k: {m: v for m, v in r.items() if m != "outputs"}
                      for k, r in results[label].items()}, flush=True)
    for label in args.configs:
        if label == "off" or "off" not in results:
            continue
        results[f"{label}_vs_off"] = compare(results[label], results["off"])
        for key, row in results[f"{label}_vs_off"].items():
            print(f"{label} vs off  {key:24s} {row}", flush=True)
    save(args.out, results, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
