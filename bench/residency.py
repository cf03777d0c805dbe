"""Two models in a memory budget that fits one: flowlift's plan vs request-level clients.

The proxy serves the default model and a second copy of it under another name (a
hard-linked copy of the converted folder, as bench/residency_swap.sh does) with
``--memory-budget-mb`` that fits one, so every switch between them unloads one engine
and loads the other. A two-stage pipeline over ``--docs`` standard-library docstrings
(``notes``: three facts about the module, on model A; ``label``: its documentation
area from those facts, on model B) runs three ways against the same proxy:

* flowlift: one workflow; the proxy's residency manager loads a model when a step needs
  it and never unloads one that queued or running steps of the run need (the compiled
  plan's windows order the rest);
* per-document chains: a request-level client sending each document's two calls one
  after the other through the drop-in ``/v1/chat/completions``, one document at a time
  (``--chain-concurrency`` documents at once): the proxy swaps on demand, as an
  Ollama-style server does;
* stage-by-stage: the same client, every document's ``notes`` call at once, then every
  ``label`` call (the best a request-level client can do when it knows the stages).

Each variant starts with model A loaded and has its own first prompt line (no prefix
cache shared between variants). Loads are read from ``/readyz`` (``residency.loads``,
also ``flowlift_model_loads_total`` in ``/metrics``); tokens are the engine's usage.

    .venv/bin/python bench/residency.py [--docs 4]
    .venv/bin/python bench/residency.py --smoke   # seconds, fake engine: plumbing only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import openai

from bench.harness import proxy, save
from examples.stdlib_docs.corpus import AREAS, Document, load_documents
from flowlift import step, workflow

NOTES_TOKENS, LABEL_TOKENS = 48, 8
VARIANTS = ("flowlift", "per_document", "stage_by_stage")


def notes_prompt(tag: str, doc: Document) -> list[dict[str, str]]:
    """Stage 1 (model A): three short facts about a module from its docstring."""
    return [{"role": "system", "content": f"[{tag}] You write terse technical notes."},
            {"role": "user", "content": f"Module {doc.name}:\n{doc.text}\n\n"
                                        "Write three short facts about this module."}]


def label_prompt(tag: str, name: str, notes: Any) -> list[dict[str, str]]:
    """Stage 2 (model B): the module's documentation area, from stage 1's notes."""
    return [{"role": "system", "content": f"[{tag}] You file modules by area. Areas: "
                                          + ", ".join(AREAS) + "."},
            {"role": "user", "content": f"Module {name}. Notes:\n{notes}\n\nIts area:"}]


def twin_model(base: Path, into: Path) -> Path:
    """A second model folder ``into/<base.name>-twin`` with ``base``'s files hard-linked
    (copied where links fail): another served name for the same weights."""
    twin = into / f"{base.name}-twin"
    twin.mkdir(parents=True)
    for f in base.iterdir():
        try:
            os.link(f, twin / f.name)
        except OSError:
            shutil.copy2(f, twin / f.name)
    return twin


@contextlib.contextmanager
def served(smoke: bool, budget_mb: float) -> Iterator[str]:
    """The proxy with two models in ``budget_mb``; yields its base URL."""
    with tempfile.TemporaryDirectory() as tmp:
        if smoke:
            extra = ["--extra-model", "fake-twin", "--fake-delay-s", "0.002"]
        else:
            from flowlift.local_engine.models import ensure_default_model

            extra = ["--extra-model", str(twin_model(Path(ensure_default_model()), Path(tmp)))]
        with proxy(*extra, "--memory-budget-mb", str(budget_mb), name="residency",
                   engine="fake" if smoke else "vllm") as base:
            yield base


def residency(base: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(base + "/readyz", timeout=30).json()["residency"]
    return body


def loads(base: str) -> int:
    return sum(residency(base)["loads"].values())


class Usage:
    def __init__(self) -> None:
        self.prompt = self.completion = self.calls = 0

    def add(self, usage: Any) -> None:
        self.calls += 1
        self.prompt += usage.prompt_tokens
        self.completion += usage.completion_tokens


async def _call(client: openai.AsyncOpenAI, usage: Usage, model: str,
                messages: list[dict[str, str]], max_tokens: int) -> str:
    r = await client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                             max_tokens=max_tokens, temperature=0)
    usage.add(r.usage)
    return r.choices[0].message.content or ""


async def per_document(base: str, models: tuple[str, str], docs: list[Document], tag: str,
                       concurrency: int) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                timeout=1800)
    usage, sem = Usage(), asyncio.Semaphore(concurrency)

    async def chain(doc: Document) -> None:
        async with sem:
            notes = await _call(client, usage, models[0], notes_prompt(tag, doc), NOTES_TOKENS)
            await _call(client, usage, models[1], label_prompt(tag, doc.name, notes),
                        LABEL_TOKENS)
    t0 = time.monotonic()
    await asyncio.gather(*(chain(d) for d in docs))
    makespan = time.monotonic() - t0
    await client.close()
    return {"makespan_s": round(makespan, 1), "calls": usage.calls,
            "prompt_tokens": usage.prompt, "completion_tokens": usage.completion}


async def stage_by_stage(base: str, models: tuple[str, str], docs: list[Document],
                         tag: str) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                timeout=1800)
    usage = Usage()
    t0 = time.monotonic()
    notes = await asyncio.gather(*(_call(client, usage, models[0], notes_prompt(tag, d),
                                         NOTES_TOKENS) for d in docs))
    await asyncio.gather(*(_call(client, usage, models[1], label_prompt(tag, d.name, n),
                                 LABEL_TOKENS) for d, n in zip(docs, notes, strict=True)))
    makespan = time.monotonic() - t0
    await client.close()
    return {"makespan_s": round(makespan, 1), "calls": usage.calls,
            "prompt_tokens": usage.prompt, "completion_tokens": usage.completion}


def flowlift_run(base: str, models: tuple[str, str], docs: list[Document],
                 tag: str) -> dict[str, Any]:
    notes = step(model=models[0], max_tokens=NOTES_TOKENS, name="notes")(
        lambda doc: notes_prompt(tag, doc))
    label = step(model=models[1], max_tokens=LABEL_TOKENS, name="label")(
        lambda name, n: label_prompt(tag, name, n))
    t0 = time.monotonic()
    with workflow("bench-residency", base_url=base, workflow_class="batch") as wf:
        for doc in docs:
            label(doc.name, notes(doc))
    makespan = time.monotonic() - t0
    s = wf.summary()
    return {"makespan_s": round(makespan, 1), "calls": s["steps"],
            "prompt_tokens": s["tokens"]["prompt"],
            "completion_tokens": s["tokens"]["completion"]}


def _reset(base: str, model: str) -> None:
    """Make ``model`` resident (one tiny request) before a variant starts."""
    r = httpx.post(base + "/v1/chat/completions", timeout=900, json={
        "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    r.raise_for_status()


def measure(base: str, variant: str, run: Any, model_a: str) -> dict[str, Any]:
    _reset(base, model_a)
    before = loads(base)
    out: dict[str, Any] = run()
    # the model resident at the start counts as one load: "loads = number of models"
    out["model_loads"] = 1 + loads(base) - before
    print(variant, out, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--chain-concurrency", type=int, default=1)
    parser.add_argument("--memory-budget-mb", type=float, default=4000.0)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine, 3 documents, nothing saved")
    args = parser.parse_args()
    if args.smoke:
        args.docs, args.memory_budget_mb = 3, 1500.0
    docs = load_documents(args.docs)
    results: dict[str, Any] = {"documents": len(docs), "budget_mb": args.memory_budget_mb,
                               "chain_concurrency": args.chain_concurrency}
    with served(args.smoke, args.memory_budget_mb) as base:
        first = residency(base)
        model_a = first["resident"][0]
        model_b = next(m for m in first["managed"] if m != model_a)
        models = (model_a, model_b)
        results["models"] = list(models)
        runs = {"flowlift": lambda: flowlift_run(base, models, docs, "flowlift"),
                "per_document": lambda: asyncio.run(per_document(
                    base, models, docs, "chains", args.chain_concurrency)),
                "stage_by_stage": lambda: asyncio.run(stage_by_stage(
                    base, models, docs, "stages"))}
        for variant in args.variants:
            results[variant] = measure(base, variant, runs[variant], model_a)
        results["metrics_loads"] = [line for line in httpx.get(base + "/metrics").text
                                    .splitlines() if line.startswith("flowlift_model_loads")]
    if "flowlift" in results:
        fl = results["flowlift"]["makespan_s"] or 0.1
        results["ratios"] = {f"{v}_over_flowlift": round(results[v]["makespan_s"] / fl, 2)
                             for v in args.variants if v != "flowlift"}
        print(results["ratios"], flush=True)
    save("residency", results, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
