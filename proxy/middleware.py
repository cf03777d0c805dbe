"""The proxy's one middleware, and the path sets its steps treat apart.

:func:`proxy_stack` is the whole stack, outermost first, in one coroutine per request
(starlette builds its stack once too; here each step is a plain call, where a
middleware each would add a coroutine and a frame to every request): request tracing
(:class:`flowlift.proxy.telemetry.requests.RequestTracing`), the OpenAI error shape
(:func:`~flowlift.proxy.http.error_answer`), :func:`require_key`,
:func:`readiness_gate`.

The paths each one lets through are declared here, once:

* :data:`PROBES` -- ``/healthz`` and ``/readyz``: never gated, never counted in flight.
* :data:`UNAUTHENTICATED` -- the probes and ``/metrics``: no API key asked.
* :data:`SERVED_WHILE_LOADING` -- what answers before the engines are loaded (or after
  they failed to load): the unauthenticated paths, the model list and the compile report.
* :data:`STARTS_WORK` -- POSTs that start work: refused while the proxy drains.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from flowlift.errors import AuthenticationError, EngineError, Overloaded, ShuttingDown
from flowlift.proxy.http import Handler, error_answer, error_response
from flowlift.proxy.lifecycle import DRAIN, Drain
from flowlift.proxy.state import STATE, ProxyState
from flowlift.proxy.telemetry.requests import RequestTracing
from flowlift.proxy.tenants import TENANT_KEY, run_key, tenant_of
from flowlift.proxy.workflows.registry import RunRegistry

PROBES = frozenset({"/healthz", "/readyz"})
UNAUTHENTICATED = PROBES | {"/metrics"}
SERVED_WHILE_LOADING = UNAUTHENTICATED | {"/v1/models", "/v1/workflows:compile"}
STARTS_WORK = frozenset({"/v1/workflows", "/v1/chat/completions", "/v1/completions",
                         "/v1/embeddings", "/v1/responses"})
RETRY_AFTER_S = 5
"""``Retry-After`` (seconds) of a request refused while loading or draining."""


def require_key(request: web.Request) -> None:
    """Optional proxy API keys: ``Authorization: Bearer <key>`` on every path but
    :data:`UNAUTHENTICATED`. The key names the request's tenant (``request["tenant"]``,
    :mod:`flowlift.proxy.tenants`), whose request rate is then checked.

    Raises:
        AuthenticationError: keys are configured and the request has none of them (401).
        Overloaded: the tenant is over its ``requests_per_s`` (429, ``Retry-After``).
    """
    tenants = request.app[STATE].tenants
    if tenants and request.path not in UNAUTHENTICATED:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        tenant = tenants.by_key(token.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise AuthenticationError("missing or invalid API key: send the proxy's key as "
                                      "`Authorization: Bearer <key>`", param="Authorization")
        request[TENANT_KEY] = tenant.name
        wait_s = tenants.admit(tenant)
        if wait_s is not None:
            raise Overloaded(f"tenant {tenant.name!r} is over its rate of "
                             f"{tenant.requests_per_s:g} requests/s; retry after "
                             f"{wait_s:.2f} s", retry_after_s=wait_s, status=429)


def _follows_running_run(request: web.Request, runs: RunRegistry) -> bool:
    parts = request.path.split("/")  # ["", "v1", "workflows", run_id, "events"]
    if (len(parts) != 5 or parts[4] != "events"
            or run_key(tenant_of(request), parts[3]) not in runs.active):
        return False
    # another tenant's run is refused like an unknown one (no answer tells them apart)
    return runs.live(parts[3], tenant_of(request)) is not None


def _refused_while_draining(request: web.Request, state: ProxyState) -> bool:
    """Does this request start work (or wait on a run that will not run here any more)?

    Everything else -- status, event streams of running runs, tool results, cancels,
    model lists, compile reports -- is still served while draining.
    """
    if request.method == "POST" and request.path in STARTS_WORK:
        return True
    if request.method == "GET" and request.path.endswith("/events"):
        return not _follows_running_run(request, state.runs)
    return False


def readiness_gate(request: web.Request) -> web.Response | Drain | None:
    """The one readiness gate: 503 with ``Retry-After`` while the engines load (or after
    they failed to load) except on :data:`SERVED_WHILE_LOADING`, and, while the proxy
    drains (:mod:`flowlift.proxy.lifecycle`), on new work; counts requests in flight
    (probes not counted) for the drain.

    Returns:
        The refusal to send; or the drain the request is now counted in (its
        ``in_flight`` goes down when the request is done); or None, a probe.
    """
    if request.path in PROBES:
        return None
    state: ProxyState = request.app[STATE]
    if not state.ready.is_set() and request.path not in SERVED_WHILE_LOADING:
        why = state.load_error or "the engine is still loading"
        return error_response(EngineError(f"not ready: {why}"),
                              headers={"Retry-After": str(RETRY_AFTER_S)})
    drain = request.app[DRAIN]
    if drain.draining and _refused_while_draining(request, state):
        return error_response(ShuttingDown(
            "the proxy is shutting down and takes no new work; retry (another replica, or "
            "this one after its restart)", retry_after_s=RETRY_AFTER_S))
    drain.in_flight += 1
    return drain


def proxy_stack(tracing: RequestTracing) -> Any:
    """The proxy's middleware (see the module doc): each request traced (OpenAI API
    requests, refused ones too), every failure answered in the OpenAI error shape,
    API keys checked, the readiness gate passed, then the handler."""
    @web.middleware
    async def stack(request: web.Request, handler: Handler) -> web.StreamResponse:
        rt = tracing.begin(request)
        status: int | None = None
        error: BaseException | None = None
        try:
            try:
                require_key(request)
                admitted = readiness_gate(request)
                if isinstance(admitted, web.Response):
                    response: web.StreamResponse = admitted
                else:
                    try:
                        response = await handler(request)
                    finally:
                        if admitted is not None:
                            admitted.in_flight -= 1
            except Exception as exc:  # every failure leaves in the OpenAI error shape
                response = error_answer(request, exc)
            status = response.status
            return response
        except BaseException as exc:  # cancelled (the client left), or a redirect
            error = exc
            raise
        finally:
            if rt is not None:
                tracing.end(request, rt, status, error)
    return stack
