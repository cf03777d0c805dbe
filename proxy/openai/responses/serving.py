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

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from aiohttp_sse import EventSourceResponse, sse_response

from flowlift.errors import FlowliftError, RequestError, StoreUnavailable, UpstreamError
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.routing.routing import Route
from flowlift.proxy.dispatch.upstream.forward import upstream_error_response
from flowlift.proxy.http import parse_model
from flowlift.proxy.openai.generation import Timing
from flowlift.proxy.openai.responses import hosted as hosted_tools
from flowlift.proxy.openai.responses.events import Event, ResponseBuilder
from flowlift.proxy.openai.responses.pairing import check_pairs
from flowlift.proxy.openai.responses.protocol import (
    InputItem,
    ResponsesRequest,
    check_fields,
    new_id,
)
from flowlift.proxy.openai.responses.store import RESPONSES, ResponseStore, Turn
from flowlift.proxy.openai.responses.translation import (
    chat_messages,
    chat_request,
    chat_tools,
    input_items,
    item_json,
    without_replayed,
)
from flowlift.proxy.openai.responses.turn import Generation, Loop, Opener, open_first
from flowlift.proxy.sessions.table import tenant_program
from flowlift.proxy.state import STATE
from flowlift.proxy.telemetry.requests import RequestTrace
from flowlift.proxy.tenants import tenant_of
from flowlift.proxy.workflows.inferred import workflow_from

routes = web.RouteTableDef()
Done = Callable[[dict[str, Any]], Awaitable[None]]
"""Store and record a finished turn (its response object)."""


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
             if t.get("type") != "mcp" else
             {k: v for k, v in t.items() if k not in ("headers", "authorization")}
             for t in req.tools or ()]
    return {"id": rid, "created_at": int(time.time()), "model": model,
            "instructions": req.instructions, "tools": tools,
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "metadata": req.metadata or {}, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "text": req.text or {"format": {"type": "text"}},
            "truncation": req.truncation or "disabled",
            **({"max_tool_calls": req.max_tool_calls} if req.max_tool_calls else {})}


async def create(request: web.Request, data: dict[str, Any], route: Route,
                 traced: RequestTrace | None = None
                 ) -> web.StreamResponse:
    """Answer one ``POST /v1/responses`` (``data``: the parsed body) on ``route``
    (``traced``: the request's trace, read once at its route; None: untraced).

    Raises:
        RequestError: a malformed, unknown or unsupported field or input item, a
            ``function_call_output`` without its call (or twice), a call without its
            output (400, ``param``).
        PermissionDenied: a hosted MCP server the config or the tenant's key does not
            allow (403).
        ResponseNotFound: ``previous_response_id`` unknown, expired or another
            tenant's (404, ``param="previous_response_id"``).
        ToolServerUnavailable: a hosted MCP server that does not list its tools (424).
        EngineError: the engine failed before the first token (503).
    """
    state, store = request.app[STATE], request.app[RESPONSES]
    check_fields(data)
    req = parse_model(ResponsesRequest, data, "responses request")
    tenant = tenant_of(request)
    previous = (await store.load(req.previous_response_id, tenant, param="previous_response_id")
                if req.previous_response_id else None)
    items = input_items(req.input)
    history = previous.messages if previous else []
    check_pairs(history, items)
    new, rid = without_replayed(history, chat_messages(items)), new_id("resp")
    if not history and not new:
        raise RequestError("input is empty: send the turn's input (a string or a list of "
                           "items), or continue a conversation with previous_response_id",
                           param="input")
    others, mcp = hosted_tools.split(req.tools)
    tools = chat_tools(others) or []
    hosted = await hosted_tools.resolve(mcp, state.tools, state.tenants.by_name(tenant),
                                        {t["function"]["name"] for t in tools})
    try:
        return await _serve(request, req, data, route, traced, _Turn(
            rid, previous.conversation if previous else rid, history, new, items,
            1 + (previous.number if previous else 0), tools + hosted.chat_tools()), hosted)
    finally:
        await hosted.aclose()


@dataclass
class _Turn:
    rid: str
    conversation: str
    history: list[dict[str, Any]]
    new: list[dict[str, Any]]
    items: list[InputItem]
    number: int
    tools: list[dict[str, Any]]


