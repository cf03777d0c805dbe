"""``GET /v1/sessions/{id}``: what an agent session's turns reused from the prefix cache.

The body (``object: "flowlift.session"``) has the backend the session sticks to, totals
(prompt, cached and reusable tokens, ``reuse_ratio`` = cached / reusable) and, per kept
turn, the prompt, completion and cached tokens, ``reusable_tokens`` (the previous turn's
prompt plus answer), ``previous_answer_cached_tokens`` (how much of the previous answer
the cache served: case W5) and the turn's ``reuse_ratio``. An unknown or expired id is
a 404.

:func:`setup` installs the route and the table
(:class:`~flowlift.proxy.sessions.table.SessionTable`) on an app before it starts.
"""

from __future__ import annotations

from aiohttp import web

from flowlift.errors import RequestError
from flowlift.proxy.sessions.table import SESSIONS, SessionTable
from flowlift.proxy.tenants import tenant_of

__all__ = ["routes", "setup"]

routes = web.RouteTableDef()


def setup(app: web.Application, table: SessionTable | None = None) -> SessionTable:
    """Give ``app`` a session table (default bounds unless ``table`` is given) and the
    ``GET /v1/sessions/{id}`` route.

    Returns:
        The table the app records sessions into.
    """
    installed = SESSIONS in app
    if table is not None or not installed:
        app[SESSIONS] = table if table is not None else SessionTable()
    if not installed:  # create_app installs it; a test may swap in its own table
        app.add_routes(routes)
    return app[SESSIONS]


@routes.get("/v1/sessions/{session_id}")
async def get_session(request: web.Request) -> web.Response:
    """A session's per-turn token accounting.

    Raises:
        RequestError: 404 (``code="session_not_found"``): no live session with this
            id (never seen, expired, or another tenant's: the same answer).
    """
    session_id = request.match_info["session_id"]
    table = request.app.get(SESSIONS)
    session = table.get(session_id, tenant_of(request)) if table is not None else None
    if session is None:
        err = RequestError(f"no session {session_id!r}: sessions are created by requests with "
                       "an `X-Flowlift-Session` header and expire after "
                       f"{table.ttl_s if table is not None else 0:.0f} s without a turn",
                       param="session_id")
        err.status, err.code = 404, "session_not_found"
        raise err
    return web.json_response(session.to_json())
