"""The HTTP edge: OpenAI-shaped errors, JSON bodies, SSE responses.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` with a status
the official ``openai`` client maps to its exception classes (400 BadRequestError,
404 NotFoundError, 413, 422 UnprocessableEntityError, 503 InternalServerError...).
aiohttp's own HTTP errors (404 route, 405, 413 body too large) are translated here, in
one place, and so is pydantic's ``ValidationError`` (the ``param`` names the field).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from flowlift.errors import FlowliftError, IncompleteBody, PayloadTooLarge, RequestError
from flowlift.proxy.state import STATE
from flowlift.tracing import get_logger

log = get_logger("flowlift.proxy")
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_AIOHTTP_TYPES = {404: ("not_found_error", "not_found"),
                  405: ("invalid_request_error", "method_not_allowed"),
                  413: ("invalid_request_error", "payload_too_large")}


def error_response(exc: FlowliftError, headers: dict[str, str] | None = None) -> web.Response:
    """The OpenAI-shaped answer for ``exc`` (``Retry-After`` when it names a wait)."""
    headers = dict(headers or {})
    if exc.retry_after_s is not None:
        headers.setdefault("Retry-After", str(max(1, math.ceil(exc.retry_after_s))))
    return web.json_response(exc.to_openai(), status=exc.status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Translate every failure into the OpenAI error shape (:func:`error_answer`); the
    proxy's own middleware does the same inline
    (:func:`flowlift.proxy.middleware.proxy_stack`)."""
    try:
        return await handler(request)
    except Exception as exc:
        return error_answer(request, exc)


def error_answer(request: web.Request, exc: Exception) -> web.Response:
    """The OpenAI-shaped answer to ``request`` for ``exc``, which its handling raised
    (call it in the ``except`` block: an unexpected error is logged with its
    traceback, and never leaked).

    Raises:
        web.HTTPException: ``exc`` itself, when it is aiohttp's answer below 400 (a
            redirect, which is no failure).
    """
    if isinstance(exc, FlowliftError):
        return error_response(exc)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        kind, code = _AIOHTTP_TYPES.get(exc.status, ("invalid_request_error", None))
        body = {"error": {"message": f"{exc.reason}: {request.method} {request.path}"
                          if exc.status in (404, 405) else exc.text or exc.reason,
                          "type": kind, "param": None, "code": code}}
        return web.json_response(body, status=exc.status)
    log.exception("unhandled_error", path=request.path)
    body = {"error": {"message": "internal error in the flowlift proxy; see its log",
                      "type": "server_error", "param": None, "code": "internal_error"}}
    return web.json_response(body, status=500)


def _loc(err: Any) -> str:
    out = ""
    for part in err["loc"]:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


async def read_body(request: web.Request) -> bytes:
    """The request's raw body (case N10: a body still arriving is read while it makes
    progress; one that sends nothing for the config's ``body_idle_timeout_s`` is cut).

    Raises:
        PayloadTooLarge: over the configured body limit (case B4: HTTP 413).
        IncompleteBody: the connection closed (or its client half-closed it), or the
            body stalled, before the bytes its ``Content-Length`` announced arrived
            (HTTP 400, and a log line).
        RequestError: a body its ``Content-Encoding`` cannot decode (HTTP 400).
    """
    try:
        if request.content.is_eof() or request.content_length == request.content.total_bytes:
            body = await request.read()  # whole already: the common case, no watchdog
        else:
            body = await _read_while_moving(request)
        announced = request.content_length
        if (announced is not None and len(body) < announced
                and "Content-Encoding" not in request.headers):
            # the body ended early: the client half-closed (proxy/half_close.py)
            raise _incomplete(request, "the client closed its side")
        return body
    except ConnectionResetError:  # aiohttp: the client closed before the body was whole
        raise _incomplete(request, "the connection closed") from None
    except asyncio.CancelledError:  # the handler is cancelled when its client goes away
        if request.content.total_bytes < (request.content_length or 0):
            _incomplete(request, "the connection closed")  # the log line; nobody to answer
        raise
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[STATE].config.max_body_bytes
        raise PayloadTooLarge(f"request body over the limit of {limit} bytes; raise it with "
                              "`flowlift serve --max-body-mb`", param="body") from None
    except web.RequestPayloadError:  # aiohttp's decoder: bad gzip/deflate/br data
        encoding = request.headers.get("Content-Encoding", "")
        raise RequestError(f"request body cannot be decoded as Content-Encoding "
                           f"{encoding!r}: send it compressed that way, or send it "
                           "uncompressed without the header", param="body") from None


async def _read_while_moving(request: web.Request) -> bytes:
    """``request.read()``, cut when no byte arrived for ``body_idle_timeout_s``."""
    idle_s = request.app[STATE].config.body_idle_timeout_s
    reading = asyncio.ensure_future(request.read())
    seen = request.content.total_bytes
    try:
        while True:
            done, _ = await asyncio.wait((reading,), timeout=idle_s)
            if done:
                return reading.result()
            if request.content.total_bytes == seen:
                raise _incomplete(request, f"nothing arrived for {idle_s:g} s")
            seen = request.content.total_bytes
    finally:
        if not reading.done():
            reading.cancel()
        elif not reading.cancelled():
            reading.exception()  # retrieved: re-raised above, or superseded by a cancel


def _incomplete(request: web.Request, why: str) -> IncompleteBody:
    got, announced = request.content.total_bytes, request.content_length
    log.warning("incomplete_request_body", path=request.path, received_bytes=got,
                content_length=announced, reason=why)
    return IncompleteBody(f"incomplete request body: {got} of the {announced} bytes its "
                          f"Content-Length announced arrived, then {why}; send the whole "
                          "body", param="body")


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON (orjson).

    Raises:
        RequestError: not UTF-8 JSON.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:  # what orjson refuses but JSON allows: integers past 64 bits
        data = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", param="body") from None
    except RecursionError:
        raise RequestError("request body nests JSON too deeply (over 1,000 levels)",
                           param="body") from None
    _check_strings(data)
    return data


def _no_constant(name: str) -> Any:
    """``NaN`` and ``Infinity`` are not JSON (RFC 8259 §6): echoed into an answer or an
    event they would break every strict client."""
    raise RequestError(f"request body holds {name}, which JSON does not allow; send a "
                       "number or null", param="body")


def _check_strings(data: Any) -> None:
    """Reject a string holding a lone UTF-16 surrogate (``"\\ud800"``): it is not
    Unicode, and cannot be written back out as UTF-8 (a stream would break mid-way)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError("request body holds a lone UTF-16 surrogate escape in a "
                                   f"string ({item[:40]!r}); send valid Unicode",
                                   param="body") from None


async def read_json(request: web.Request) -> Any:
    """The request's JSON body.

    Raises:
        RequestError: not JSON. PayloadTooLarge: over the configured body limit.
    """
    return parse_json(await read_body(request))


def json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object with a non-empty string ``model``.

    Raises:
        RequestError: not a JSON object, or ``model`` missing or not a string.
    """
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object", param="body")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("`model` is required: the name of a served model (see "
                           "GET /v1/models)", param="model")
    return data


def parse_model(model: type[M], data: Any, what: str) -> M:
    """Validate ``data`` into ``model``; the error lists every bad field by its path.

    Raises:
        RequestError: with ``param`` set to the first bad field.
    """
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        msgs = [f"{_loc(e) or '(body)'}: {e['msg']}" for e in errors[:8]]
        raise RequestError(f"invalid {what}: " + "; ".join(msgs),
                           param=_loc(errors[0]) or "body") from None