async def _serve(request: web.Request, req: ResponsesRequest, data: dict[str, Any],
                 route: Route, traced: RequestTrace | None, turn: _Turn,
                 hosted: hosted_tools.Hosted
                 ) -> web.StreamResponse:
    state, store, tenant = request.app[STATE], request.app[RESPONSES], tenant_of(request)
    joined = workflow_from(request.headers, data)
    workflow = joined[0] if joined else turn.conversation
    structlog.contextvars.bind_contextvars(workflow_id=workflow, response_id=turn.rid)
    started_at, timing = time.time(), Timing(traced=traced)
    builder = ResponseBuilder(_head(req, turn.rid, route.model), hosted.labels())

    def build(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return chat_request(req, route.model, [], messages, stream=True,
                            tools=turn.tools or None)

    # on the embedded engine the turn is a call of the tenant's program (the
    # conversation, or the workflow it joined): scheduled with its other turns
    opener = Opener(request, route, turn.conversation, timing,
                    tenant_program(request, workflow), stream=req.stream is True)
    try:
        first, kept, chat = await open_first(opener, build, [*turn.history, *turn.new],
                                             req.truncation)
    except UpstreamError as exc:
        return upstream_error_response(exc)
    if traced is not None:
        traced.request(route.model, joined, req.stream is True, chat)
    loop = Loop(builder, opener, hosted, req.max_tool_calls)

    async def done(response: dict[str, Any]) -> None:
        opener.keep(response)
        if traced is not None:
            traced.answered(builder.usage, builder.finish)
        if req.store is not False and response["status"] != "failed":
            await store.save(Turn(response, [item_json(i) for i in turn.items],
                                  turn.conversation, [*kept, *loop.produced], turn.number),
                             tenant)
        state.inferred.record(
            workflow, step=joined[1] if joined else f"turn-{turn.number}", model=route.model,
            messages=chat["messages"], prompt=None,
            output=_text_of(loop.produced), usage=builder.usage, started_at=started_at,
            finished_at=time.time(), backend=loop.backend, sampling=chat, tenant=tenant)

    headers = {"X-Flowlift-Workflow": workflow}
    if not first.local:
        headers["X-Flowlift-Backend"] = first.backend
    events = _events(builder, loop, first, chat, done)
    try:
        if req.stream is True:
            return await _stream(request, builder, events, headers)
        async for _ in events:
            pass
    finally:
        await events.aclose()  # (a generator never started leaves its generation open)
        await first.close.aclose()
    if first.local:
        headers["Server-Timing"] = timing.server_timing()
    return web.json_response(builder.final_response or builder.final(), headers=headers)


def _text_of(produced: list[dict[str, Any]]) -> str:
    last = produced[-1] if produced else {"content": ""}
    return str(last.get("content") or json.dumps(last.get("tool_calls")))


async def _events(builder: ResponseBuilder, loop: Loop, first: Generation,
                  chat: dict[str, Any], done: Done) -> AsyncGenerator[Event, None]:
    """Every event of the turn; the turn is stored (``done``) before its terminal event,
    so the next turn can name it at once. A failure after the first generation started
    ends the events with ``response.failed`` when streamed (never a clean-looking
    finish), and is raised when not."""
    for event in builder.start():
        yield event
    for label, tools in loop.hosted.listings:
        for event in builder.list_tools(label, tools):
            yield event
    async for event in loop.run(first, chat):
        yield event
    events = builder.finish_events()
    builder.final_response = events[-1]["response"]
    await done(builder.final_response)
    for event in events:
        yield event


async def _send(resp: EventSourceResponse, event: Event) -> None:
    await resp.send(json.dumps(event, ensure_ascii=False), event=event["type"])


async def _stream(request: web.Request, builder: ResponseBuilder,
                  events: AsyncIterator[Event], headers: dict[str, str]
                  ) -> web.StreamResponse:
    """The Responses event stream (see :func:`_events`); a failure after the first event
    ends it with ``response.failed`` (never a clean-looking finish). A store that does not
    answer in time (an outage) ends it with ``response.failed`` coded
    ``store_unavailable`` within that bound, never a stream left open."""
    async with sse_response(request, sep="\n", headers=headers,
                            allow_all_methods=True) as resp:
        try:
            async for event in events:
                await _send(resp, event)
        except StoreUnavailable as exc:
            await _send(resp, builder.failed(exc.message, code="store_unavailable"))
        except FlowliftError as exc:
            await _send(resp, builder.failed(exc.message))
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
