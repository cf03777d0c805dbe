"""P12 (issue 35 §5): a three-step pipeline per document, a KV cache a third of the
corpus, a stage-by-stage client on stock vLLM against flowlift's consolidated graph.

Each document of examples/stdlib_docs (Python module docstrings) gets three greedy
steps that all start with the same system line and the document's text: *names* (its
key functions), *area* (reads the names), *use* (reads both). Arms, one after another
in one run, each with its own tag at the prompt's start (no arm reuses another's
cache):

* ``stock``: a stage-by-stage asyncio client (every document's first step, then every
  second, then every third; ``--concurrency`` requests in flight, as a plain
  ``asyncio.gather`` under a semaphore) against a stock ``vllm serve``;
* ``dropin``: the same client against ``flowlift serve``'s ``/v1/chat/completions``;
* ``graph``: one workflow (``with workflow(...)``, the three steps per document as
  Semantic Variables) on the same ``flowlift serve``: its document chains
  (:mod:`flowlift.chains`) are working-set sessions;
* ``graph_flat``: the same workflow on a ``flowlift serve --no-working-set`` (the run
  ordered by critical path alone: what flowlift did before chains).

Both servers get the same engine arguments (:mod:`bench.peers.servers`) and a KV cache
of ``--kv-cache-blocks`` blocks (default: a third of the corpus' tokens, rounded to
blocks of ``--block`` tokens). Per arm: makespan, prompt and cached tokens, cached
share, and *re-prefilled* tokens: of each second and third step, the whole blocks it
shares with the document's earlier steps (counted with the model's tokenizer on the
chat template) that the engine did not serve from cache.

    .venv/bin/python bench/peers/pipeline.py [--docs 36] [--arms stock dropin graph]
    .venv/bin/python bench/peers/pipeline.py --smoke  # seconds: fake engines, plumbing
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import RESULTS, save
from bench.peers import servers
from bench.peers.run import model_dir
from examples.stdlib_docs.corpus import Document, load_documents
from flowlift import step, workflow

SYSTEM = "You catalogue Python standard library modules. Answer briefly."
TASKS = ("Name the module's three most important functions or classes.",
         "In two or three words, which area does the module belong to?",
         "In one sentence, when should a programmer use the module?")
MAX_TOKENS = (24, 6, 24)
ARMS = ("stock", "dropin", "graph", "graph_flat")
Messages = list[dict[str, str]]


def messages(tag: str, doc: Document, stage: int, earlier: Sequence[Any]) -> Messages:
    """Step ``stage`` (0-2) of ``doc``: the document first, then what earlier steps
    said (``earlier``: their outputs, or Semantic Variables in the graph arm)."""
    text = f"Module {doc.name}:\n\n{doc.text}\n\n"
    if stage >= 1:
        text += f"Key names: {earlier[0]}\n"
    if stage >= 2:
        text += f"Area: {earlier[1]}\n"
    return [{"role": "system", "content": f"[{tag}] {SYSTEM}"},
            {"role": "user", "content": text + f"Task: {TASKS[stage]}"}]


STEPS = [step(max_tokens=MAX_TOKENS[s], name=f"stage{s}")(
    lambda tag, doc, *earlier, s=s: messages(tag, doc, s, earlier)) for s in range(3)]


async def stage_by_stage(base: str, tag: str, docs: list[Document],
                         concurrency: int) -> tuple[list[dict[str, Any]], float]:
    """The request-level client: every document's step 0, then 1, then 2."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                timeout=3600)
    sem = asyncio.Semaphore(concurrency)
    model = servers.model_id(base)
    outputs: list[list[str]] = [[] for _ in docs]
    rows: list[dict[str, Any]] = []

    async def one(i: int, stage: int) -> None:
        msgs = messages(tag, docs[i], stage, outputs[i])
        async with sem:
            r = await client.chat.completions.create(
                model=model, messages=msgs, max_tokens=MAX_TOKENS[stage],  # type: ignore[arg-type]
                temperature=0.0)
        outputs[i].append(r.choices[0].message.content or "")
        details = r.usage.prompt_tokens_details if r.usage else None
        rows.append({"doc": i, "stage": stage, "messages": msgs,
                     "prompt_tokens": r.usage.prompt_tokens if r.usage else 0,
                     "cached_tokens": (details.cached_tokens or 0) if details else 0})

    t0 = time.monotonic()
    for stage in range(3):
        await asyncio.gather(*(one(i, stage) for i in range(len(docs))))
    makespan = time.monotonic() - t0
    await client.close()
    return rows, makespan


def graph(base: str, tag: str, docs: list[Document]) -> tuple[list[dict[str, Any]], float]:
    """One workflow: every document's three steps, the proxy schedules them."""
    t0 = time.monotonic()
    ids: dict[str, tuple[int, int]] = {}
    with workflow(f"p12-{tag}", base_url=base) as wf:
        for i, doc in enumerate(docs):
            earlier: list[Any] = []
            for s, fn in enumerate(STEPS):
                earlier.append(fn(tag, doc, *earlier))
                ids[earlier[-1].step_id] = (i, s)
    makespan = time.monotonic() - t0
    outputs = wf.outputs
    by_doc = {(i, s): sid for sid, (i, s) in ids.items()}
    rows = []
    for r in wf.trace:
        if r.get("kind") != "llm" or r["step_id"] not in ids:
            continue
        i, s = ids[r["step_id"]]
        said = [str(outputs.get(by_doc[i, t], "")) for t in range(s)]
        rows.append({"doc": i, "stage": s, "messages": messages(tag, docs[i], s, said),
                     "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"]})
    return rows, makespan


