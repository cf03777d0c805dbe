"""``GET /v1/workflows/{run_id}/progress``: how far a run has got, in counts of steps.

Answer: ``{"run_id", "status", "steps", "counts": {"pending", "queued", "running",
"waiting_tool", "done", "failed"}}``. ``pending`` steps wait for their inputs,
``queued`` ones for a backend slot, ``running`` ones are on an engine, ``waiting_tool``
ones are ``@tool`` steps out in the app. Small on purpose: the SDK's progress bar
(:mod:`flowlift.sdk.progress`) polls it while a run streams its events. A run only in
the store (finished before this proxy started) is counted from its event log.
"""

from __future__ import annotations

from aiohttp import web

from flowlift.proxy.state import STATE
from flowlift.proxy.tenants import tenant_of

routes = web.RouteTableDef()
STATUSES = ("pending", "queued", "running", "waiting_tool", "done", "failed")


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
        stored = runs.stored(run_id, tenant)  # RunNotFound (HTTP 404) when unknown
        steps = len(stored.graph.get("nodes", []))
        counts["done"] = len(stored.outputs())
        counts["failed"] = len(stored.failures())
        counts["pending"] = max(0, steps - counts["done"] - counts["failed"])
        status = stored.status
    return web.json_response({"run_id": run_id, "status": status, "steps": steps,
                              "counts": counts})


def setup(app: web.Application) -> None:
    app.add_routes(routes)
