"""Documentation triage over the Python standard library's own module docstrings.

One workflow; four steps per document; every document in the same graph::

    extract (LLM, JSON) -> classify (LLM, label) -> related (tool, BM25) -> summarize (LLM)
       `-- facts.purpose, facts.key_terms feed classify, related and summarize --'

Run it through the proxy (one is started for you when none answers)::

    flowlift run --config examples/stdlib_docs/flowlift.toml \
        examples/stdlib_docs/pipeline.py [--limit N] [--trace PATH]

Contracts: ``extract`` is JSON-Schema constrained and retried once with the validation
errors fed back; ``classify`` is a fixed label set on the cascade ``small -> large``.

Exit status: 0 when every step succeeded; 1 when some failed (the table still prints,
with the failed rows marked); 2 when no proxy could be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import httpx
from pydantic import BaseModel, Field, StringConstraints

if __package__ in (None, ""):  # run as a script: make `examples.stdlib_docs` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.stdlib_docs.corpus import AREAS, LICENSE, Area, Document, load_documents
from examples.stdlib_docs.index import BM25Index
from flowlift import (
    FlowliftError,
    ProxyUnavailable,
    WorkflowFailed,
    step,
    tool,
    workflow,
)
from flowlift.sdk.workflow import DEFAULT_BASE_URL

DEFAULT_TRACE = "runs/stdlib_docs.trace.jsonl"

# One shared system message opens every LLM prompt, so the engine's prefix cache
# computes it once and reuses it for all 3 x N model calls.
PREAMBLE = """\
You write documentation triage records for a team that maintains an internal \
guide to the Python standard library. Each record describes one module, and you \
work only from the documentation text you are given.

