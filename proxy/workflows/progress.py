"""``GET /v1/workflows/{run_id}/progress``: how far a run has got, in counts of steps.

Answer: ``{"run_id", "status", "steps", "counts": {"pending", "queued", "running",
"waiting_tool", "done", "failed", "skipped"}}``. ``pending`` steps wait for their inputs,
``queued`` ones for a backend slot, ``running`` ones are on an engine, ``waiting_tool``
ones are ``@tool`` steps out in the app; ``skipped`` ones were not taken (a ``when``
condition: :mod:`flowlift.proxy.workflows.conditions`). Small on purpose: the SDK's progress bar
(:mod:`flowlift.sdk.progress`) polls it while a run streams its events. A run only in
the store (finished before this proxy started) is counted from its event log.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web

from flowlift.proxy.state import STATE
from flowlift.proxy.store.base import StoredRun
from flowlift.proxy.tenants import tenant_of
from flowlift.proxy.workflows.fanout import EXPANDED, grown_ids
from flowlift.proxy.workflows.open_runs import APPENDED

routes = web.RouteTableDef()
STATUSES = ("pending", "queued", "running", "waiting_tool", "done", "failed", "skipped")


def spend(events: Iterable[tuple[int, str, dict[str, Any]]]) -> dict[str, Any]:
    """What a run has paid so far, from its ``step.cost`` events (each answer priced at
    the tier that served it: :mod:`flowlift.proxy.workflows.tiering`).

    Returns:
        ``{"cost", "standard_cost", "by_step": {step_id: {"asked", "served", "cost",
        "standard_cost"}}}``: ``cost`` the sum over priced answers (None when no answer
        was priced: a run without a tier plan, or unpriced backends), ``standard_cost``
        what the same tokens cost on the ``standard`` tier (None when not known). A step
        answered twice counts both: the watchdog's fast answer and its batch line that
        finished later anyway (a ``late`` event; the provider bills it).
    """
    by_step: dict[str, dict[str, Any]] = {}
    cost: float | None = None
    standard: float | None = None
    for _, name, data in events:
        if name != "step.cost":
            continue
        step = by_step.setdefault(str(data.get("step_id")), {
            "asked": None, "served": None, "cost": None, "standard_cost": None})
        step["asked"], step["served"] = data.get("asked"), data.get("served")
        for key, value in (("cost", data.get("cost")),
                           ("standard_cost", data.get("standard_cost"))):
            if isinstance(value, int | float):
                step[key] = (step[key] or 0.0) + value
        if isinstance(data.get("cost"), int | float):
            cost = (cost or 0.0) + data["cost"]
        if isinstance(data.get("standard_cost"), int | float):
            standard = (standard or 0.0) + data["standard_cost"]
    return {"cost": None if cost is None else round(cost, 8),
            "standard_cost": None if standard is None else round(standard, 8),
            "by_step": by_step}


def listing(steps: int, deadline_s: float | None,
            events: list[tuple[int, str, dict[str, Any]]],
            deadline_left_s: float | None = None) -> dict[str, Any]:
    """A run's progress, deadline and spend so far, for ``GET /v1/workflows``' items.

    Args:
        steps: how many steps the run has (an open run's appended ones included).
        deadline_s: its graph's deadline budget in seconds, or None.
        events: its event log.
        deadline_left_s: seconds left on a live run's deadline clock (it stops while a
            ``@tool`` step is out), None when not known (a stored run) or no deadline.

    Returns:
        ``{"steps", "done", "failed", "deadline_s", "deadline_left_s", "spent",
        "standard_cost"}`` (``spent``: :func:`spend`'s ``cost``).
    """
    done = {d.get("step_id") for _, n, d in events if n == "step.finished"}
    failed = {d.get("step_id") for _, n, d in events if n == "step.failed"}
    paid = spend(events)
    return {"steps": steps, "done": len(done), "failed": len(failed - done),
            "deadline_s": deadline_s,
            "deadline_left_s": None if deadline_left_s is None else round(deadline_left_s, 1),
            "spent": paid["cost"], "standard_cost": paid["standard_cost"]}


def stored_steps(stored: StoredRun) -> int:
    """How many steps a stored run has, counted as a live run's trace counts them: its
    graph's nodes, the nodes appended to it (an open run) and the steps its maps grew
    (each ``map.expanded``'s item steps and their inputs), each once (a resumed run
    expands a map again)."""
    ids = {n.get("id") for n in stored.graph.get("nodes") or ()}
    for _, name, data in stored.events:
        if name == APPENDED:
            ids.update(n.get("id") for n in data.get("nodes") or ())
        elif name == EXPANDED:
            ids.update(grown_ids(data.get("steps") or ()))
    return len(ids)


def stored_listing(stored: StoredRun) -> dict[str, Any]:
    """:func:`listing` of a run read from the store (its appended nodes and its maps'
    items counted: :func:`stored_steps`; no deadline clock to read)."""
    deadline = stored.graph.get("deadline_s")
    return listing(stored_steps(stored),
                   deadline if isinstance(deadline, int | float) else None, stored.events)


@routes.get("/v1/workflows/{run_id}/progress")
async def run_progress(request: web.Request) -> web.Response:
    runs = request.app[STATE].runs
    run_id = request.match_info["run_id"]
    tenant = tenant_of(request)  # another tenant's run: the 404 of an unknown one
    run = runs.live(run_id, tenant)
    counts = dict.fromkeys(STATUSES, 0)
    if run is not None:
        for st in run.trace.steps.values():
            counts[st.status if st.status in counts else "pending"] += 1
        status, steps = run.trace.status, len(run.trace.steps)
    else:
        stored = await runs.stored(run_id, tenant)  # RunNotFound (HTTP 404) when unknown
        steps = stored_steps(stored)
        counts["done"] = len(stored.outputs())
        counts["failed"] = len(stored.failures())
        counts["skipped"] = len(stored.skipped())
        counts["done"] -= len(set(stored.outputs()) & set(stored.skipped()))  # defaults
        counts["pending"] = max(0, steps - counts["done"] - counts["failed"]
                                - counts["skipped"])
        status = stored.status
    return web.json_response({"run_id": run_id, "status": status, "steps": steps,
                              "counts": counts})


def setup(app: web.Application) -> None:
    app.add_routes(routes)
