"""OpenAI-compatible requests served by the embedded engine (``POST /v1/chat/completions``,
plain and ``stream: true`` SSE). :mod:`flowlift.proxy.openai_api` routes a request here
when its model is served in process, and to :mod:`flowlift.proxy.forward` otherwise.

Shapes follow OpenAI's published API description (``shared/specs/openai-openapi.yaml``):
``chat.completion`` / ``chat.completion.chunk`` objects, ``data: [DONE]`` at the end of
a stream, ``stream_options.include_usage`` adds a final chunk with ``choices: []``.
Cached prompt tokens are reported in ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Literal

from aiohttp import web
from aiohttp_sse import sse_response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowlift.errors import FlowliftError, RequestError
from flowlift.local_engine.base import (
    ChatMessage,
    GenerationRequest,
    OutputConstraint,
    SamplingOptions,
    Usage,
)
from flowlift.proxy.backends import Backend
from flowlift.proxy.http import parse_model
from flowlift.proxy.scheduler import Priority


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The fields flowlift acts on; unknown fields are accepted (and ignored by the
    embedded engine)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if (self.n or 1) > 1:
            raise ValueError("n > 1 is not supported by the embedded engine yet; send n "
                             "separate requests")
        if self.tools:
            raise ValueError("tool calling is not supported by the embedded engine yet")
        return self

    def constraint(self) -> OutputConstraint | None:
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return OutputConstraint(json_schema={"type": "object"})
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise RequestError("response_format.json_schema.schema must be a JSON "
                                   "Schema object", param="response_format.json_schema.schema")
            return OutputConstraint(json_schema=schema)
        raise RequestError(f"response_format.type {kind!r} is not one of text, json_object, "
                           "json_schema", param="response_format.type")

    def sampling(self) -> SamplingOptions:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingOptions(max_tokens=self.max_completion_tokens or self.max_tokens,
                               temperature=1.0 if self.temperature is None else self.temperature,
                               top_p=1.0 if self.top_p is None else self.top_p,
                               stop=stop, seed=self.seed)


def _usage(u: Usage | None) -> dict[str, Any]:
    u = u or Usage()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


async def chat_completions(request: web.Request, data: Any, model: str,
                           backend: Backend) -> web.StreamResponse:
    """Answer one chat completion request (``data``: the parsed JSON body) on ``backend``.

    Raises:
        RequestError: a field the embedded engine cannot honour (named in ``param``).
    """
    body = parse_model(ChatCompletionRequest, data, "chat completion request")
    cid = f"chatcmpl-{secrets.token_hex(12)}"
    gen = GenerationRequest(
        request_id=cid, model=model,
        messages=[ChatMessage("system" if m.role == "developer" else m.role, m.text())
                  for m in body.messages],
        sampling=body.sampling(), constraint=body.constraint(),
        session_id=request.headers.get("x-flowlift-session"))
    created = int(time.time())
    base = {"id": cid, "created": created, "model": model}
    t_queued = time.monotonic()
    async with backend.slots.slot(Priority.of("interactive")):
        t_started = time.monotonic()
        stream = backend.engine.generate(gen)
        try:
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return await _stream(request, stream, base, include_usage)
            text, finish, usage = [], None, None
            async for chunk in stream:
                text.append(chunk.text)
                finish = chunk.finish_reason or finish
                usage = chunk.usage or usage
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
    t_done = time.monotonic()
    timing = (f"queue;dur={(t_started - t_queued) * 1000:.1f}, "
              f"engine;dur={(t_done - t_started) * 1000:.1f}")
    return web.json_response({
        **base, "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                     "logprobs": None, "finish_reason": finish or "stop"}],
        "usage": _usage(usage)}, headers={"Server-Timing": timing})


async def _stream(request: web.Request, stream: Any, base: dict[str, Any],
                  include_usage: bool) -> web.StreamResponse:
    head = {**base, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None) -> str:
        data = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}
        if include_usage:
            data["usage"] = None
        return json.dumps(data, ensure_ascii=False)

    async with sse_response(request, sep="\n", allow_all_methods=True) as resp:
        await resp.send(chunk({"role": "assistant", "content": ""}, None))
        usage = None
        try:
            async for piece in stream:
                usage = piece.usage or usage
                if piece.text:
                    await resp.send(chunk({"content": piece.text}, None))
                if piece.finish_reason:
                    await resp.send(chunk({}, piece.finish_reason))
        except FlowliftError as exc:  # headers are out: report in band, never a clean finish
            await resp.send(json.dumps(exc.to_openai()))
            return resp
        if include_usage:
            await resp.send(json.dumps({**head, "choices": [], "usage": _usage(usage)}))
        await resp.send("[DONE]")
    return resp
