"""Runs from the command line: find them, read them, cancel them, export them.

* ``flowlift runs [--state S] [--name N] [--limit N]`` -- recent runs, newest first
  (``GET /v1/workflows``): state, start, duration, progress (steps done of all, failed),
  deadline (time left on a running run's clock, else its budget) and spend so far (the
  answers priced at the tier that served each, against all-standard).
* ``flowlift show RUN_ID`` -- status, outputs and failures with their reason.
* ``flowlift cancel RUN_ID`` -- cancel a running run (``DELETE /v1/workflows/{id}``).
* ``flowlift export RUN_ID --format jsonl|csv`` -- one row per step: its output (or
  error) and its resolved prompt, the messages its model actually received.
* ``flowlift result RUN_ID [-o FILE]`` -- the run's outputs as one JSON document
  ``{"run_id", "status", "outputs": {step_id: value}, "failures": {step_id: reason}}``
  (a detached run's results, :mod:`flowlift.sdk.detached`); exit status 1 while it is
  still running or when it did not succeed (the document is written all the same).

``runs``, ``show``, ``export``, ``result`` (and ``flowlift trace``) read the proxy's state database
directly when no proxy answers at ``--base-url``: ``--state-db PATH``, else the first of
``runs/state.sqlite`` (what ``flowlift run`` starts its proxy with) and
``$FLOWLIFT_CACHE_DIR/state.sqlite`` (``flowlift serve``'s default) that exists.
Exit status: 0, 1 when the run is unknown or the proxy refused, 2 when neither a proxy nor
a state database answers.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from flowlift.credentials import CLI_HINT, add_api_key_argument, bearer_headers, cli_key

if TYPE_CHECKING:  # imported where used: the CLI's help loads no proxy code
    from flowlift.proxy.store.base import RunStoreProtocol

Command = Callable[[argparse.Namespace], int]

RUN_LOG_STATE_DB = Path("runs") / "state.sqlite"
PREVIEW_CHARS = 200
EXPORT_FIELDS = ("run_id", "step_id", "name", "kind", "model", "status", "output", "error",
                 "rejected_output", "prompt", "prompt_tokens", "completion_tokens", "attempts")


class CommandFailed(Exception):
    """What a run command prints before exiting with ``status`` (1 or 2)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.message, self.status = message, status


# -- where a run is read from -----------------------------------------------------------
def state_db_path(given: str | None) -> Path | None:
    """The state database to read offline: ``given``, else the first default that exists
    (see the module docstring); None when there is none."""
    if given:
        return Path(given)
    from flowlift.local_engine.models import cache_dir

    return next((p for p in (RUN_LOG_STATE_DB, cache_dir() / "state.sqlite") if p.is_file()),
                None)


