"""Documentation triage over the Python standard library's own module docstrings.

One workflow; four steps per document; every document in the same graph::

    extract (LLM, JSON) -> classify (LLM, label) -> related (tool, BM25) -> summarize (LLM)
       `-- facts.purpose, facts.key_terms feed classify, related and summarize --'

Run it through the proxy (one is started for you when none answers)::

    flowlift run --config examples/stdlib_docs/flowlift.toml \
        examples/stdlib_docs/pipeline.py [--limit N] [--trace PATH]

Contracts: ``extract`` is JSON-Schema constrained (its key terms an enum of the
document's own phrases, so every term occurs in the module's documentation: the table's
check says how many) and retried once with the validation errors fed back; ``classify``
is a fixed label set on the cascade ``small -> large``.

Detached, under a deadline of hours (``examples/stdlib_docs/tiered.py`` runs both halves
against a fake OpenAI with a Batch API)::

    python examples/stdlib_docs/pipeline.py --detach --deadline-hours 6   # returns at once
    python examples/stdlib_docs/pipeline.py --attach runs/stdlib_docs.run.json

``--detach`` submits the run and writes its handle (the run id and each document's step
ids) to ``--handle``; ``--attach HANDLE`` follows that run, runs its ``related`` tool
steps here (``flowlift.attach(..., tools=[related])``), and prints the table, the tier
that served each step and the cost against every step on the standard tier.

Exit status: 0 when every step succeeded; 1 when some failed (the table still prints,
with the failed rows marked); 2 when no proxy could be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from pydantic import BaseModel, Field, StringConstraints, create_model

if __package__ in (None, ""):  # run as a script: make `examples.stdlib_docs` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.stdlib_docs.corpus import AREAS, LICENSE, Area, Document, load_documents
from examples.stdlib_docs.index import BM25Index
from flowlift import (
    FlowliftError,
    ProxyUnavailable,
    WorkflowFailed,
    attach,
    step,
    tool,
    workflow,
)
from flowlift.sdk.workflow import DEFAULT_BASE_URL

DEFAULT_TRACE = "runs/stdlib_docs.trace.jsonl"
DEFAULT_HANDLE = "runs/stdlib_docs.run.json"
STAGES = ("facts", "label", "related", "summary")

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
- Key terms are one to three short lower-case phrases copied word for word from the \
documentation text: the names a reader would search for.
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


# Key terms come from the module's own text: each document's `extract` contract lists
# the phrases of its documentation (one to three words that stand next to each other in
# it, between punctuation), so schema-constrained decoding can write no other term. A
# model told "a file format, a protocol..." in the system prompt copied those words
# otherwise (issue 38: "file format, network" for 13 of 42 modules). `grounded` is the
# check the demo prints; the contract makes it hold by construction.
STOPWORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "been", "but", "by", "can", "do", "does",
    "for", "from", "has", "have", "he", "how", "if", "in", "into", "is", "it", "its",
    "may", "more", "most", "must", "no", "not", "of", "on", "one", "only", "or", "other",
    "our", "should", "so", "some", "such", "than", "that", "the", "their", "then",
    "there", "these", "they", "this", "those", "to", "use", "used", "uses", "using",
    "was", "we", "what", "when", "where", "which", "while", "who", "will", "with",
    "would", "you", "your", "also", "any", "all", "each", "both", "every", "many", "much",
    "very", "via", "e", "g", "i", "ie", "eg", "etc", "see"})
MAX_CANDIDATES = 400


def candidate_terms(text: str, limit: int = MAX_CANDIDATES) -> list[str]:
    """The phrases of ``text`` a key term may be, first seen first: runs of one to three
    words with nothing but spaces between them (punctuation, a URL or a reST role such as
    ``:mod:`` ends a run), lower-cased, neither starting nor ending with a stop word, that
    fit :data:`Term`."""
    fits = re.compile(r"^[a-z][a-z0-9 ]{1,20}[a-z0-9]$")
    out: dict[str, None] = {}
    prose = re.sub(r"<?https?://\S+|:[a-z]+:", "|", text)  # (URLs, reST roles: markup)
    for run in re.split(r"[^A-Za-z0-9\s]+", prose):
        words = run.lower().split()
        for n in (1, 2, 3):
            for k in range(len(words) - n + 1):
                gram = words[k:k + n]
                if gram[0] in STOPWORDS or gram[-1] in STOPWORDS:
                    continue
                phrase = " ".join(gram)
                if fits.match(phrase) and not phrase[0].isdigit():
                    out.setdefault(phrase)
    return list(out)[:limit]


def grounded(term: str, text: str) -> bool:
    """Whether ``term`` occurs in ``text`` word for word (case and line breaks aside)."""
    flat = " ".join(re.split(r"[^a-z0-9]+", text.lower()))
    return f" {' '.join(term.lower().split())} " in f" {flat} "


_facts_models: dict[str, type[ModuleFacts]] = {}


def facts_model(doc: Document) -> type[ModuleFacts]:
    """``doc``'s :class:`ModuleFacts`: its key terms are an enum of the document's own
    phrases (:func:`candidate_terms`), so the engine can decode no other."""
    if doc.name not in _facts_models:
        terms = candidate_terms(doc.text)
        if not terms:  # (no phrase at all: the plain pattern)
            _facts_models[doc.name] = ModuleFacts
        else:
            _facts_models[doc.name] = create_model(
                f"FactsOf_{re.sub(r'[^A-Za-z0-9]', '_', doc.name)}", __base__=ModuleFacts,
                key_terms=(list[Literal[tuple(terms)]],  # type: ignore[valid-type]
                           Field(min_length=1, max_length=3,
                                 description="one to three phrases from the text")))
    return _facts_models[doc.name]


def extract_prompt(doc: Document) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": PREAMBLE},
        {"role": "user", "content": (
            f"Documentation of the {doc.name} module:\n{doc.text}\n\n"
            f"What is the {doc.name} module for? Answer in JSON with a one-sentence "
            "purpose and one to three key terms, each copied word for word from the "
            "documentation above.")},
    ]


def extract_step(doc: Document) -> Any:
    """The ``extract`` step for ``doc`` (a :func:`flowlift.step`: its prompt function
    and sampling parameters), under its own contract (:func:`facts_model`)."""
    return step(output=facts_model(doc), max_tokens=96, retries=1,
                name="extract")(extract_prompt)


def extract(doc: Document) -> Any:
    """The ``extract`` step of ``doc``, called: its Semantic Variable in a workflow."""
    return extract_step(doc)(doc)


# classify runs on a cascade (FrugalGPT): a label whose token probabilities are low
# (geometric mean under MIN_CONFIDENCE), or that fails its contract, goes on to the
# second model. examples/stdlib_docs/flowlift.toml (what scripts/demo.sh starts the
# proxy with) defines both names; a proxy without them runs classify on its default
# model alone, and the pipeline says so.
CASCADE = ("small", "large")
MIN_CONFIDENCE = 0.9  # the 0.5B model is sure of itself: 0.86-0.97 when wrong


# What each area holds, in the question: without it the 0.5B model files every module
# under the first area it reads (bench/RESULTS.md, "Models that can do the work").
AREA_HINTS = {  # in the spirit of the Library Reference's chapter titles
    "data formats": "file formats, serialization, compression, binary data",
    "text processing": "strings, regular expressions, comparing text, translation and "
                       "locale, pretty-printing",
    "networking": "sockets, servers, internet protocols and URLs",
    "files and processes": "paths, files, streams, processes, scheduling",
    "developer tools": "command-line parsing, parsing and inspecting code, typing, "
                       "testing, timing",
    "math and algorithms": "numbers, statistics, randomness, algorithms, conversions",
}


def classify_prompt(doc: Document, facts: Any) -> list[dict[str, Any]]:
    areas = ", ".join(f"{area} ({AREA_HINTS[area]})" for area in AREAS)
    return [
        {"role": "system", "content": PREAMBLE},
        {"role": "user", "content": (
            f"The {doc.name} module: {facts.purpose}\n"
            f"Which area is the {doc.name} module in? The areas: {areas}. Answer with "
            "the area's name.")},
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


class StepOutput:
    """One step's output in an attached run, read like a Semantic Variable's
    (``.value``, ``.step_id``; ``.value`` raises the step's failure)."""

    def __init__(self, run: Any, step_id: str, parse: Any = None) -> None:
        self.run, self.step_id, self.parse = run, step_id, parse

    @property
    def value(self) -> Any:
        raw = self.run.value(self.step_id)
        return self.parse(raw) if self.parse is not None else raw


def collect(docs: list[Document], outs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per document; failed steps are named in ``failed``."""
    rows = []
    for doc, out in zip(docs, outs, strict=True):
        facts, f_fail = _read(out["facts"])
        label, l_fail = _read(out["label"])
        rel, r_fail = _read(out["related"])
        summary, s_fail = _read(out["summary"])
        failed = [s for s in (f_fail, l_fail, r_fail, s_fail) if s]
        terms = list(facts.key_terms) if facts is not None else []
        rows.append({
            "module": doc.name,
            "terms found": (sum(grounded(t, doc.text) for t in terms), len(terms)),
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    parser.add_argument("--deadline-hours", type=float, default=None, metavar="H",
                        help="the whole run's deadline (a proxy with service tiers puts "
                             "each step on the cheapest tier that still makes it)")
    parser.add_argument("--detach", action="store_true",
                        help="submit the run and return at once, writing its handle to "
                             "--handle (follow it later with --attach)")
    parser.add_argument("--handle", default=DEFAULT_HANDLE, metavar="PATH",
                        help=f"where --detach writes the run's handle (default "
                             f"{DEFAULT_HANDLE})")
    parser.add_argument("--attach", metavar="HANDLE", default=None,
                        help="follow the detached run of this handle file: run its tool "
                             "steps here, then print its results")
    return parser.parse_args(argv)


def _banner(docs: list[Document]) -> None:
    chars = sum(len(d.text) for d in docs)
    print(f"stdlib-docs: {len(docs)} documents, {chars} characters (~{chars // 4} tokens)")
    print(f"source: Python {platform.python_version()} standard library, module "
          "docstrings (inspect.getdoc), each cut to at most 1,200 characters")
    print(f"licence: {LICENSE}")
    print()


def _labeller(args: argparse.Namespace) -> Any:
    if args.dump_graph is not None or cascade_served(
            os.environ.get("FLOWLIFT_BASE_URL", DEFAULT_BASE_URL)):
        return classify
    print(f"note: this proxy does not serve the cascade {' -> '.join(CASCADE)} (start it "
          "with --config examples/stdlib_docs/flowlift.toml); classify runs on the "
          "default model alone")
    print()
    return classify_single


def _record(docs: list[Document], labeller: Any) -> list[dict[str, Any]]:
    """The four steps of every document (inside the workflow block)."""
    outs: list[dict[str, Any]] = []
    for doc in docs:
        facts = extract(doc)
        label = labeller(doc, facts)
        rel = related(facts, doc.name)
        summary = summarize(doc, facts, label, rel)
        outs.append({"facts": facts, "label": label, "related": rel, "summary": summary})
    return outs


def _print_rows(docs: list[Document], rows: list[dict[str, Any]], width: int | None) -> None:
    width = width or max(shutil.get_terminal_size((140, 24)).columns, 120)
    print(table(rows, width))
    print()
    classified = [r for r in rows if r["area"] != "FAILED"]
    agree = sum(r["area"] == r["reference"] for r in classified)
    print(f"area matches the reference label for {agree}/{len(classified)} classified "
          "documents (labels in corpus.MODULES)")
    found = sum(r["terms found"][0] for r in rows)
    terms = sum(r["terms found"][1] for r in rows)
    whole = sum(1 for r in rows if r["terms found"][1] and r["terms found"][0] == r[
        "terms found"][1])
    print(f"key terms found word for word in their module's documentation: {found}/{terms} "
          f"(every term found for {whole}/{len(rows)} documents)")
    print()


def _print_failures(failures: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    n_rows = sum(bool(r["failed"]) for r in rows)
    print(f"\n{len(failures)} step(s) failed, in {n_rows} document(s) (rows marked !):")
    for step_id, error in failures.items():
        print(f"  {step_id}: {_cut(str(error), 200)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.attach is not None:
        return attach_run(args)
    docs = load_documents(args.limit)
    if not docs:
        print("error: no documents to process", file=sys.stderr)
        return 2
    corpus_index()  # build it now, not inside the first tool call
    _banner(docs)
    labeller = _labeller(args)
    outs: list[dict[str, Any]] = []
    failed_run: WorkflowFailed | None = None
    deadline_s = None if args.deadline_hours is None else args.deadline_hours * 3600
    try:
        with workflow("stdlib-docs", workflow_class="batch", trace_path=args.trace,
                      metadata={"example": "stdlib_docs", "documents": len(docs)},
                      deadline_s=deadline_s, detach=args.detach,
                      submit=args.dump_graph is None) as wf:
            outs = _record(docs, labeller)
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
    if args.detach:
        return write_handle(args, wf, docs, outs)
    rows = collect(docs, outs)
    _print_rows(docs, rows, args.width)
    if labeller is classify:
        moved, total = escalations(wf.trace)
        print(f"classify cascade {' -> '.join(CASCADE)} (confidence floor {MIN_CONFIDENCE}): "
              f"{moved}/{total} labels escalated to {CASCADE[-1]}")
    print(wf.report())
    print()
    print(f"trace: {wf.trace_path}")
    print(f"run id: {wf.run_id} ({wf.status})")
    if failed_run is not None:
        _print_failures(dict(wf.failures), rows)
        return 1
    return 0


# -- detached -----------------------------------------------------------------------------

def write_handle(args: argparse.Namespace, wf: Any, docs: list[Document],
                 outs: list[dict[str, Any]]) -> int:
    """Write a detached run's handle: its id, the proxy, and each document's step ids."""
    handle = {"run_id": wf.run_id, "base_url": wf.base_url, "limit": args.limit,
              "deadline_hours": args.deadline_hours,
              "documents": [{"module": doc.name,
                             **{stage: out[stage].step_id for stage in STAGES}}
                            for doc, out in zip(docs, outs, strict=True)]}
    path = Path(args.handle)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(handle, indent=1))
    deadline = ("no deadline" if args.deadline_hours is None
                else f"deadline {args.deadline_hours:g} h")
    print(f"detached run {wf.run_id}: {len(wf.nodes)} steps, {deadline}; the script may "
          f"exit now. Handle: {path}")
    print(f"follow it: python examples/stdlib_docs/pipeline.py --attach {path}  "
          f"(or `flowlift runs`, `flowlift result {wf.run_id}`)")
    return 0


class _Doc:
    """A run's outputs and failures (``GET /v1/workflows/{id}``), read by step id."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def value(self, step_id: str) -> Any:
        from flowlift.errors import StepFailed

        failures = self.doc.get("failures") or {}
        if step_id in failures:
            raise StepFailed(step_id, failures[step_id])
        outputs = self.doc.get("outputs") or {}
        if step_id not in outputs:
            raise StepFailed(step_id, "the step never ran")
        return outputs[step_id]


def tier_lines(doc: dict[str, Any], names: dict[str, str]) -> list[str]:
    """Per stage: the tiers that served its steps (from the run's ``spend``), then the
    cost against every step on the standard tier and the compiler's plan."""
    by_step = (doc.get("spend") or {}).get("by_step") or {}
    stages: dict[str, dict[str, int]] = {}
    for sid, name in names.items():
        tier = (by_step.get(sid) or {}).get("served") or ("client (@tool)" if name == "related"
                                                          else "unpriced")
        stages.setdefault(name, {}).setdefault(tier, 0)
        stages[name][tier] += 1
    lines = ["tier per step (served):"]
    for name, tiers in stages.items():
        lines.append(f"  {name:<10} " + ", ".join(f"{t} {n}" for t, n in tiers.items()))
    spend = doc.get("spend") or {}
    if spend.get("cost") is not None and spend.get("standard_cost"):
        lines.append(f"cost: {spend['cost']:.4f} against {spend['standard_cost']:.4f} with "
                     f"every step on standard ({spend['cost'] / spend['standard_cost']:.2f}x)")
    plan = (doc.get("report") or {}).get("tier_plan")
    if plan:
        lines.append(f"planned: {plan['by_tier']}, expected {plan['cost_ratio']:.2f}x of "
                     f"all-standard, watchdog risk {plan['watchdog_risk']:.1%}")
    return lines


def attach_run(args: argparse.Namespace) -> int:
    """``--attach HANDLE``: follow the run, serving its ``related`` tool steps here, then
    print its table, the tier per step and its cost against all-standard."""
    handle = json.loads(Path(args.attach).read_text())
    run_id, base_url = handle["run_id"], handle["base_url"]
    print(f"attaching to {run_id} at {base_url} (running its @tool steps here)", flush=True)
    try:
        run = attach(run_id, base_url=base_url, tools=[related])
        status = run.status
    except WorkflowFailed:
        status = "failed"
    except (ProxyUnavailable, FlowliftError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    doc = httpx.get(f"{base_url}/v1/workflows/{run_id}", timeout=60).json()
    by_name = {d.name: d for d in load_documents()}
    docs = [by_name[d["module"]] for d in handle["documents"]]
    reader = _Doc(doc)
    outs = [{"facts": StepOutput(reader, d["facts"], ModuleFacts.model_validate),
             **{stage: StepOutput(reader, d[stage]) for stage in STAGES[1:]}}
            for d in handle["documents"]]
    rows = collect(docs, outs)
    _print_rows(docs, rows, args.width)
    names = {d[stage]: name for d in handle["documents"]
             for stage, name in zip(STAGES, ("extract", "classify", "related", "summarize"),
                                    strict=True)}
    print("\n".join(tier_lines(doc, names)))
    print(f"run id: {run_id} ({status})")
    if doc.get("failures"):
        _print_failures(doc["failures"], rows)
        return 1
    return 0


if __name__ == "__main__":
    from flowlift.tracing import configure_tracing

    # the app's own spans (OTLP if OTEL_EXPORTER_OTLP_ENDPOINT is set), in one trace with
    # the proxy's: `flowlift run` has the proxy write its spans to runs/traces/spans.jsonl
    configure_tracing("stdlib-docs", jsonl_path="runs/stdlib_docs.spans.jsonl")
    sys.exit(main())