Rules for every record:
- Never invent functions, classes or behaviour that the text does not mention.
- The purpose is one plain sentence that starts with a verb such as Provides, \
Implements, Defines, Supports, Parses or Converts, and says what the module is for.
- Key terms are at most three short lower-case phrases a reader would search for, \
taken from the text: a file format, a protocol, a data structure or a main class.
- The area is exactly one of: data formats, text processing, networking, files \
and processes, developer tools, math and algorithms. Choose the area of the \
module's main job, not of its examples.
- A summary is one short sentence for a table row, with no markdown, no lists \
and no line breaks.
- Be literal and brief. When the text is unclear, say less rather than guess."""


# Lower-case words only: keeps a 135M model from filling terms with punctuation.
Term = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9 ]{1,20}[a-z0-9]$")]
# Anchoring the first word keeps the model from echoing the prompt back.
PURPOSE_PATTERN = (r"^(Provides|Implements|Defines|Supports|Creates|Parses|Reads|Converts|"
                   r"Handles|Computes|Runs) [^\n\]\[{}]*$")


class ModuleFacts(BaseModel):
    """What ``extract`` pulls out of one docstring (bounded, so decoding ends early)."""

    purpose: str = Field(max_length=120, pattern=PURPOSE_PATTERN,
                         description="one sentence: what the module is for")
    key_terms: list[Term] = Field(min_length=1, max_length=3,
                                  description="up to three search terms")


@step(output=ModuleFacts, max_tokens=96, retries=1)
def extract(doc: Document) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": PREAMBLE},
        {"role": "user", "content": (
            f"Documentation of the {doc.name} module:\n{doc.text}\n\n"
            f"What is the {doc.name} module for? Answer in JSON with a one-sentence "
            "purpose and up to three key terms from the text.")},
    ]


# classify runs on a cascade (FrugalGPT): a label whose token probabilities are low
# (geometric mean under MIN_CONFIDENCE), or that fails its contract, goes on to the
# second model. examples/stdlib_docs/flowlift.toml (what scripts/demo.sh starts the
# proxy with) defines both names; a proxy without them runs classify on its default
# model alone, and the pipeline says so.
CASCADE = ("small", "large")
MIN_CONFIDENCE = 0.7


def classify_prompt(doc: Document, facts: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": PREAMBLE},
        {"role": "user", "content": (
            f"The {doc.name} module: {facts.purpose}\n"
            f"Which area is the {doc.name} module in: {', '.join(AREAS[:-1])}, or "
            f"{AREAS[-1]}?")},
    ]


classify = step(model=list(CASCADE), output=Area, max_tokens=8, retries=1,
                min_confidence=MIN_CONFIDENCE, name="classify")(classify_prompt)
classify_single = step(output=Area, max_tokens=8, retries=1, name="classify")(classify_prompt)


def cascade_served(base_url: str) -> bool:
    """Whether the proxy at ``base_url`` serves every model of :data:`CASCADE`."""
    try:
        listed = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return False  # the workflow itself reports an unreachable proxy
    served = {m.get("id") for m in listed.get("data", [])}
    return set(CASCADE) <= served


def escalations(trace: list[dict[str, Any]], name: str = "classify") -> tuple[int, int]:
    """(steps of ``name`` whose output came from a later cascade model, all of them)."""
    steps = [r for r in trace if r.get("type") == "step" and r.get("name") == name]
    moved = sum(1 for r in steps if len({a["model"] for a in r.get("attempts", [])}) > 1)
    return moved, len(steps)


_index: BM25Index | None = None
_texts: dict[str, str] = {}
_index_lock = threading.Lock()


def corpus_index() -> BM25Index:
    """The BM25 index over the whole corpus (built once, on first use)."""
    global _index
    with _index_lock:
        if _index is None:
            _texts.update((d.name, d.text) for d in load_documents())
            _index = BM25Index(_texts)
        return _index


def related_modules(facts: ModuleFacts, module: str, k: int = 3) -> dict[str, list[Any]]:
    """The ``k`` other modules that best match ``facts`` in the corpus index.

    The query is the key terms (counted twice) plus the purpose. When the facts match
    fewer than ``k`` modules (an uninformative extraction), the rest is filled with
    the modules most similar to ``module``'s own documentation.
    """
    index = corpus_index()
    query = " ".join([*facts.key_terms, *facts.key_terms, facts.purpose])
    hits = index.search(query, k, exclude=[module])
    if len(hits) < k:
        seen = {module, *(name for name, _ in hits)}
        hits += index.search(_texts.get(module, module), k - len(hits), exclude=seen)
    return {"modules": [name for name, _ in hits],
            "scores": [round(score, 2) for _, score in hits]}


@tool(pure=True)
def related(facts: ModuleFacts, module: str) -> dict[str, list[Any]]:
    """Client-run: the top-3 related modules and their BM25 scores, from the local index
    (``{"modules": [...], "scores": [...]}``)."""
    return related_modules(facts, module)


@step(max_tokens=48, stop=["\n"])
def summarize(doc: Document, facts: Any, label: Any, rel: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": PREAMBLE},
        {"role": "user", "content": (
            f"The {doc.name} module ({label}): {facts.purpose} "
            f"Key terms: {facts.key_terms}. Related modules: {rel.modules}.\n"
            f"Describe the {doc.name} module in one short sentence.")},
    ]


# -- output -----------------------------------------------------------------------------

def _cut(text: Any, width: int) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= width else flat[:max(width - 3, 0)] + "..."


def _read(var: Any) -> tuple[Any, str | None]:
    """(value, None), or (None, the step id) when that step failed or never ran."""
    try:
        return var.value, None
    except FlowliftError:
        return None, var.step_id


def collect(docs: list[Document], outs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per document; failed steps are named in ``failed``."""
    rows = []
    for doc, out in zip(docs, outs, strict=True):
        facts, f_fail = _read(out["facts"])
        label, l_fail = _read(out["label"])
        rel, r_fail = _read(out["related"])
        summary, s_fail = _read(out["summary"])
        failed = [s for s in (f_fail, l_fail, r_fail, s_fail) if s]
        rows.append({
            "module": doc.name,
            "area": label if label is not None else "FAILED",
            "key terms": ", ".join(facts.key_terms) if facts is not None else "-",
            "related": ", ".join(rel["modules"]) if rel else "-",
            "summary": (summary.strip() if summary is not None
                        else f"FAILED ({', '.join(failed)})"),
            "reference": doc.reference_area,
            "failed": failed,
        })
    return rows


