"""``flowlift trace RUN_ID``: a finished (or running) run's waterfall in the terminal.

Asks the proxy for ``GET /v1/workflows/{run_id}`` (its trace and compiler report) and
prints :func:`flowlift.tracing.waterfall.waterfall`. Colours only on a terminal
(``--color auto``, the default; ``NO_COLOR`` set turns them off), so the output can be
piped or captured as plain text.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import httpx

from flowlift.credentials import CLI_HINT, add_api_key_argument, bearer_headers, cli_key
from flowlift.tracing.timeline import report_deps
from flowlift.tracing.waterfall import waterfall

MIN_WIDTH = 20  # columns of the bar; fewer leave no room for a stage


def _width(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < MIN_WIDTH:
        raise argparse.ArgumentTypeError(f"must be a whole number of columns >= {MIN_WIDTH}, "
                                         f"not {text!r}")
    return value


def _use_color(choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def cmd_trace(args: argparse.Namespace) -> int:
    """Print the waterfall; 1 when the proxy does not know the run, 2 with no proxy."""
    base = args.base_url.rstrip("/")
    try:
        r = httpx.get(f"{base}/v1/workflows/{args.run_id}", timeout=60,
                      headers=bearer_headers(cli_key(args)))
    except httpx.HTTPError as exc:
        print(f"flowlift trace: no proxy answers at {base} ({type(exc).__name__})",
              file=sys.stderr)
        return 2
    try:
        doc = r.json()
    except ValueError:
        print(f"flowlift trace: {base} answered HTTP {r.status_code} without JSON",
              file=sys.stderr)
        return 1
    if r.status_code != 200:
        message = (doc.get("error") or {}).get("message") or f"HTTP {r.status_code}"
        if r.status_code == 401:
            message += f" ({CLI_HINT})"
        print(f"flowlift trace: {message}", file=sys.stderr)
        return 1
    if "trace" not in doc:
        print(f"flowlift trace: {args.run_id} is a workflow inferred from OpenAI traffic; it "
              f"has no stage timings (see {base}/v1/workflows/{args.run_id})", file=sys.stderr)
        return 1
    if not doc["trace"]:
        print(f"flowlift trace: run {args.run_id} ({doc.get('status')}) has no trace yet",
              file=sys.stderr)
        return 1
    report = doc.get("report") or {}
    width = args.width
    if width is None:
        width = max(MIN_WIDTH, min(100, shutil.get_terminal_size((110, 24)).columns - 52)) \
            if sys.stdout.isatty() else 60
    print(waterfall(doc["trace"], report_deps(report), report.get("critical_path", ()),
                    width=width, color=_use_color(args.color)))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               default_base_url: str) -> None:
    """Register ``flowlift trace`` on the CLI's subcommands."""
    p = sub.add_parser("trace", help="a run's waterfall: where its time went, by stage")
    p.add_argument("run_id", help="the run's id (wf-...), as printed by the SDK (wf.run_id)")
    p.add_argument("--base-url", default=os.environ.get("FLOWLIFT_BASE_URL", default_base_url),
                   help="the proxy that ran it")
    add_api_key_argument(p)
    p.add_argument("--width", type=_width, default=None,
                   help=f"columns of the bar, at least {MIN_WIDTH} (default: fit the "
                        "terminal; 60 when piped)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="ANSI colours (auto: only on a terminal)")
    p.set_defaults(func=cmd_trace)
