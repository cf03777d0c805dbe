"""``flowlift compile GRAPH.json | WORKFLOW.py | --run RUN_ID``: the compiler's report
(``--json`` for machines); asks the proxy when one answers (measured costs, real
tokenizer), else compiles locally. Where the graph comes from: :mod:`flowlift.cli.sources`
(a script is recorded without running a step)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from flowlift.credentials import CLI_HINT, add_api_key_argument, bearer_headers, cli_key
from flowlift.sdk.workflow import DEFAULT_BASE_URL

if TYPE_CHECKING:
    from flowlift.compiler import CompileOptions
    from flowlift.graph import Graph
    from flowlift.report import CompileReport


def cmd_compile(args: argparse.Namespace) -> int:
    """``flowlift compile``: each graph's report on stdout (one JSON document, or a list
    of them for a script that opened several workflows, with ``--json``)."""
    from flowlift.cli.runs import CommandFailed
    from flowlift.cli.sources import graph_documents

    try:
        docs = graph_documents(args)
    except CommandFailed as exc:
        print(f"flowlift compile: {exc.message}", file=sys.stderr)
        return exc.status
    reports = []
    for doc in docs:
        report = _report(args, doc)
        if report is None:
            return 1
        reports.append(report)
    if args.json:
        print(reports[0].model_dump_json(indent=2) if len(reports) == 1 else json.dumps(
            [r.model_dump(mode="json") for r in reports], indent=2, ensure_ascii=False))
        return 0
    from flowlift.report import format_report

    for doc, report in zip(docs, reports, strict=True):
        if len(docs) > 1:
            print(f"== workflow {doc.get('name')!r} ==")
        print(format_report(report))
    return 0


def _report(args: argparse.Namespace, doc: dict[str, Any]) -> CompileReport | None:
    """The compiler's report of one graph document: the proxy's (unless ``--local``),
    else compiled here; None after printing why it failed."""
    from flowlift.compiler import compile_graph
    from flowlift.dataflow import validate
    from flowlift.errors import GraphError
    from flowlift.graph import Graph
    from flowlift.report import CompileReport

    if not args.local:
        try:
            r = httpx.post(f"{args.base_url.rstrip('/')}/v1/workflows:compile", json=doc,
                           timeout=120, headers=bearer_headers(cli_key(args)))
        except httpx.HTTPError:
            print(f"flowlift compile: no proxy at {args.base_url}; compiling locally with "
                  "default cost figures and an approximate tokenizer", file=sys.stderr)
            args.local = True  # said once: the next graph compiles here too
        else:
            if r.status_code != 200:
                err = r.json().get("error", {})
                for problem in err.get("problems") or [err.get("message", r.text)]:
                    print(f"flowlift compile: {problem}", file=sys.stderr)
                if r.status_code == 401:
                    print(f"flowlift compile: {CLI_HINT}, or compile with --local",
                          file=sys.stderr)
                return None
            return CompileReport.model_validate(r.json())
    try:
        graph = Graph.model_validate(doc)
        validate(graph)
        opts = _local_compile_options(args)
    except (GraphError, ValueError) as exc:
        print(f"flowlift compile: {exc}", file=sys.stderr)
        return None
    _warn_unused_prices(graph, args.price, opts.default_model)
    return compile_graph(graph, opts).report


def _warn_unused_prices(graph: Graph, prices: list[str], default_model: str) -> None:
    """A warning line on stderr for each ``--price`` of a model no step of ``graph`` uses."""
    from flowlift.graph import LLMNode

    used = {m or default_model for n in graph.nodes if isinstance(n, LLMNode)
            for m in n.models()}
    for item in prices:
        name = item.partition("=")[0]
        if name not in used:
            print(f"flowlift compile: warning: --price {item}: the graph uses no model "
                  f"{name!r} (it uses {', '.join(sorted(used)) or 'none'}); ignored",
                  file=sys.stderr)


def _local_compile_options(args: argparse.Namespace) -> CompileOptions:
    """Prices from ``--price MODEL=PRICE``; failure rates from the state database.

    Raises:
        ValueError: a ``--price`` that is not ``MODEL=NUMBER``.
    """
    from flowlift.compiler import CompileOptions
    from flowlift.local_engine.models import cache_dir

    prices: dict[str, float] = {}
    for item in args.price:
        name, _, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not name or not price >= 0:  # also NaN
            raise ValueError(f"--price {item!r}: write MODEL=PRICE, e.g. --price large=0.6")
        prices[name] = price
    opts = CompileOptions(price=prices.get)
    db = args.state_db or cache_dir() / "state.sqlite"
    if "://" in str(db) or Path(db).is_file():
        from dataclasses import replace

        from flowlift.proxy.store.outcomes import StepOutcomes

        opts = replace(opts, outcomes=StepOutcomes(db).counts)
    return opts


def _price(text: str) -> str:
    """``MODEL=PRICE`` as given (parsed by :func:`_local_compile_options`)."""
    name, _, value = text.partition("=")
    try:
        price = float(value)
    except ValueError:
        price = -1.0
    if not name or not 0 <= price < float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"{text!r}: write MODEL=PRICE with PRICE a number "
                                         ">= 0, e.g. --price large=0.6")
    return text


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``compile`` subcommand."""
    comp = sub.add_parser("compile", help="the compiler's report for a graph (a JSON file, "
                          "a workflow script, or a run's)")
    comp.add_argument("graph", nargs="?", default=None, metavar="GRAPH.json|SCRIPT.py",
                      help="a graph document (see `workflow(..., submit=False)`), or a "
                           "Python script that uses `workflow(...)`: it runs with every "
                           "workflow only recorded (no step runs, no tool is called) until "
                           "it reads a step's value, and the graphs it recorded are compiled")
    comp.add_argument("script_args", nargs="*", metavar="-- ARG",
                      help="after `--`: arguments for the script (its sys.argv[1:])")
    comp.add_argument("--run", default=None, metavar="RUN_ID",
                      help="compile this run's recorded graph instead (from the proxy at "
                           "--base-url, else from --state-db)")
    comp.add_argument("--json", action="store_true", help="print the report as JSON")
    comp.add_argument("--base-url", default=os.environ.get("FLOWLIFT_BASE_URL",
                                                            DEFAULT_BASE_URL),
                      help="ask this proxy (its tokenizers and measured cost models)")
    add_api_key_argument(comp)
    comp.add_argument("--local", action="store_true", help="do not ask a proxy")
    comp.add_argument("--price", action="append", default=[], metavar="MODEL=PRICE",
                      type=_price,
                      help="local compiles: price per 1,000 tokens of MODEL (repeatable; "
                           "a proxy uses its config's price_per_1k_tokens)")
    comp.add_argument("--state-db", default=None,
                      help="local compiles: the state database whose learned failure "
                           "rates feed cascade estimates, and where --run reads a run when "
                           "no proxy answers (default $FLOWLIFT_CACHE_DIR/state.sqlite "
                           "when it exists)")
    comp.set_defaults(func=cmd_compile)
