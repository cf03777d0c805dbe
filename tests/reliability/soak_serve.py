"""The soak's proxy process: ``flowlift serve`` itself, with a route that reports its tables.

Run by ``soak_long.py`` (never by hand)::

    python -m tests.reliability.soak_serve [--bound N] [--leak runs|fds] -- serve ...

Everything after ``--`` goes to :func:`flowlift.cli.main` unchanged: the proxy is the one
``flowlift serve`` builds. Before it starts, this module adds, to the app
:func:`flowlift.proxy.create_app` returns:

* ``GET /soak/tables`` (behind the proxy's keys like every route): the named tables, the
  live Python objects after a ``gc.collect()`` (and the 60 commonest types), the sizes of
  every container reachable from the app's keys (``test_soak.sizes``), as JSON -- what
  only the proxy's own process can see.
* the embedded ``FakeEngine``'s record of every request (a test double's log, which
  ``flowlift serve --engine fake`` keeps whole) bounded at the last 64.
* with ``--bound N`` (> 0): sessions, inferred workflows, finished runs in memory, stored
  runs, stored responses and each engine's programs (agent sessions scheduled) bounded
  at ``N`` instead of their defaults (1,024 to 10,000), so that a short soak fills every
  table.
* with ``--leak`` (the soak's negative check, never in a real run): ``runs`` keeps every
  finished run forever, ``fds`` opens ``/dev/null`` once per finished run and never closes
  it. A soak with either must fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from collections import Counter, deque
from typing import Any

from aiohttp import web
from cachetools import TTLCache

import flowlift.proxy
from flowlift.cli import main as flowlift_main
from flowlift.proxy.dispatch.slots.programs import ProgramBook
from flowlift.proxy.lifecycle import DRAIN
from flowlift.proxy.sessions.table import SESSIONS
from flowlift.proxy.state import STATE
from flowlift.proxy.telemetry.observer import TELEMETRY
from flowlift.proxy.workflows.inferred import InferredWorkflows
from flowlift.proxy.workflows.runs import Run
from flowlift.testing import FakeEngine
from tests.reliability.test_soak import sizes

LEAKED: list[Any] = []
"""What ``--leak`` keeps: finished runs, or open file descriptors."""


def _count_rows(db: Any) -> dict[str, int]:
    return {table: db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("runs", "events")}


async def tables(request: web.Request) -> web.Response:
    """``GET /soak/tables``: the tables, live objects and container sizes (see above)."""
    app = request.app
    state = app[STATE]
    store = state.runs.store
    rows = await state.runs.io.call(_count_rows, store._db) if hasattr(store, "_db") else {}
    gc.collect()
    objects = gc.get_objects()
    types = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
    return web.json_response({
        "objects": len(objects), "types": dict(types.most_common(60)),
        "tables": {"sessions": len(app[SESSIONS]), "inferred": len(state.inferred),
                   "runs.active": len(state.runs.active),
                   "runs.finished": len(state.runs.finished),
                   **{f"store.{k}": v for k, v in rows.items()},
                   "tenants.buckets": len(state.tenants._buckets),
                   "costs": len(state.costs.snapshot()), "leaked": len(LEAKED)},
        "walk": sizes({"state": state, "sessions": app[SESSIONS], "drain": app[DRAIN],
                       "telemetry": app[TELEMETRY]})})


def _leaky(runs: Any, kind: str) -> None:
    """Make ``runs.retire`` leak one thing per finished run (``--leak``)."""
    retire = runs.retire

    def leaking_retire(run: Run) -> None:
        if run.key in runs.active:  # (retire is called again for a retired run)
            LEAKED.append(run if kind == "runs" else os.open(os.devnull, os.O_RDONLY))
        retire(run)
    runs.retire = leaking_retire


def patch(bound: int, leak: str | None) -> None:
    """Wrap :func:`flowlift.proxy.create_app` as the module docstring says."""
    create_app = flowlift.proxy.create_app

    def soak_app(engines: Any, config: Any, **kwargs: Any) -> web.Application:
        if bound > 0:
            config = dataclasses.replace(config, max_sessions=bound, max_responses=bound)
        app = create_app(engines, config, **kwargs)
        state = app[STATE]
        for engine in engines.values():  # the test double's own log of every request
            if isinstance(engine, FakeEngine):
                engine.requests = deque(maxlen=64)  # type: ignore[assignment]
        if bound > 0:
            state.inferred = InferredWorkflows(max_workflows=bound)
            state.runs.finished = TTLCache(maxsize=bound, ttl=3600)
            state.runs.store_keep = bound
            for backend in state.backends.backends:  # each engine's program table
                book = backend.slots.programs
                backend.slots.programs = ProgramBook(
                    dataclasses.replace(book.config, max_programs=bound), book._timer)
        if leak is not None:
            _leaky(state.runs, leak)
        app.router.add_get("/soak/tables", tables)
        return app
    flowlift.proxy.create_app = soak_app  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bound", type=int, default=0)
    parser.add_argument("--leak", choices=("runs", "fds"), default=None)
    args = parser.parse_args(ours)
    patch(args.bound, args.leak)
    return flowlift_main(serve)


if __name__ == "__main__":
    sys.exit(main())
