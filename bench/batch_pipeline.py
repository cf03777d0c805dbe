"""Batch pipeline on the real engine: one flowlift workflow vs request-level clients.

The example pipeline (extract -> classify -> related (@tool) -> summarize) over 32
standard-library docstrings, every prompt opening with one ~600-token preamble, run
three ways against the same proxy and engine:

* flowlift: one workflow (one graph, the proxy schedules it);
* sequential: the same prompts sent one by one through ``/v1/chat/completions``;
* gather(c): a hand-written asyncio client, one chain per document, at most ``c``
  requests in flight (c = 8 and 16; the best counts).

Each variant gets its own first line in the preamble so no variant reuses another's
prefix cache. The engine lower bound is the unique work over the engine's measured
ceiling: uncached prompt tokens / max prefill tok/s + generated tokens / max decode tok/s.

    .venv/bin/python bench/batch_pipeline.py [--docs 32]
    .venv/bin/python bench/batch_pipeline.py --docs 32 --repeat-fraction 0.3
    .venv/bin/python bench/batch_pipeline.py --smoke   # seconds, fake engine: plumbing only

``--repeat-fraction f``: a corpus where a fraction ``f`` of the documents repeat an
earlier one (as ticket and log data does): ``docs x (1 - f)`` distinct docstrings, the
rest copies of randomly chosen ones (seeded), in a shuffled order. The workflow's
compiler merges identical calls (same model, resolved prompt, params; deterministic
sampling; the example's ``related`` is a ``pure`` tool, so its repeats merge too and the
``summarize`` reading them follows), so each repeat costs nothing; the request-level
client sends every call. Tokens reported: ``computed_tokens`` = uncached prompt tokens
+ generated tokens, what the engine actually computed.

The proxy serves the example's config (examples/stdlib_docs/flowlift.toml): its
``classify`` is a ``small -> large`` cascade, so those model names must exist.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai

from bench.harness import EXAMPLE_CONFIG, engine_ceiling, proxy, save
from examples.stdlib_docs import pipeline as ex
from examples.stdlib_docs.corpus import AREAS, load_documents
from flowlift import workflow
from flowlift.graph import render_value

GLOSSARY = """

Glossary of the areas, to decide between close calls:
- data formats: modules that read, write, encode or decode a file format or wire \
format (JSON, CSV, property lists, binary records, audio containers, compressed \
streams, configuration files). The module's main job is the format itself.
- text processing: modules that search, compare, format, translate or otherwise \
transform text (regular expressions, differences between sequences, string \
templates, message catalogs, locale conventions, pretty printing).
- networking: modules that speak a network protocol or build servers and clients \
(sockets, socket servers, HTTP servers and clients, mail and file transfer \
protocols, URL handling, remote procedure calls).
- files and processes: modules about the file system, paths, temporary files, \
input/output streams, child processes and scheduling work in time.
- developer tools: modules that help write, parse, inspect, test or time Python \
code, or build command-line interfaces (argument parsing, line-oriented command \
interpreters, syntax trees, tokenizers, type hints, unit tests, timing).
- math and algorithms: modules for numbers, statistics, random numbers, heaps and \
other data structures and algorithms, colour conversions and identifiers.

When a module fits two areas, pick the one that names what a reader would look \
for first. A module that parses a format belongs to data formats even when it is \
used by networking code; a module that runs servers belongs to networking even \
when it reads files. Keep every answer short: the team reads hundreds of records \
and values consistency over detail."""


class _R:
    """Renders like a Semantic Variable in an f-string (so prompts are identical)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __format__(self, spec: str) -> str:
        return render_value(self.value.model_dump() if hasattr(self.value, "model_dump")
                            else self.value)

    def __getattr__(self, name: str) -> _R:
        v = self.value
        return _R(v[name] if isinstance(v, dict) else getattr(v, name))


def _set_preamble(variant: str) -> None:
    ex.PREAMBLE = f"[batch run {variant}]\n" + BASE_PREAMBLE + GLOSSARY


BASE_PREAMBLE = ex.PREAMBLE


class Counter:
    def __init__(self) -> None:
        self.prompt = self.cached = self.generated = self.calls = 0

    def add(self, usage: Any) -> None:
        self.calls += 1
        self.prompt += usage.prompt_tokens
        self.cached += usage.prompt_tokens_details.cached_tokens
        self.generated += usage.completion_tokens


