"""A drop-in request's one decision, local or upstream, made once at its route (the way
:mod:`.steps` decides a workflow step's backend): a route whose backends are all
embedded is answered on the embedded engine without entering the upstream forwarder
(:mod:`.upstream.forward`); any other route goes there, which chooses per attempt."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from flowlift.proxy.dispatch.backends import Backends, Local
from flowlift.proxy.dispatch.routing.routing import Route

EmbeddedCall = Callable[[Local], Awaitable[web.StreamResponse]]
"""Answers a request on the embedded backend the route chose (taking its slots)."""


def choose_local(backends: Backends, route: Route, affinity: str | None) -> Local | None:
    """The embedded backend to answer on when ``route`` has nothing but embedded backends
    (among several, the route's strategy chooses, as the forwarder's first attempt
    would); None when the route has an upstream.

    Raises:
        Overloaded: the embedded backend's queue is full (429 with ``Retry-After``), as
            the forwarder would answer.
    """
    if not route.backends or any(backends.local(n) is None for n in route.backends):
        return None
    local = backends.local(backends.choose(route, affinity, set()))
    assert local is not None  # (every backend of the route is embedded)
    return local


async def serve_local(target: Local, call: EmbeddedCall) -> web.StreamResponse:
    """``call(target)``, counted in the backend's admitted requests while it runs (from
    the choice on, with no await between: a simultaneous burst cannot slip past
    ``max_queue``)."""
    backend = target.backend
    backend.admitted += 1
    try:
        return await call(target)
    finally:
        backend.admitted -= 1
