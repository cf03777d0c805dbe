"""Prefill-ahead on vs off: time to first token (TTFT) of the step that reads a tool's
output, on the embedded engine, side by side in one run (two proxies, the same model,
``--no-prefill-ahead`` on the second).

Workloads (documents: the example's corpus, real Python standard-library docstrings):

* ``tool``: per document, ``topic`` (a short prompt with the module's name only) ->
  ``fetch`` (a ``@tool`` that takes ``--tool-s`` seconds, as a search or database call
  does) -> ``explain`` (the whole documentation, the topic, then the tool's result, then
  the question). While ``fetch`` is out, the proxy can prefill ``explain`` up to the
  tool's hole: the documentation was never in any earlier prompt.
  ``sequential``: one document at a time (unloaded); ``concurrent``: all in one run.
* ``agent``: an agent step (``tool_choice="required"``, two turns) whose system prompt
  holds the documentation; its tool takes ``--tool-s`` seconds. Turn 2's TTFT: the
  conversation is cached from turn 1 anyway; ahead adds turn 1's call and the results'
  wrapper.
* ``example``: the example pipeline (extract -> classify -> related (BM25 ``@tool``,
  milliseconds) -> summarize) over ``--docs`` documents, one run: ``summarize``'s TTFT.

TTFT here is the engine's: the step's last attempt from its start (slot granted) to its
first token, from the run's trace.

    python bench/prefill_ahead.py            # real engine (~6 min)
    python bench/prefill_ahead.py --smoke    # fake engine, seconds, nothing saved
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import proxy, save
from examples.stdlib_docs import pipeline
from examples.stdlib_docs.corpus import Document, load_documents
from flowlift import WorkflowFailed, step, tool, workflow

TOOL_S = [1.0]  # the tool's latency (set from --tool-s)


@step(max_tokens=4, name="topic")
def topic(doc: Document) -> str:
    return f"Python module {doc.name}. Its topic in one or two words:"


@tool
def fetch(topic_text: Any) -> str:
    time.sleep(TOOL_S[0])
    return f"internal notes on {str(topic_text).strip()[:40]}: no open issues."


@step(max_tokens=12, name="explain")
def explain(doc: Document, topic_text: Any, notes: Any, tag: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You explain Python modules to new engineers."},
            {"role": "user", "content": (
                f"[{tag}] Documentation of the {doc.name} module:\n{doc.text}\n\n"
                f"Topic: {topic_text}\nNotes: {notes}\n"
                f"Explain what {doc.name} is for in one short sentence.")}]


@tool
def look_up(query: str) -> str:
    """Look a term up in the team's notes."""
    time.sleep(TOOL_S[0])
    return f"notes for {query[:40]}: nothing unusual."


def agent_step(doc: Document) -> Any:
    @step(tools=[look_up], max_turns=2, tool_choice="required", max_tokens=96, name="agent")
    def agent() -> list[dict[str, str]]:
        return [{"role": "system", "content": (
                    f"[{time.time_ns()}] You answer questions about the Python {doc.name} "
                    f"module. Its documentation:\n{doc.text}\nUse look_up before you "
                    "answer.")},
                {"role": "user", "content": f"What should I know before using {doc.name}?"}]
    return agent


def _ttft(record: dict[str, Any], attempt: int = -1) -> dict[str, Any]:
    a = record["attempts"][attempt]
    return {"ttft_ms": round(a["first_token_ms"] - a["started_ms"], 1),
            "prompt_tokens": a["prompt_tokens"], "cached_tokens": a["cached_tokens"]}


def _records(wf: Any, name: str) -> list[dict[str, Any]]:
    return [r for r in wf.trace if r.get("type") == "step" and r.get("name") == name
            and r.get("attempts") and r["attempts"][-1].get("first_token_ms") is not None]


def run_tool(base: str, docs: list[Document], concurrent: bool) -> list[dict[str, Any]]:
    """``explain``'s TTFT per document (``tag``: unique per call, so no earlier run's
    prompt is in the cache)."""
    rows: list[dict[str, Any]] = []
    batches = [docs] if concurrent else [[d] for d in docs]
    for batch in batches:
        with workflow("bench-prefill-ahead", base_url=base, progress=False) as wf:
            for doc in batch:
                t = topic(doc)
                explain(doc, t, fetch(t), str(time.time_ns()))
        rows += [_ttft(r) for r in _records(wf, "explain")]
    return rows


