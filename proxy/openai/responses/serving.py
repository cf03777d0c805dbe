"""``POST /v1/responses`` served by the proxy on every backend, statefully, and
``GET`` / ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A turn is translated to one chat completion (:mod:`.translation`), run on the backend
the route picks -- the embedded engine through the chat completions generation path,
or an upstream's ``/chat/completions`` (:mod:`.sources`) -- and its chunks become the
response or its event stream (:mod:`.events`, framed by ``aiohttp-sse``). With
``store`` (the default) the turn is kept (:mod:`.store`), so the next turn sends
``previous_response_id`` and only its new input: the proxy prepends the conversation,
keys replica affinity (and the engine's session) by the conversation, so the turn lands
where its prefix is cached and prefills only the delta (``usage.input_tokens_details.
cached_tokens`` shows it). Every turn of a conversation is a step of one inferred
workflow run whose id is the conversation's first response id (or the client's own
``X-Flowlift-Workflow``): ``GET /v1/workflows/{id}`` shows the turns.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web
from aiohttp_sse import EventSourceResponse, sse_response

from flowlift.errors import FlowliftError, RequestError, StoreUnavailable, UpstreamError
from flowlift.proxy.dispatch.backends import Backends, Local
from flowlift.proxy.dispatch.routing.routing import Route
from flowlift.proxy.dispatch.upstream.attempts import Opened, open_answer
from flowlift.proxy.dispatch.upstream.forward import demand_of, upstream_error_response
from flowlift.proxy.dispatch.upstream.provider import forwarded_headers
from flowlift.proxy.http import parse_model
from flowlift.proxy.openai.generation import Timing
from flowlift.proxy.openai.responses import sources
from flowlift.proxy.openai.responses.events import Event, ResponseBuilder
from flowlift.proxy.openai.responses.protocol import ResponsesRequest, new_id
from flowlift.proxy.openai.responses.store import RESPONSES, ResponseStore, Turn
from flowlift.proxy.openai.responses.translation import (
    assistant_message,
    chat_messages,
    chat_request,
    input_items,
    item_json,
    without_replayed,
)
from flowlift.proxy.state import STATE
from flowlift.proxy.tenants import tenant_of
from flowlift.proxy.workflows.inferred import workflow_from

routes = web.RouteTableDef()
Done = Callable[[dict[str, Any]], Awaitable[None]]


def served_here(backends: Backends, route: Route) -> bool:
    """Whether the proxy serves ``route``'s Responses requests itself: unless every
    backend of the route is an upstream that speaks the Responses API natively
    (``responses_api = "native"``, the default; e.g. OpenAI, which keeps the state
    then), which get the request passed through. Every backend speaks chat completions,
    so a mixed route (the embedded engine, ``responses_api = "chat"`` upstreams) is
    served here, on whichever of its backends the route picks."""
    ups = backends.upstreams
    return not all(n in ups and ups[n].spec.responses_api == "native" for n in route.backends)


def _head(req: ResponsesRequest, rid: str, model: str) -> dict[str, Any]:
    """The response object's fields that do not change while it is generated."""
    tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict", True)}
             for t in req.tools or ()]
    return {"id": rid, "created_at": int(time.time()), "model": model,
            "instructions": req.instructions, "tools": tools,
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "metadata": req.metadata or {}, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled"}


async def create(request: web.Request, data: dict[str, Any], route: Route
                 ) -> web.StreamResponse:
    """Answer one ``POST /v1/responses`` (``data``: the parsed body) on ``route``.

    Raises:
        RequestError: a malformed or unsupported field or input item (400, ``param``).
        ResponseNotFound: ``previous_response_id`` unknown, expired or another
            tenant's (404, ``param="previous_response_id"``).
        EngineError: the engine failed before the first token (503).
    """
    state, store = request.app[STATE], request.app[RESPONSES]
    req = parse_model(ResponsesRequest, data, "responses request")
    tenant = tenant_of(request)
    previous = (await store.load(req.previous_response_id, tenant, param="previous_response_id")
                if req.previous_response_id else None)
    items = input_items(req.input)
    new, rid = chat_messages(items), new_id("resp")
    history = previous.messages if previous else []
    new = without_replayed(history, new)
    if not history and not new:
        raise RequestError("input is empty: send the turn's input (a string or a list of "
                           "items), or continue a conversation with previous_response_id",
                           param="input")
    conversation = previous.conversation if previous else rid
    joined = workflow_from(request.headers, data)
    workflow = joined[0] if joined else conversation
    structlog.contextvars.bind_contextvars(workflow_id=workflow, response_id=rid)
    chat = chat_request(req, route.model, history, new, stream=True)
    turn = 1 + (previous.number if previous else 0)
    started_at, builder = time.time(), ResponseBuilder(_head(req, rid, route.model))

    async def done(response: dict[str, Any], backend: str | None) -> None:
        output = assistant_message(response["output"])
        if req.store is not False and response["status"] != "failed":
            await store.save(Turn(response, [item_json(i) for i in items], conversation,
                            [*history, *new, output], turn), tenant)
        state.inferred.record(
            workflow, step=joined[1] if joined else f"turn-{turn}", model=route.model,
            messages=chat["messages"], prompt=None,
            output=output["content"] or json.dumps(output.get("tool_calls")),
            usage=builder.usage, started_at=started_at, finished_at=time.time(),
            backend=backend, sampling=chat, tenant=tenant)

    try:
        opened = await open_answer(
            state.backends, route, path="/chat/completions",
            headers=forwarded_headers(request.headers), stream="events",
            body_for=lambda up: orjson.dumps(_upstream_body(chat, up.spec.stream_usage,
                                                            up.upstream_model(route.model))),
            affinity=conversation, demand=demand_of(orjson.dumps(chat), chat, conversation))
    except UpstreamError as exc:
        return upstream_error_response(exc)
    headers = {"X-Flowlift-Workflow": workflow}
    return await _answer(request, opened, chat, builder, conversation, req.stream is True,
                         done, headers)


def _upstream_body(chat: dict[str, Any], stream_usage: bool, model: str) -> dict[str, Any]:
    body = {**chat, "model": model}
    if not stream_usage:
        body.pop("stream_options", None)
    return body


async def _answer(request: web.Request, opened: Opened | Local, chat: dict[str, Any],
                  builder: ResponseBuilder, conversation: str, stream: bool,
                  done: Callable[[dict[str, Any], str | None], Awaitable[None]],
                  headers: dict[str, str]) -> web.StreamResponse:
    """Run the turn on what the route opened; the response or its event stream."""
    timing = Timing()
    if isinstance(opened, Local):
        backend, name = opened.backend, opened.backend.name
        source: contextlib.AbstractAsyncContextManager[sources.ChatChunks] = \
            sources.embedded(chat, opened.model, backend, conversation, timing)
        backend.admitted += 1  # as forward does: no burst slips through
    else:
        backend, name = None, opened.upstream.name
        source = contextlib.nullcontext(sources.upstream(opened))
        headers = {**headers, "X-Flowlift-Backend": name}
    try:
        async with source as chunks:
            if stream:
                return await _stream(request, builder, chunks,
                                     lambda r: done(r, name), headers)
            async for chunk in chunks:
                builder.feed(chunk)
    finally:
        if backend is not None:
            backend.admitted -= 1
    response = builder.final()
    await done(response, name)
    if isinstance(opened, Local):
        headers["Server-Timing"] = timing.server_timing()
    return web.json_response(response, headers=headers)


async def _send(resp: EventSourceResponse, event: Event) -> None:
    await resp.send(json.dumps(event, ensure_ascii=False), event=event["type"])


async def _stream(request: web.Request, builder: ResponseBuilder,
                  chunks: sources.ChatChunks, done: Done,
                  headers: dict[str, str]) -> web.StreamResponse:
    """The Responses event stream; a failure after the first event ends it with
    ``response.failed`` (never a clean-looking finish). The turn is stored before its
    terminal event is sent, so the next turn can name it at once; a store that does not
    answer in time (an outage) ends it with ``response.failed`` coded
    ``store_unavailable`` within that bound, never a stream left open."""
    async with sse_response(request, sep="\n", headers=headers,
                            allow_all_methods=True) as resp:
        for event in builder.start():
            await _send(resp, event)
        try:
            async for chunk in chunks:
                for event in builder.feed(chunk):
                    await _send(resp, event)
        except FlowliftError as exc:
            await _send(resp, builder.failed(exc.message))
            return resp
        *closing, terminal = builder.finish_events()
        for event in closing:
            await _send(resp, event)
        try:
            await done(terminal["response"])
        except StoreUnavailable as exc:
            await _send(resp, builder.failed(exc.message, code="store_unavailable"))
            return resp
        await _send(resp, terminal)
    return resp


def _store(request: web.Request) -> ResponseStore:
    return request.app[RESPONSES]


@routes.get("/v1/responses/{response_id}")
async def retrieve(request: web.Request) -> web.Response:
    """A stored response (``client.responses.retrieve``); 404 when none is visible."""
    turn = await _store(request).load(request.match_info["response_id"], tenant_of(request),
                                param="response_id")
    return web.json_response(turn.response)


@routes.delete("/v1/responses/{response_id}")
async def delete(request: web.Request) -> web.Response:
    """Forget a stored response (``client.responses.delete``); 404 when none is visible.
    Later turns that continued it stay usable (each keeps its whole conversation)."""
    rid = request.match_info["response_id"]
    await _store(request).delete(rid, tenant_of(request))
    return web.json_response({"id": rid, "object": "response", "deleted": True})


@routes.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: web.Request) -> web.Response:
    """The input items of a stored response, as a ``ResponseItemList`` (one page)."""
    turn = await _store(request).load(request.match_info["response_id"], tenant_of(request),
                                param="response_id")
    items = turn.input_items
    if request.query.get("order", "desc") == "desc":
        items = items[::-1]
    return web.json_response({"object": "list", "data": items, "has_more": False,
                              "first_id": items[0]["id"] if items else None,
                              "last_id": items[-1]["id"] if items else None})


def setup(app: web.Application, store: ResponseStore) -> None:
    """Serve the stored-response routes from ``store`` (``POST`` is in the OpenAI routes)."""
    app[RESPONSES] = store
    app.add_routes(routes)
