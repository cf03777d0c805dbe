"""``flowlift trace RUN_ID``: a finished (or running) run's waterfall in the terminal.

Asks the proxy for ``GET /v1/workflows/{run_id}`` (its trace and compiler report) and
prints :func:`flowlift.tracing.waterfall.waterfall`; when no proxy answers, reads the run
from the state database (``--state-db``, see :mod:`flowlift.cli.runs`; no compiler report
then, so no planned critical path). Colours only on a terminal
(``--color auto``, the default; ``NO_COLOR`` set turns them off), so the output can be
piped or captured as plain text.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from flowlift.cli.runs import CommandFailed, fetch_run
from flowlift.credentials import add_api_key_argument
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
    """Print the waterfall; 1 when the proxy (or the state database) does not know the
    run, 2 with neither a proxy nor a state database."""
    base = args.base_url.rstrip("/")
    try:
        doc = fetch_run(args, args.run_id)
    except CommandFailed as exc:
        print(f"flowlift trace: {exc.message}", file=sys.stderr)
        return exc.status
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
    p.add_argument("--state-db", default=None, metavar="PATH",
                   help="when no proxy answers, read the run from this state database "
                        "(default: runs/state.sqlite or $FLOWLIFT_CACHE_DIR/state.sqlite)")
    p.add_argument("--width", type=_width, default=None,
                   help=f"columns of the bar, at least {MIN_WIDTH} (default: fit the "
                        "terminal; 60 when piped)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="ANSI colours (auto: only on a terminal)")
    p.set_defaults(func=cmd_trace)