def _ask(args: argparse.Namespace, method: str, path: str,
         params: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The proxy's JSON answer, or None when no proxy answers at ``--base-url``.

    Raises:
        CommandFailed: the proxy answered with an error (its message), or without JSON.
    """
    base = args.base_url.rstrip("/")
    try:
        r = httpx.request(method, f"{base}{path}", params=params, timeout=60,
                          headers=bearer_headers(cli_key(args)))
    except httpx.HTTPError:
        return None
    try:
        doc = r.json()
    except ValueError:
        raise CommandFailed(f"{base} answered HTTP {r.status_code} without JSON") from None
    if r.status_code != 200:
        message = (doc.get("error") or {}).get("message") or f"HTTP {r.status_code}"
        raise CommandFailed(message + (f" ({CLI_HINT})" if r.status_code == 401 else ""))
    return dict(doc)


def _offline(args: argparse.Namespace) -> RunStoreProtocol:
    """The run store of the state database (a file, or a ``postgresql://`` URL), opened
    for reading.

    Raises:
        CommandFailed: (status 2) no proxy answered and there is no state database, or
            the database cannot be reached.
    """
    given = getattr(args, "state_db", None)
    if given and "://" in given:
        from flowlift.errors import EngineError
        from flowlift.proxy.store.location import open_store

        print(f"flowlift: no proxy answers at {args.base_url}; reading the database",
              file=sys.stderr)
        try:
            return open_store(given)
        except EngineError as exc:
            raise CommandFailed(f"no proxy answers at {args.base_url} and {exc}",
                                status=2) from exc
    path = state_db_path(given)
    if path is None or not path.is_file():
        where = f" and {path} does not exist" if path else \
            " and no state database was found (give --state-db)"
        raise CommandFailed(f"no proxy answers at {args.base_url}{where}", status=2)
    from flowlift.proxy.store.sqlite import SQLiteRunStore

    print(f"flowlift: no proxy answers at {args.base_url}; reading {path}", file=sys.stderr)
    return SQLiteRunStore(path)


def offline_run(store: RunStoreProtocol, run_id: str) -> dict[str, Any]:
    """A run read from the state database, shaped as ``GET /v1/workflows/{id}``'s answer
    (without the compiler's report).

    Raises:
        CommandFailed: the database has no such run.
    """
    from flowlift.proxy.workflows.replay import trace_records

    stored = store.load(run_id)
    if stored is None:
        raise CommandFailed(f"no workflow run {run_id!r} in {store.path}")
    return {"run_id": run_id, "name": stored.graph.get("name"), "status": stored.status,
            "outputs": stored.outputs(), "failures": stored.failures(),
            "trace": trace_records(run_id, stored.graph, stored.events),
            "prompts": stored.prompts(), "report": None}


def fetch_run(args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    """``GET /v1/workflows/{run_id}`` from the proxy, else from the state database.

    Raises:
        CommandFailed: unknown run, refused request, or nothing to read from.
    """
    doc = _ask(args, "GET", f"/v1/workflows/{run_id}")
    return doc if doc is not None else offline_run(_offline(args), run_id)


# -- the commands ------------------------------------------------------------------------
def _when(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch_s))


def _preview(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "..."


def _offline_items(store: RunStoreProtocol, args: argparse.Namespace
                   ) -> tuple[list[dict[str, Any]], bool]:
    """``GET /v1/workflows``' items read from the state database (with each run's
    progress, deadline and spend from its event log)."""
    from flowlift.proxy.workflows.progress import stored_listing

    runs, more = store.recent(status=args.state, name=args.name, limit=args.limit)
    items = []
    for r in runs:
        stored = store.load(r.run_id)
        items.append({**r.to_json(), **(stored_listing(stored) if stored else {})})
    return items, more


def _duration(seconds: float) -> str:
    """``42 s``, ``12 min``, ``5.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def runs_row(r: dict[str, Any]) -> str:
    """One line of ``flowlift runs``: id, name, status, start (UTC), duration, progress
    (done/steps, failed), deadline (time left while it runs, else the budget), spend
    so far (and against all-standard)."""
    took = "" if r["status"] == "running" else f"{r['updated_at'] - r['created_at']:.1f} s"
    steps = r.get("steps")
    progress = "" if steps is None else f"{r.get('done', 0)}/{steps}" + (
        f" ({r['failed']} failed)" if r.get("failed") else "")
    deadline = ""
    if r.get("deadline_left_s") is not None:
        deadline = f"{_duration(r['deadline_left_s'])} left"
    elif r.get("deadline_s") is not None:
        deadline = _duration(r["deadline_s"])
    spent = ""
    if r.get("spent") is not None:
        spent = f"{r['spent']:.4f}"
        if r.get("standard_cost"):
            spent += f" ({r['spent'] / r['standard_cost']:.2f}x std)"
    return (f"{r['id']:<24} {r['name'][:20]:<20} {r['status']:<10} "
            f"{_when(r['created_at'])}  {took:>9}  {progress:<14} {deadline:<12} "
            f"{spent}").rstrip()


def cmd_runs(args: argparse.Namespace) -> int:
    """Print recent runs (:func:`runs_row`)."""
    query = {k: v for k, v in (("state", args.state), ("name", args.name),
                               ("limit", args.limit)) if v is not None}
    doc = _ask(args, "GET", "/v1/workflows", query)
    if doc is None:
        items, has_more = _offline_items(_offline(args), args)
    else:
        items, has_more = doc["data"], doc["has_more"]
    if args.json:
        print(json.dumps({"data": items, "has_more": has_more}, indent=2))
        return 0
    if not items:
        print("no runs", file=sys.stderr)
        return 0
    print(f"{'RUN':<24} {'NAME':<20} {'STATUS':<10} {'STARTED (UTC)':<19}  {'TOOK':>9}  "
          f"{'PROGRESS':<14} {'DEADLINE':<12} SPENT")
    for r in items:
        print(runs_row(r))
    if has_more:
        print(f"(more: --limit above {len(items)})", file=sys.stderr)
    return 0


def show_text(doc: dict[str, Any]) -> str:
    """``flowlift show``'s text: a status line, the ``@tool`` steps waiting for a client,
    the outputs, the failures with reasons."""
    from flowlift.tracing.summary import stage_summary

    head: dict[str, Any] = next((r for r in doc.get("trace") or [] if r.get("type") == "run"),
                                {})
    tokens = stage_summary(doc.get("trace") or [])["tokens"]
    wall = head.get("wall_ms")
    lines = [f"run {doc['run_id']} ({doc.get('name') or head.get('name') or 'workflow'}): "
             f"{doc.get('status')}" + (f" in {wall / 1000:.2f} s" if wall is not None else ""),
             f"tokens: {tokens['prompt']} prompt ({tokens['cached']} cached), "
             f"{tokens['completion']} generated"]
    outputs, failures = doc.get("outputs") or {}, doc.get("failures") or {}
    waiting = [r["step_id"] for r in doc.get("trace") or []
               if r.get("type") == "step" and r.get("status") == "waiting_tool"]
    if waiting:  # e.g. a detached run's @tool steps: they need a script with the functions
        lines.append("waiting for a client to run @tool steps: " + ", ".join(waiting))
    if outputs:
        lines.append(f"outputs ({len(outputs)}):")
        lines += [f"  {sid}: {_preview(value)}" for sid, value in outputs.items()]
    if failures:
        lines.append(f"failures ({len(failures)}):")
        rejected = {r["step_id"]: out for r in doc.get("trace") or []
                    if r.get("type") == "step" and (out := rejected_output(r)) is not None}
        for sid, reason in failures.items():
            lines.append(f"  {sid}: {reason}")
            if sid in rejected:
                lines.append(f"    last rejected output: {_preview(rejected[sid])}")
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    doc = fetch_run(args, args.run_id)
    print(json.dumps(doc, indent=2) if args.json else show_text(doc))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    doc = _ask(args, "DELETE", f"/v1/workflows/{args.run_id}")
    if doc is None:
        raise CommandFailed(f"no proxy answers at {args.base_url} (a run is cancelled by the "
                            "proxy running it)", status=2)
    print(f"run {args.run_id}: " + ("cancelled" if doc.get("cancelled") else
                                    "had already finished"))
    return 0


def rejected_output(record: dict[str, Any]) -> str | None:
    """The last output a step's contract rejected (bounded, as the trace keeps it), or
    None: what a failed step's ``output: null`` leaves out."""
    kept = [a["output"] for a in record.get("attempts") or [] if a.get("output") is not None]
    return kept[-1] if kept else None


def export_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per step of a run (``GET /v1/workflows/{id}``'s answer), in trace order:
    :data:`EXPORT_FIELDS`; ``prompt`` is the list of messages the model received (None
    for steps that are not llm steps or never ran); ``rejected_output``: the last output
    its contract rejected (:func:`rejected_output`)."""
    outputs, failures = doc.get("outputs") or {}, doc.get("failures") or {}
    prompts = doc.get("prompts") or {}
    rows = []
    for rec in doc.get("trace") or []:
        if rec.get("type") != "step":
            continue
        sid = rec["step_id"]
        rows.append({"run_id": doc["run_id"], "step_id": sid, "name": rec.get("name"),
                     "kind": rec.get("kind"), "model": rec.get("model"),
                     "status": rec.get("status"), "output": outputs.get(sid),
                     "error": failures.get(sid), "rejected_output": rejected_output(rec),
                     "prompt": prompts.get(sid),
                     "prompt_tokens": rec.get("prompt_tokens", 0),
                     "completion_tokens": rec.get("completion_tokens", 0),
                     "attempts": len(rec.get("attempts") or [])})
    return rows


def export_text(rows: list[dict[str, Any]], fmt: str) -> str:
    """``rows`` as JSON lines, or CSV (outputs that are not text as JSON; the prompt as
    ``role: content`` lines)."""
    if fmt == "jsonl":
        return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=EXPORT_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        out = row["output"]
        writer.writerow({**row, "output": out if isinstance(out, str) or out is None
                         else json.dumps(out, ensure_ascii=False),
                         "prompt": "\n".join(f"{m['role']}: {m['content']}"
                                             for m in row["prompt"] or [])})
    return buf.getvalue()


def cmd_export(args: argparse.Namespace) -> int:
    text = export_text(export_rows(fetch_run(args, args.run_id)), args.format)
    if args.output and args.output != "-":
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"flowlift: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def result_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """``flowlift result``'s document from a run (``GET /v1/workflows/{id}``'s answer)."""
    return {"run_id": doc["run_id"], "status": doc.get("status"),
            "outputs": doc.get("outputs") or {}, "failures": doc.get("failures") or {}}


def cmd_result(args: argparse.Namespace) -> int:
    doc = result_doc(fetch_run(args, args.run_id))
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    if args.output and args.output != "-":
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"flowlift: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if doc["status"] != "succeeded":
        print(f"flowlift result: run {args.run_id} did not succeed (status: {doc['status']})",
              file=sys.stderr)
        return 1
    return 0


def guarded(command: Command) -> Command:
    """``command`` with :class:`CommandFailed` printed (``flowlift NAME: message``) and
    turned into its exit status."""
    def run(args: argparse.Namespace) -> int:
        try:
            return int(command(args))
        except CommandFailed as exc:
            print(f"flowlift {args.command}: {exc.message}", file=sys.stderr)
            return exc.status

    return run


def add_common(p: argparse.ArgumentParser, default_base_url: str, *,
               offline: bool = True) -> None:
    """``--base-url``, ``--api-key`` and (``offline``) ``--state-db`` on a run command."""
    p.add_argument("--base-url", default=os.environ.get("FLOWLIFT_BASE_URL", default_base_url),
                   help="the proxy to ask (default $FLOWLIFT_BASE_URL, else %(default)s)")
    add_api_key_argument(p)
    if offline:
        p.add_argument("--state-db", default=None, metavar="PATH",
                       help="when no proxy answers, read this state database (default: "
                            f"{RUN_LOG_STATE_DB} or $FLOWLIFT_CACHE_DIR/state.sqlite, the "
                            "first that exists)")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                default_base_url: str) -> None:
    """Register ``runs``, ``show``, ``cancel``, ``export`` and ``result`` on the CLI's
    subcommands."""
    p = sub.add_parser("runs", help="recent workflow runs, newest first")
    p.add_argument("--state", choices=("running", "succeeded", "failed", "cancelled"),
                   default=None, help="only runs in this state")
    p.add_argument("--name", default=None, help="only runs of the workflow with this name")
    p.add_argument("--limit", type=_limit, default=20, help="how many (1-100, default 20)")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_common(p, default_base_url)
    p.set_defaults(func=guarded(cmd_runs))

    p = sub.add_parser("show", help="a run's status, outputs and failures with reasons")
    p.add_argument("run_id", help="the run's id (wf-...)")
    p.add_argument("--json", action="store_true", help="print the whole run as JSON")
    add_common(p, default_base_url)
    p.set_defaults(func=guarded(cmd_show))

    p = sub.add_parser("cancel", help="cancel a running run")
    p.add_argument("run_id", help="the run's id (wf-...)")
    add_common(p, default_base_url, offline=False)
    p.set_defaults(func=guarded(cmd_cancel))

    p = sub.add_parser("export", help="a run's outputs with each step's resolved prompt")
    p.add_argument("run_id", help="the run's id (wf-...)")
    p.add_argument("--format", choices=("jsonl", "csv"), default="jsonl",
                   help="jsonl (default): one JSON object per step; csv: one row per step")
    p.add_argument("--output", "-o", default=None, metavar="FILE",
                   help="write here instead of stdout")
    add_common(p, default_base_url)
    p.set_defaults(func=guarded(cmd_export))

    p = sub.add_parser("result", help="a run's outputs as JSON (e.g. a detached run's)")
    p.add_argument("run_id", help="the run's id (wf-...)")
    p.add_argument("--output", "-o", default=None, metavar="FILE",
                   help="write here instead of stdout")
    add_common(p, default_base_url)
    p.set_defaults(func=guarded(cmd_result))


def _limit(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 100, not {text!r}")
    return int(text)