async def _call(client: openai.AsyncOpenAI, count: Counter, messages: list[dict[str, Any]],
                params: Any, schema: dict[str, Any] | None = None) -> str:
    extra: dict[str, Any] = {}
    if schema is not None:
        extra["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "out", "schema": schema}}
    r = await client.chat.completions.create(
        model="default", messages=messages, max_tokens=params.max_tokens,  # type: ignore[arg-type]
        temperature=params.temperature, stop=list(params.stop) or None, **extra)
    count.add(r.usage)
    return r.choices[0].message.content or ""


async def _chain(client: openai.AsyncOpenAI, count: Counter, doc: Any,
                 sem: asyncio.Semaphore) -> None:
    async with sem:
        extract = ex.extract_step(doc)
        raw = await _call(client, count, extract.fn(doc), extract.params,
                          ex.facts_model(doc).model_json_schema())
    facts = ex.facts_model(doc).model_validate_json(raw)
    async with sem:
        label = json.loads(await _call(client, count, ex.classify.fn(doc, _R(facts)),
                                       ex.classify.params, {"type": "string", "enum": AREAS}))
    rel = ex.related_modules(facts, doc.name)
    async with sem:
        await _call(client, count, ex.summarize.fn(doc, _R(facts), _R(label), _R(rel)),
                    ex.summarize.params)


async def request_level(base: str, docs: list[Any], concurrency: int | None) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                timeout=600)
    count = Counter()
    t0 = time.monotonic()
    if concurrency is None:
        sem = asyncio.Semaphore(1)
        for doc in docs:
            await _chain(client, count, doc, sem)
    else:
        sem = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(_chain(client, count, d, sem) for d in docs))
    makespan = time.monotonic() - t0
    await client.close()
    return {"makespan_s": round(makespan, 1), "calls": count.calls,
            "prompt_tokens": count.prompt, "cached_tokens": count.cached,
            "generated_tokens": count.generated}


def flowlift_run(base: str, docs: list[Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    with workflow("bench-batch", base_url=base, workflow_class="batch") as wf:
        for doc in docs:
            facts = ex.extract(doc)
            label = ex.classify(doc, facts)
            ex.summarize(doc, facts, label, ex.related(facts, doc.name))
    makespan = time.monotonic() - t0
    s = wf.summary()
    llm = [r for r in wf.trace if r.get("kind") == "llm"]
    merged = sum(1 for r in llm if r.get("same_as"))
    return {"makespan_s": round(makespan, 1), "calls": len(llm) - merged,
            "merged_calls": merged,
            "prompt_tokens": s["tokens"]["prompt"], "cached_tokens": s["tokens"]["cached"],
            "generated_tokens": s["tokens"]["completion"]}


def corpus(docs: int, repeat_fraction: float, seed: int = 18) -> list[Any]:
    """``docs`` documents, ``round(docs x repeat_fraction)`` of them repeats of earlier
    ones (chosen and shuffled with ``seed``); ``repeat_fraction`` in [0, 1)."""
    distinct = load_documents(max(1, docs - round(docs * repeat_fraction)))
    rng = random.Random(seed)
    out = distinct + [rng.choice(distinct) for _ in range(docs - len(distinct))]
    if repeat_fraction:
        rng.shuffle(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--skip-sequential", action="store_true")
    parser.add_argument("--repeat-fraction", type=float, default=0.0,
                        help="share of the documents that repeat an earlier one")
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine, 4 documents (one repeated), gather(2), nothing saved")
    args = parser.parse_args()
    if args.smoke:
        args.docs, args.concurrency, args.skip_sequential = 4, [2], True
        args.repeat_fraction = args.repeat_fraction or 0.25  # the merge path runs too
    docs = corpus(args.docs, args.repeat_fraction)
    ex.corpus_index()
    results: dict[str, Any] = {"documents": len(docs),
                               "distinct_documents": len({d.name for d in docs})}
    with proxy("--config", str(EXAMPLE_CONFIG), name="batch_pipeline",
               engine="fake" if args.smoke else "vllm") as base:
        results["ceiling"] = asyncio.run(engine_ceiling(base))
        print("engine ceiling", results["ceiling"], flush=True)
        _set_preamble("flowlift")
        results["flowlift"] = flowlift_run(base, docs)
        print("flowlift", results["flowlift"], flush=True)
        for c in args.concurrency:
            _set_preamble(f"gather{c}")
            results[f"gather{c}"] = asyncio.run(request_level(base, docs, c))
            print(f"gather{c}", results[f"gather{c}"], flush=True)
        if not args.skip_sequential:
            _set_preamble("sequential")
            results["sequential"] = asyncio.run(request_level(base, docs, None))
            print("sequential", results["sequential"], flush=True)
    fl = results["flowlift"]
    ceiling = results["ceiling"]
    bound = ((fl["prompt_tokens"] - fl["cached_tokens"]) / ceiling["prefill_tps"]
             + fl["generated_tokens"] / ceiling["decode_tps"])
    results["engine_lower_bound_s"] = round(bound, 1)
    best = min((k for k in results if k.startswith("gather")),
               key=lambda k: results[k]["makespan_s"])
    results["best_gather"] = best
    ratios = {"best_gather_over_flowlift": results[best]["makespan_s"] / fl["makespan_s"],
              "flowlift_over_lower_bound": fl["makespan_s"] / bound}
    if "sequential" in results:
        ratios["sequential_over_flowlift"] = results["sequential"]["makespan_s"] / fl["makespan_s"]
    for res in results.values():
        if isinstance(res, dict) and "generated_tokens" in res:
            res["computed_tokens"] = (res["prompt_tokens"] - res["cached_tokens"]
                                      + res["generated_tokens"])
    ratios["best_gather_computed_over_flowlift"] = (results[best]["computed_tokens"]
                                                    / max(fl["computed_tokens"], 1))
    results["ratios"] = {k: round(v, 2) for k, v in ratios.items()}
    print(json.dumps(results["ratios"]))
    name = "batch_pipeline"
    if args.repeat_fraction:
        name += f"_repeats{round(args.repeat_fraction * 100)}"
    save(name, results, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
