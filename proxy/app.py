"""The proxy application: one aiohttp app, state in ``app[STATE]``, no globals.

The server starts listening at once; the engines load in the background. Until they
are loaded ``/readyz`` answers 503 and model requests get 503 with ``Retry-After``,
so a sidecar's readiness probe (and ``flowlift run``) can wait on it.

Routes: ``/healthz``, ``/readyz``, the OpenAI-compatible API
(:mod:`flowlift.proxy.openai.routes`) and the workflow API (:mod:`flowlift.proxy.workflows.api`),
a run's progress (:mod:`flowlift.proxy.workflows.progress`) and the pages under ``/ui``
(:mod:`flowlift.proxy.ui.pages`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import httpx
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from flowlift.errors import ConfigError
from flowlift.local_engine.base import Engine
from flowlift.local_engine.residency import ResidencyManager
from flowlift.proxy import lifecycle
from flowlift.proxy.config import FileConfig, ProxyConfig, settings
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.settings import DispatchSettings
from flowlift.proxy.http import log
from flowlift.proxy.middleware import proxy_stack
from flowlift.proxy.openai import routes as openai_api
from flowlift.proxy.openai.responses import serving as responses_api
from flowlift.proxy.openai.responses.store import ResponseStore
from flowlift.proxy.sessions import api as sessions_api
from flowlift.proxy.sessions.table import SessionTable
from flowlift.proxy.state import STATE, ProxyState
from flowlift.proxy.store.location import open_store
from flowlift.proxy.store.outcomes import StepOutcomes
from flowlift.proxy.telemetry import observer as telemetry
from flowlift.proxy.tenants import Tenants
from flowlift.proxy.tools import ToolServers
from flowlift.proxy.ui import pages as ui
from flowlift.proxy.workflows import api as workflows
from flowlift.proxy.workflows import progress as progress_api
from flowlift.proxy.workflows.planning import compile_options
from flowlift.proxy.workflows.registry import RunRegistry


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def readyz(request: web.Request) -> web.Response:
    state: ProxyState = request.app[STATE]
    reason = await lifecycle.not_ready_reason(state, request.app[lifecycle.DRAIN])
    body = {"ready": reason is None, "models": state.backends.models,
            "load_time_s": state.load_time_s, "error": state.load_error, "reason": reason,
            "programs": {b.name: b.slots.programs.snapshot() for b in state.backends.backends
                         if b.slots.programs.enabled},
            "working_set": {b.name: b.slots.working.snapshot(b.slots.kv_capacity())
                            for b in state.backends.backends if b.slots.working.enabled}}
    plans = {b.name: plan for b in state.backends.backends
             if (plan := b.slots.plan_snapshot()) is not None}
    if plans:
        body["batch_plans"] = plans
    if state.residency is not None:
        body["residency"] = {"budget_mb": state.residency.budget_mb,
                             "resident": list(state.residency.resident),
                             "managed": sorted(state.residency.models),
                             "loads": dict(sorted(state.residency.loads.items())),
                             "unloads": dict(sorted(state.residency.unloads.items()))}
    return web.json_response(body, status=200 if reason is None else 503)


async def _load_engines(app: web.Application) -> None:
    state: ProxyState = app[STATE]
    t0 = time.monotonic()
    try:
        for engine in state.backends.engines:
            await engine.start()
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.exception("engine_load_failed")
        return
    state.load_time_s = round(time.monotonic() - t0, 2)
    await state.runs.resume_all(state.backends, state.costs)
    state.ready.set()
    log.info("engine_ready", models=state.backends.models, load_time_s=state.load_time_s)


async def _sweep(app: web.Application, every_s: float = 5.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        await app[STATE].runs.sweep()


async def _heartbeat(app: web.Application) -> None:
    """On a shared store: renew this proxy's run leases every third of their time, take
    over the runs of proxies that stopped renewing, and those released elsewhere at once
    (RunRegistry.keep_leases)."""
    state: ProxyState = app[STATE]
    await state.ready.wait()
    await state.runs.keep_leases(state.backends, state.costs)


async def _posted_results(app: web.Application) -> None:
    """Hand the ``@tool`` results kept in the store (posted to another replica of a shared
    store, or before this proxy resumed the run), and the appends and closes kept for
    the runs here, to those runs as the store announces them, or every TAIL_POLL_S
    without a channel (RunRegistry.watch_posted)."""
    state: ProxyState = app[STATE]
    await state.ready.wait()
    await state.runs.watch_posted(
        state.backends.known,
        lambda: compile_options(state.backends, state.costs, state.runs.outcomes,
                                state.prices),
        recompile=state.config.append_recompile)


async def _check_tools(app: web.Application, every_s: float = 15.0) -> None:
    """Start and ask every ``[tools.*]`` server at once, then again every ``every_s``
    while one fails (``/readyz`` names it until it answers)."""
    tools = app[STATE].tools
    failing = await tools.check()
    while failing:
        log.warning("tool_servers_unusable", servers=failing)
        await asyncio.sleep(every_s)
        failing = await tools.check(sorted(failing))


async def _lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
    app[STATE].runs.wakeups.start()  # (the store's LISTEN, on a thread of its own)
    loader = asyncio.create_task(_load_engines(app))
    sweeper = asyncio.create_task(_sweep(app))
    posted = asyncio.create_task(_posted_results(app))
    beat = asyncio.create_task(_heartbeat(app)) if app[STATE].runs.store.shared else None
    checker = asyncio.create_task(_check_tools(app)) if app[STATE].tools else None
    yield
    if checker is not None:
        checker.cancel()
    loader.cancel()
    sweeper.cancel()
    posted.cancel()
    if beat is not None:
        beat.cancel()
    state: ProxyState = app[STATE]
    for run in list(state.runs.active.values()):
        run.suspend()  # persisted runs resume when the proxy starts again
    for engine in state.backends.engines:
        await engine.close()
    await state.backends.aclose()
    await state.tools.aclose()  # stdio tool servers' processes end
    state.runs.close()  # (every event submitted is written first, if the store can)
    state.runs.outcomes.close()


def create_app(engines: Mapping[str, Engine], config: ProxyConfig | None = None, *,
               file_config: FileConfig | None = None,
               transport: httpx.AsyncBaseTransport | None = None,
               residency: ResidencyManager | None = None,
               tracer_provider: TracerProvider | None = None) -> web.Application:
    """Build the proxy.

    Args:
        engines: served model name -> engine (the first is the default model).
        config: the proxy's settings, already merged (:func:`flowlift.proxy.config.settings`:
            flags over the file's ``[server]`` over defaults); None: the file's over the
            defaults.
        file_config: upstream providers and model routes (:mod:`flowlift.proxy.config`);
            its ``[server]`` section is read only when ``config`` is None.
        transport: httpx transport for every upstream (tests); None: the network.
        residency: the manager behind the :class:`~flowlift.local_engine.resident.ResidentEngine`
            engines among ``engines`` (several models in one memory budget); the proxy
            feeds it its running workflows' plans and queues.
        tracer_provider: an OpenTelemetry tracer provider for the proxy's spans; None:
            its own (OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, else JSON lines
            in ``config.trace_dir``; see :mod:`flowlift.tracing.spans`).

    Returns:
        An ``aiohttp.web.Application``; engines start when the app starts.
    """
    config = config or settings({}, file_config)
    backends = Backends(engines, DispatchSettings.from_config(config), config=file_config,
                        transport=transport)
    if not backends.models:
        raise ConfigError("nothing to serve: no embedded engine and no model in the config "
                          "file", param="--config")
    state_path = config.state_path or ":memory:"
    store = open_store(state_path)  # (raises on an unusable --state-db: before any exporter)
    outcomes = StepOutcomes(state_path, default_model=backends.default_model)
    # spans and metrics (the run count is read at scrape time, once `runs` exists)
    tel = telemetry.Telemetry.for_proxy(tracer_provider, config.trace_dir, backends,
                                        active_runs=lambda: len(runs.active),
                                        residency=residency)
    tools = ToolServers(file_config.tools if file_config else {})  # (imports callables)
    runs = RunRegistry(store, config.trace_dir, detached_timeout_s=config.detached_timeout_s,
                       outcomes=outcomes, max_active=config.max_runs, observer=tel,
                       lease_ttl_s=config.lease_ttl_s, proxy_tools=tools)
    # The whole middleware stack, outermost first.
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[
        # a span per OpenAI request (refused ones too) and its metrics, the OpenAI error
        # shape, API keys, the readiness gate: one middleware (proxy.middleware)
        proxy_stack(tel.request_spans()),
    ])
    app[STATE] = ProxyState(backends=backends, runs=runs, config=config,
                            residency=residency,
                            prices=file_config.prices() if file_config else {},
                            tenants=Tenants.build(config.api_keys, config.tenants),
                            tools=tools)
    app[lifecycle.DRAIN] = lifecycle.Drain()  # the SIGTERM drain (lifecycle.drain)
    if residency is not None:
        residency.lookahead = lambda: runs.lookahead(backends.canonical)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.add_routes(openai_api.routes)
    app.add_routes(workflows.routes)
    # per-turn cache accounting of X-Flowlift-Session sessions
    sessions_api.setup(app, SessionTable(max_sessions=config.max_sessions,
                                         ttl_s=config.session_ttl_s))
    # stored Responses API turns (previous_response_id), in the run store
    responses_api.setup(app, ResponseStore(store, io=runs.io,
                                           ttl_s=config.response_ttl_s,
                                           max_responses=config.max_responses))
    progress_api.setup(app)  # step counts of a run (the SDK's progress bar)
    ui.setup(app)  # /ui/workflows/{run_id} (timeline) and /ui/compile
    telemetry.setup(app, tel)  # /metrics, flushed at shutdown
    app.cleanup_ctx.append(_lifecycle)
    return app