def run_agent(base: str, docs: list[Document]) -> list[dict[str, Any]]:
    rows = []
    for doc in docs:
        try:
            with workflow("bench-prefill-ahead-agent", base_url=base, progress=False) as wf:
                agent_step(doc)()
        except WorkflowFailed:
            pass  # turn 2 asks for a call again (required) and max_turns ends the step
        rows += [_ttft(r, 1) for r in _records(wf, "agent") if len(r["attempts"]) > 1]
    return rows


def run_example(base: str, docs: list[Document]) -> list[dict[str, Any]]:
    pipeline.corpus_index()
    try:
        with workflow("bench-prefill-ahead-example", base_url=base, workflow_class="batch",
                      progress=False) as wf:
            for doc in docs:
                facts = pipeline.extract(doc)
                label = pipeline.classify_single(doc, facts)
                pipeline.summarize(doc, facts, label, pipeline.related(facts, doc.name))
    except WorkflowFailed:
        pass  # a failed step is left out of the figures
    return [_ttft(r) for r in _records(wf, "summarize")]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"n": 0}
    ttft = [r["ttft_ms"] for r in rows]
    return {"n": len(rows), "ttft_median_ms": round(statistics.median(ttft), 1),
            "ttft_mean_ms": round(statistics.fmean(ttft), 1),
            "prompt_tokens_mean": round(statistics.fmean(r["prompt_tokens"] for r in rows)),
            "cached_tokens_mean": round(statistics.fmean(r["cached_tokens"] for r in rows))}


WORKLOADS = ("tool_sequential", "tool_concurrent", "agent", "example")


def measure(base: str, docs: list[Document], example_docs: list[Document],
            only: tuple[str, ...] = WORKLOADS) -> dict[str, Any]:
    run_tool(base, docs[:1], concurrent=False)  # warm-up: the shared system prompt
    runs = {"tool_sequential": lambda: run_tool(base, docs, concurrent=False),
            "tool_concurrent": lambda: run_tool(base, docs, concurrent=True),
            "agent": lambda: run_agent(base, docs),
            "example": lambda: run_example(base, example_docs)}
    return {name: summary(runs[name]()) for name in only}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=6, help="documents per workload")
    parser.add_argument("--example-docs", type=int, default=12)
    parser.add_argument("--tool-s", type=float, default=1.0, help="the tool's latency")
    parser.add_argument("--context-docs", type=int, default=3,
                        help="documents joined into the context of explain and the agent "
                             "(each is at most 1,200 characters)")
    parser.add_argument("--only", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--out", default="prefill_ahead", help="results name")
    parser.add_argument("--smoke", action="store_true", help="fake engine, 2 documents")
    args = parser.parse_args(argv)
    if args.smoke:
        args.docs, args.example_docs, args.tool_s = 2, 2, 0.05
    TOOL_S[0] = args.tool_s
    all_docs = load_documents(None)
    k = max(args.context_docs, 1)
    docs = [Document(name=all_docs[i].name, text="\n\n".join(
                d.text for d in all_docs[i:i + k]), reference_area="")
            for i in range(0, k * args.docs, k)][:args.docs]
    example_docs = all_docs[:args.example_docs]
    engine = "fake" if args.smoke else "vllm"
    results: dict[str, Any] = {
        "command": "python bench/prefill_ahead.py " + " ".join(argv or sys.argv[1:]),
        "engine": "fake (smoke)" if args.smoke else
        "embedded vLLM CPU build, SmolLM2-135M-Instruct, 2 CPU cores shared with others",
        "tool_s": args.tool_s, "docs": [d.name for d in docs],
        "context_chars_mean": round(statistics.fmean(len(d.text) for d in docs))}
    for label, flags in (("on", ()), ("off", ("--no-prefill-ahead",))):
        with proxy("--max-concurrency", "4", *flags, name=f"prefill_ahead_{label}",
                   engine=engine) as base:
            results[label] = measure(base, docs, example_docs, tuple(args.only))
        print(label, results[label], flush=True)
    results["ttft_off_over_on"] = {
        k: round(results["off"][k]["ttft_median_ms"] / results["on"][k]["ttft_median_ms"], 2)
        for k in results["on"] if results["on"][k].get("n") and results["off"][k].get("n")}
    print("TTFT median, off / on:", results["ttft_off_over_on"], flush=True)
    save(args.out, results, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
