"""Documentation triage over the Python standard library's own module docstrings.

One workflow; four steps per document; every document in the same graph::

    extract (LLM, JSON) -> classify (LLM, label) -> related (tool, BM25) -> summarize (LLM)
       `-- facts.purpose, facts.key_terms feed classify, related and summarize --'

Run it through the proxy (one is started for you when none answers)::

    flowlift run examples/stdlib_docs/pipeline.py [--limit N] [--trace PATH]

Exit status: 0 when every step succeeded; 1 when some failed (the table still prints,
with the failed rows marked); 2 when no proxy could be reached.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

if __package__ in (None, ""):  # run as a script: make `examples.stdlib_docs` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.stdlib_docs.corpus import LICENSE, Area, Document, load_documents, truncate
from examples.stdlib_docs.index import BM25Index
from flowlift import (
    FlowliftError,
    ProxyUnavailable,
    WorkflowFailed,
    step,
    tool,
    workflow,
)

DEFAULT_TRACE = "runs/stdlib_docs.trace.jsonl"

# One shared system message opens every LLM prompt, so the engine's prefix cache
# computes it once and reuses it for all 3 x N model calls.
PREAMBLE = """\
You are a documentation triage assistant for a team that maintains an internal \
guide to the Python standard library. For each module, the team reads the \
module's own docstring and files a short triage record.

Conventions of the triage record:
- Work only from the documentation text you are given. Do not invent functions, \
classes or behaviour that the text does not mention.
- The purpose is one plain sentence saying what the module is for, starting with \
a verb, for example "Reads and writes CSV files."
- Key terms are at most three short noun phrases a reader would search for, \
such as a file format, a protocol or a data structure. Prefer names that appear \
in the text.
- The area is exactly one of: data formats, text processing, networking, files \
and processes, developer tools, math and algorithms. Choose the area of the \
module's main job, not of its examples.
- Summaries are one sentence of at most 25 words for a table row, with no \
markdown, no lists and no line breaks.
- Be literal and brief; when the text is unclear, say less rather than guess."""

CLASSIFY_EXCERPT_CHARS = 400

Term = Annotated[str, StringConstraints(min_length=1, max_length=24)]


class ModuleFacts(BaseModel):
    """What ``extract`` pulls out of one docstring (bounded, so decoding ends early)."""

    purpose: str = Field(min_length=1, max_length=120,
                         description="one sentence: what the module is for")
    key_terms: list[Term] = Field(min_length=1, max_length=3,
                                  description="up to three search terms")


def _header(doc: Document) -> str:
    # extract and classify open their user message the same way, so one document's
    # two prompts share a prefix beyond the preamble.
    return f"Module: {doc.name}\nDocumentation:\n"


@step(output=ModuleFacts, max_tokens=96)
def extract(doc: Document) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": PREAMBLE},
        {"role": "user", "content": (
            f"{_header(doc)}{doc.text}\n\n"
            "Task: fill in the triage record's purpose and key terms as JSON.")},
    ]


@step(output=Area, max_tokens=8)
def classify(doc: Document, facts: Any) -> list[dict[str, Any]]:
    excerpt = truncate(doc.text, CLASSIFY_EXCERPT_CHARS)
    return [
        {"role": "system", "content": PREAMBLE},
        {"role": "user", "content": (
            f"{_header(doc)}{excerpt}\n...\n\n"
            f"Purpose: {facts.purpose}\n"
            "Task: name the area of this module.")},
    ]


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


def related_modules(facts: ModuleFacts, module: str, k: int = 3) -> dict[str, float]:
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
    return {name: round(score, 2) for name, score in hits}


@tool
def related(facts: ModuleFacts, module: str) -> dict[str, float]:
    """Client-run: top-3 related modules (name -> BM25 score) from the local index."""
    return related_modules(facts, module)


@step(max_tokens=48, stop=["\n"])
def summarize(doc: Document, facts: Any, label: Any, rel: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": PREAMBLE},
        {"role": "user", "content": (
            f"Module: {doc.name}\n"
            f"Area: {label}\n"
            f"Purpose: {facts.purpose}\n"
            f"Key terms: {facts.key_terms}\n"
            f"Related modules (with search scores): {rel}\n"
            "Task: write the one-sentence summary for the triage table.")},
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
            "related": ", ".join(rel) if rel else "-",
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

    outs: list[dict[str, Any]] = []
    failed_run: WorkflowFailed | None = None
    try:
        with workflow("stdlib-docs", workflow_class="batch", trace_path=args.trace,
                      metadata={"example": "stdlib_docs", "documents": len(docs)}) as wf:
            for doc in docs:
                facts = extract(doc)
                label = classify(doc, facts)
                rel = related(facts, doc.name)
                summary = summarize(doc, facts, label, rel)
                outs.append({"facts": facts, "label": label, "related": rel,
                             "summary": summary})
    except WorkflowFailed as exc:
        failed_run = exc
    except ProxyUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    rows = collect(docs, outs)
    width = args.width or max(shutil.get_terminal_size((140, 24)).columns, 120)
    print(table(rows, width))
    print()
    classified = [r for r in rows if r["area"] != "FAILED"]
    agree = sum(r["area"] == r["reference"] for r in classified)
    print(f"area matches the reference label for {agree}/{len(classified)} classified "
          "documents (labels in corpus.MODULES)")
    print()
    print(wf.report())
    print()
    print(f"trace: {wf.trace_path}")
    print(f"run id: {wf.run_id} ({wf.status})")
    if failed_run is not None:
        n_rows = sum(bool(r["failed"]) for r in rows)
        print(f"\n{len(wf.failures)} step(s) failed, in {n_rows} document(s) "
              "(rows marked !):")
        for step_id, error in wf.failures.items():
            print(f"  {step_id}: {_cut(error, 200)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