def shared_blocks(rows: list[dict[str, Any]], tokens: Callable[[Messages], list[int]],
                  block: int) -> None:
    """Each row's ``reusable_tokens``: the whole blocks its prompt shares with the same
    document's earlier steps (its first step: none)."""
    seen: dict[int, list[list[int]]] = {}
    for r in sorted(rows, key=lambda r: (r["doc"], r["stage"])):
        ids = tokens(r.pop("messages"))
        best = 0
        for earlier in seen.get(r["doc"], []):
            n = 0
            while n < min(len(ids), len(earlier)) and ids[n] == earlier[n]:
                n += 1
            best = max(best, n)
        r["reusable_tokens"] = best // block * block
        seen.setdefault(r["doc"], []).append(ids)


def summary(rows: list[dict[str, Any]], makespan: float) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    again = sum(max(0, r["reusable_tokens"] - r["cached_tokens"]) for r in rows)
    return {"makespan_s": round(makespan, 1), "steps": len(rows), "prompt_tokens": prompt,
            "cached_tokens": cached, "cached_share": round(cached / max(prompt, 1), 3),
            "reusable_tokens": sum(r["reusable_tokens"] for r in rows),
            "reprefilled_tokens": again}


def tokenizer(model: str, smoke: bool) -> Callable[[Messages], list[int]]:
    """Messages -> token ids as the server renders them (smoke: words)."""
    if smoke:
        return lambda msgs: [hash(w) for m in msgs for w in m["content"].split()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return lambda msgs: list(tok.encode(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--docs", type=int, default=36)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--model", default=None)
    p.add_argument("--kv-cache-blocks", type=int, default=None,
                   help="default: a third of the corpus' tokens")
    p.add_argument("--block", type=int, default=128, help="KV block size (vLLM CPU: 128)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16,
                   help="the stage-by-stage client's requests in flight")
    p.add_argument("--out", default="peers_pipeline")
    p.add_argument("--smoke", action="store_true", help="fake engines, 4 documents")
    args = p.parse_args(argv)
    if args.smoke:
        args.docs, args.concurrency = 4, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    docs = load_documents(args.docs)
    model = "fake" if args.smoke else model_dir(args.model)
    tokens = tokenizer(model, args.smoke)
    corpus = sum(len(tokens(messages("corpus", d, 0, []))) for d in docs)
    blocks = args.kv_cache_blocks or max(1, round(corpus / 3 / args.block))
    engine = servers.EngineArgs(model, 1, args.max_num_seqs, max_model_len=2048,
                                kv_cache_blocks=blocks)
    results: dict[str, Any] = {
        "command": "python bench/peers/pipeline.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "vllm": servers.vllm_version(), "documents": len(docs),
        "corpus_tokens": corpus, "kv_cache_blocks": blocks,
        "kv_cache_tokens": blocks * args.block,
        "stock_command": " ".join(servers.stock_command(engine, 0)[1:]),
        "flowlift_command": "flowlift serve " + " ".join(servers.flowlift_args(engine)),
        "machine": "2 CPU cores, shared with other helpers' work while measuring",
        "arms": {}}
    print(f"{len(docs)} documents, {corpus} tokens; KV cache {blocks} blocks "
          f"= {blocks * args.block} tokens; {results['vllm']}", flush=True)
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory())) if args.smoke \
            else RESULTS
        # the smoke: one fake flowlift serve for every arm (plumbing; tags keep them apart)
        fake = stack.enter_context(servers.flowlift(engine, logs / "fake.log", fake=True)) \
            if args.smoke else None
        for arm in args.arms:
            log = logs / f"{args.out}_{arm}.log"
            log.unlink(missing_ok=True)
            with contextlib.ExitStack() as server:  # a fresh server per arm: a cold cache
                if fake is not None:
                    base = fake
                elif arm == "stock":
                    base = server.enter_context(servers.stock_vllm(engine, log))
                else:
                    flags = ("--no-working-set",) if arm == "graph_flat" else ()
                    base = server.enter_context(servers.flowlift(engine, log, *flags))
                if arm in ("stock", "dropin"):
                    rows, makespan = asyncio.run(stage_by_stage(base, arm, docs,
                                                                args.concurrency))
                else:
                    rows, makespan = graph(base, arm, docs)
            shared_blocks(rows, tokens, args.block)
            results["arms"][arm] = s = summary(rows, makespan)
            print(f"  {arm:10s} {s}", flush=True)
            save(args.out, results, smoke=args.smoke)
    arms = results["arms"]
    if "stock" in arms:
        results["stock_over"] = {a: round(arms["stock"]["makespan_s"] / s["makespan_s"], 2)
                                 for a, s in arms.items() if a != "stock"}
        print("makespan stock / arm:", results["stock_over"], flush=True)
    save(args.out, results, smoke=args.smoke)
    return 0 if all(s["steps"] == 3 * len(docs) for s in arms.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
