"""Where ``flowlift compile`` gets its graphs: a graph JSON file, a workflow script
recorded without running (:func:`flowlift.sdk.recording.record_script`), or a run's
recorded graph (``--run RUN_ID``: from the proxy, else from the state database).

Each source gives a list of graph documents (wire format, ``Graph.to_wire()``): a
script may open several workflows.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from flowlift.cli.runs import CommandFailed, _ask, _offline


def graph_documents(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The graphs ``flowlift compile`` was asked for (``args.graph`` a ``.json`` file or a
    ``.py`` script, or ``args.run``); notes on stderr say what a script's recording left
    out.

    Raises:
        CommandFailed: (status 2) nothing or both named, a file that cannot be read, a
            script that recorded no step; (status 1) a script that raised, an unknown run.
    """
    if (args.graph is None) == (args.run is None):
        raise CommandFailed("give a graph JSON file, a workflow script (.py) or --run "
                            "RUN_ID (one of them)", status=2)
    if args.run is not None:
        return [run_graph(args, args.run)]
    if args.graph.endswith(".py"):
        return script_graphs(args.graph, args.script_args)
    if args.script_args:
        raise CommandFailed(f"{args.graph}: arguments after the file are for a script "
                            f"(.py), not a graph document: {' '.join(args.script_args)}",
                            status=2)
    try:
        return [json.loads(Path(args.graph).read_text())]
    except (OSError, ValueError) as exc:
        raise CommandFailed(f"cannot read {args.graph}: {exc}", status=2) from exc


def script_graphs(path: str, argv: list[str]) -> list[dict[str, Any]]:
    """Run the script at ``path`` record-only and return each workflow's graph.

    Raises:
        CommandFailed: the script cannot be read or recorded no step (2), or it raised
            (1, its traceback printed on stderr).
    """
    from flowlift.sdk.recording import record_script

    try:
        recorded = record_script(path, argv)
    except OSError as exc:
        raise CommandFailed(f"cannot read {path}: {exc.strerror or exc}", status=2) from exc
    except Exception as exc:  # the script's own error: show it as Python would
        traceback.print_exception(exc, file=sys.stderr)
        raise CommandFailed(f"{path} raised {type(exc).__name__} while recording its "
                            "graph (above); nothing was compiled") from exc
    if recorded.stopped is not None:
        print(f"flowlift compile: {path}: recording stopped at {recorded.stopped}: the "
              "steps after it depend on a value only a run gives; compiling the steps "
              "recorded before it", file=sys.stderr)
    if not recorded.workflows:
        raise CommandFailed(f"{path} recorded no workflow step (does it call a @step inside "
                            "`with workflow(...)` when run as a script?)", status=2)
    return [wf.graph().to_wire() for wf in recorded.workflows]


def run_graph(args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    """Run ``run_id``'s graph as recorded (appended nodes included): from the proxy at
    ``--base-url`` (``GET /v1/workflows/{run_id}/graph``), else from the state database
    (``--state-db``; the compile is then local).

    Raises:
        CommandFailed: unknown run, a refused request, or nothing to read from.
    """
    doc = None if args.local else _ask(args, "GET", f"/v1/workflows/{run_id}/graph")
    if doc is not None:
        return doc
    from flowlift.proxy.workflows.open_runs import stored_graph

    store = _offline(args)
    stored = store.load(run_id)
    if stored is None:
        raise CommandFailed(f"no workflow run {run_id!r} in {store.path}")
    args.local = True  # no proxy answered: compile here
    return stored_graph(stored).to_wire()
