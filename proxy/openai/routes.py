"""The OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/responses`` and ``GET /v1/models``.

Each request goes to its model's :class:`~flowlift.proxy.dispatch.routing.routing.Route`:
the embedded
engine (:mod:`flowlift.proxy.openai.chat_completion.serving`) or upstream providers
(:mod:`flowlift.proxy.dispatch.upstream.forward`). Shapes follow OpenAI's published API description
(``shared/specs/openai-openapi.yaml``).

A request that names a workflow (``X-Flowlift-Workflow`` / ``X-Flowlift-Step`` headers
or ``metadata.flowlift_workflow``) joins it: it sticks to one replica by the workflow
id, its log lines carry the id, and its prompt and answer feed the workflow's inferred
graph (:mod:`flowlift.proxy.workflows.inferred`, shown by ``GET /v1/workflows/{id}``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
import structlog
from aiohttp import web

from flowlift.errors import ModelNotFound, RequestError
from flowlift.proxy.dispatch.backends import Local
from flowlift.proxy.dispatch.local import choose_local, serve_local
from flowlift.proxy.dispatch.upstream.forward import OnOutput, forward
from flowlift.proxy.http import json_object, read_body
from flowlift.proxy.openai.chat_completion import serving as embedded
from flowlift.proxy.openai.responses import serving as responses_serving
from flowlift.proxy.state import STATE, ProxyState
from flowlift.proxy.telemetry import requests as request_tracing
from flowlift.proxy.tenants import tenant_of
from flowlift.proxy.workflows.inferred import workflow_from

routes = web.RouteTableDef()
_SESSION_ID = re.compile(r"[\x21-\x7e]{1,128}")
EmbeddedHandler = Callable[..., Awaitable[web.StreamResponse]]


def _recorder(state: ProxyState, joined: tuple[str, str | None], model: str,
              data: dict[str, Any], tenant: str | None) -> OnOutput:
    """Records a finished answer into its inferred workflow (``tenant``'s)."""
    started = time.time()
    messages, prompt = data.get("messages"), data.get("prompt")

    def record(output: str, usage: dict[str, Any] | None) -> None:
        state.inferred.record(
            joined[0], step=joined[1], model=model,
            messages=messages if isinstance(messages, list) else None,
            prompt=prompt if isinstance(prompt, str) else None, output=output, usage=usage,
            started_at=started, finished_at=time.time(), backend=None, sampling=data,
            tenant=tenant)
    return record


async def _dispatch(request: web.Request, path: str, handler: EmbeddedHandler | None, *,
                    observe: bool = True) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await read_body(request)
    data = json_object(raw)
    route = state.backends.route(data["model"])
    if not isinstance(data.get("stream", False), bool | None):
        raise RequestError("`stream` must be true or false", param="stream")
    session = request.headers.get("x-flowlift-session")
    if session is not None and not _SESSION_ID.fullmatch(session):
        raise RequestError("X-Flowlift-Session must be 1-128 printable ASCII characters with "
                           "no spaces; use an id like 'agent-7' or a UUID",
                           param="X-Flowlift-Session")
    joined = workflow_from(request.headers, data) if observe else None
    if joined and isinstance(data.get("metadata"), dict) and any(
            k.startswith("flowlift_") for k in data["metadata"]):
        meta = {k: v for k, v in data["metadata"].items() if not k.startswith("flowlift_")}
        data = {k: v for k, v in data.items() if k != "metadata"} | (
            {"metadata": meta} if meta else {})
        raw = orjson.dumps(data)  # flowlift's own fields stay in the proxy
    affinity = joined[0] if joined else session
    on_output = (_recorder(state, joined, route.model, data, tenant_of(request))
                 if joined else None)
    if joined:
        structlog.contextvars.bind_contextvars(workflow_id=joined[0], step_id=joined[1])
    # the request's trace, fetched here once: every site below is handed it
    traced = request_tracing.current()
    if traced is not None:
        traced.request(route.model, joined, data.get("stream") is True, data)

    async def local(target: Local) -> web.StreamResponse:
        assert handler is not None
        kwargs: dict[str, Any] = {} if on_output is None else {"on_output": on_output}
        if observe and traced is not None:  # (the generating handlers: chat, completions)
            kwargs["traced"] = traced
        return await handler(request, data, target.model, target.backend, **kwargs)

    target = choose_local(state.backends, route, affinity) if handler is not None else None
    if target is not None:  # decided once: local requests never enter the forwarder
        return await serve_local(target, local)
    return await forward(request, backends=state.backends, route=route, path=path,
                         raw=raw, data=data, affinity=affinity,
                         embedded=local if handler is not None else None,
                         on_output=on_output, traced=traced)


# the drop-in routes are _dispatch itself, its arguments bound (a coroutine function
# wrapping it would add a frame that every resumption of a request passes through)
routes.post("/v1/chat/completions")(partial(
    _dispatch, path="/chat/completions", handler=embedded.chat_completions))
routes.post("/v1/completions")(partial(
    _dispatch, path="/completions", handler=getattr(embedded, "completions", None)))
routes.post("/v1/embeddings")(partial(
    _dispatch, path="/embeddings", handler=getattr(embedded, "embeddings", None),
    observe=False))


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    """The Responses API: served by the proxy, statefully, over chat completions
    (:mod:`flowlift.proxy.openai.responses.serving`), unless every backend of the route
    is an upstream that speaks it natively (passed through then)."""
    state = request.app[STATE]
    data = json_object(await read_body(request))
    route = state.backends.route(data["model"])
    if responses_serving.served_here(state.backends, route):
        return await responses_serving.create(request, data, route,
                                              request_tracing.current())
    return await _dispatch(request, "/responses", None, observe=False)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    created = int(state.started_at)
    data = [{"id": m, "object": "model", "created": created, "owned_by": "flowlift"}
            for m in state.backends.routes]
    return web.json_response({"object": "list", "data": data})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    """One served model (``client.models.retrieve``).

    Raises:
        ModelNotFound: a name nothing serves (404).
    """
    state = request.app[STATE]
    name = request.match_info["model"]
    if name not in state.backends.routes:
        raise ModelNotFound(name, list(state.backends.routes))
    return web.json_response({"id": name, "object": "model", "created": int(state.started_at),
                              "owned_by": "flowlift"})
