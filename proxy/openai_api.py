"""The OpenAI-compatible API: ``POST /v1/chat/completions`` and ``GET /v1/models``.

A request for a model served in process goes to :mod:`flowlift.proxy.embedded`.
Shapes follow OpenAI's published API description (``shared/specs/openai-openapi.yaml``).
"""

from __future__ import annotations

from aiohttp import web

from flowlift.proxy import embedded
from flowlift.proxy.http import read_json
from flowlift.proxy.state import STATE

routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    data = await read_json(request)
    model, backend = state.backends.resolve(data.get("model") if isinstance(data, dict) else None)
    return await embedded.chat_completions(request, data, model, backend)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    created = int(state.started_at)
    data = [{"id": m, "object": "model", "created": created, "owned_by": "flowlift"}
            for m in state.backends.models]
    return web.json_response({"object": "list", "data": data})