def table(rows: list[dict[str, Any]], width: int) -> str:
    """A plain-text table: module | area | key terms | related | summary."""
    fixed = {"module": 15, "area": 19, "key terms": 26, "related": 28}
    widths = {**fixed, "summary": max(width - sum(fixed.values()) - 3 * len(fixed), 24)}
    out = [" | ".join(f"{h:<{w}}" for h, w in widths.items()).rstrip(),
           "-+-".join("-" * w for w in widths.values())]
    for row in rows:
        mark = "!" if row["failed"] else ""
        cells = {**row, "module": mark + row["module"]}
        out.append(" | ".join(f"{_cut(cells[h], w):<{w}}" for h, w in widths.items()).rstrip())
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None,
                        help="only the first N documents (default: all)")
    parser.add_argument("--trace", default=DEFAULT_TRACE,
                        help=f"write the run's trace here (default {DEFAULT_TRACE})")
    parser.add_argument("--width", type=int, default=None,
                        help="table width in characters (default: the terminal's, "
                             "at least 120)")
    parser.add_argument("--dump-graph", metavar="PATH", default=None,
                        help="only record the workflow and write its graph (JSON) here, "
                             "for `flowlift compile PATH`")
    args = parser.parse_args(argv)

    docs = load_documents(args.limit)
    if not docs:
        print("error: no documents to process", file=sys.stderr)
        return 2
    corpus_index()  # build it now, not inside the first tool call
    chars = sum(len(d.text) for d in docs)
    print(f"stdlib-docs: {len(docs)} documents, {chars} characters (~{chars // 4} tokens)")
    print(f"source: Python {platform.python_version()} standard library, module "
          "docstrings (inspect.getdoc), each cut to at most 1,200 characters")
    print(f"licence: {LICENSE}")
    print()

    labeller = classify
    if args.dump_graph is None and not cascade_served(
            os.environ.get("FLOWLIFT_BASE_URL", DEFAULT_BASE_URL)):
        labeller = classify_single
        print(f"note: this proxy does not serve the cascade {' -> '.join(CASCADE)} (start it "
              "with --config examples/stdlib_docs/flowlift.toml); classify runs on the "
              "default model alone")
        print()
    outs: list[dict[str, Any]] = []
    failed_run: WorkflowFailed | None = None
    try:
        with workflow("stdlib-docs", workflow_class="batch", trace_path=args.trace,
                      metadata={"example": "stdlib_docs", "documents": len(docs)},
                      submit=args.dump_graph is None) as wf:
            for doc in docs:
                facts = extract(doc)
                label = labeller(doc, facts)
                rel = related(facts, doc.name)
                summary = summarize(doc, facts, label, rel)
                outs.append({"facts": facts, "label": label, "related": rel,
                             "summary": summary})
    except WorkflowFailed as exc:
        failed_run = exc
    except ProxyUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if args.dump_graph is not None:
        path = Path(args.dump_graph)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(wf.graph().to_wire(), indent=1))
        print(f"graph of {len(wf.nodes)} steps written to {path}")
        return 0
    rows = collect(docs, outs)
    width = args.width or max(shutil.get_terminal_size((140, 24)).columns, 120)
    print(table(rows, width))
    print()
    classified = [r for r in rows if r["area"] != "FAILED"]
    agree = sum(r["area"] == r["reference"] for r in classified)
    print(f"area matches the reference label for {agree}/{len(classified)} classified "
          "documents (labels in corpus.MODULES)")
    print()
    if labeller is classify:
        moved, total = escalations(wf.trace)
        print(f"classify cascade {' -> '.join(CASCADE)} (confidence floor {MIN_CONFIDENCE}): "
              f"{moved}/{total} labels escalated to {CASCADE[-1]}")
    print(wf.report())
    print()
    print(f"trace: {wf.trace_path}")
    print(f"run id: {wf.run_id} ({wf.status})")
    if failed_run is not None:
        n_rows = sum(bool(r["failed"]) for r in rows)
        print(f"\n{len(wf.failures)} step(s) failed, in {n_rows} document(s) "
              "(rows marked !):")
        for step_id, error in wf.failures.items():
            print(f"  {step_id}: {_cut(str(error), 200)}")
        return 1
    return 0


if __name__ == "__main__":
    from flowlift.tracing import configure_tracing

    # the app's own spans (OTLP if OTEL_EXPORTER_OTLP_ENDPOINT is set), in one trace with
    # the proxy's: `flowlift run` has the proxy write its spans to runs/traces/spans.jsonl
    configure_tracing("stdlib-docs", jsonl_path="runs/stdlib_docs.spans.jsonl")
    sys.exit(main())
