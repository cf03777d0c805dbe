"""OpenAI-compatible requests served by the embedded engine: ``POST /v1/chat/completions``
(here), ``POST /v1/completions`` (:mod:`flowlift.proxy.openai.completion.serving`, re-exported
as :func:`completions`) and ``POST /v1/embeddings`` (:func:`embeddings`: refused, the
embedded engine is generative). :mod:`flowlift.proxy.openai.routes` routes a request here
when its model is served in process.

Shapes follow OpenAI's published API description (``shared/specs/openai-openapi.yaml``):
``chat.completion`` / ``chat.completion.chunk`` objects, ``data: [DONE]`` at the end of
a stream, ``stream_options.include_usage`` adds a final chunk with ``choices: []``.
Cached prompt tokens are reported in ``usage.prompt_tokens_details.cached_tokens``.

Supported beyond plain chat: ``n`` (concurrent generations, seeds ``seed + i``; streamed
chunks of the choices interleave, each with its ``index``), ``logprobs`` /
``top_logprobs`` (0-20, ``choices[].logprobs.content[]``), tools
(:mod:`flowlift.proxy.wire.tool_calls`; when streamed, each call as OpenAI streams it:
a first ``delta.tool_calls`` entry with ``index``, ``id``, ``type``, ``function.name``
and ``arguments: ""``, then ``arguments`` fragments as the model writes them
(:mod:`flowlift.proxy.wire.call_deltas`); plain content streams as it is decoded; a
streamed call the answer does not hold in the end ends the stream with an
``invalid_tool_call`` error event), ``presence_penalty`` / ``frequency_penalty`` /
``logit_bias``.
Unknown fields are accepted and ignored; an OpenAI field the engine cannot honour
(``audio``, ``prediction``, ``reasoning_effort``, the deprecated ``functions``...) is a
400 naming the field and the fix. Errors before the first generated token (a prompt
too long, a schema the engine rejects) are HTTP errors even for ``stream: true``; later
ones are reported in the stream as an ``{"error": ...}`` event, without ``[DONE]``.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

from aiohttp import web
from pydantic import Field

from flowlift.errors import RequestError
from flowlift.local_engine.base import (
    GenerationChunk,
    GenerationRequest,
    OutputConstraint,
    TokenLogprob,
    ToolCall,
    Usage,
)
from flowlift.proxy.dispatch.backends import Backend
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.http import parse_model
from flowlift.proxy.openai.completion.serving import completions
from flowlift.proxy.openai.generation import (
    OnOutput,
    SamplingFields,
    Timing,
    Unsupported,
    fan_out,
    notify,
    reject_unsupported,
    started,
    stream_choices,
    total_usage,
    usage_json,
)
from flowlift.proxy.sessions.table import observe, program_of
from flowlift.proxy.state import STATE
from flowlift.proxy.telemetry.requests import RequestTrace
from flowlift.proxy.wire.call_deltas import CallStream
from flowlift.proxy.wire.tool_calls import (
    Message,
    Tool,
    ToolChoice,
    ToolPlan,
    check_schema,
    conversation,
    engine_messages,
    plan_tools,
    tool_defs,
)
from flowlift.proxy.wire.tool_output import tool_calls_text
from flowlift.proxy.workflows.ahead import HOLE, next_turn_prefix

__all__ = ["ChatCompletionRequest", "chat_completions", "completions", "embeddings"]


def _always(_: Any) -> bool:
    return True


_UNSUPPORTED: Unsupported = {
    "functions": (bool, "send them as `tools` (each {\"type\": \"function\", ...})"),
    "function_call": (_always, "use `tool_choice`"),
    "audio": (_always, "the embedded model outputs text only; remove `audio`"),
    "modalities": (lambda v: v != ["text"], 'the embedded model outputs text only; send '
                   '["text"] or leave `modalities` out'),
    "prediction": (_always, "predicted outputs are not supported; remove `prediction`"),
    "web_search_options": (_always, "the embedded model cannot search the web; remove it"),
    "reasoning_effort": (_always, "the embedded model is not a reasoning model; remove it"),
}


class ChatCompletionRequest(SamplingFields):
    """The fields flowlift acts on; unknown fields are accepted and ignored."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def response_schema(self) -> dict[str, Any] | None:
        """The JSON Schema of ``response_format`` (``None`` for plain text).

        Raises:
            RequestError: an unknown ``type`` or a ``json_schema`` without a schema.
        """
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            param = "response_format.json_schema.schema"
            if not isinstance(schema, dict):
                raise RequestError(f"{param} must be a JSON Schema object", param=param)
            try:
                check_schema(schema)
            except ValueError as exc:
                raise RequestError(f"{param} is {exc}", param=param) from None
            return schema
        raise RequestError(f"response_format.type {kind!r} is not one of text, json_object, "
                           "json_schema", param="response_format.type")

    def tool_plan(self) -> ToolPlan | None:
        """How the request uses its tools (``None``: it does not).

        Raises:
            RequestError: ``tool_choice`` inconsistent with ``tools``; ``logprobs``
                together with tool calling.
        """
        try:
            plan = plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls,
                              self.response_schema())
        except ValueError as exc:
            raise RequestError(str(exc), param="tool_choice") from None
        if plan is not None and self.logprobs:
            raise RequestError("logprobs are not reported for answers that may call tools "
                               "on the embedded engine; leave `logprobs` out, or send "
                               'tool_choice: "none"', param="logprobs")
        return plan

    def logprobs_k(self) -> int | None:
        """Alternatives per token for the engine (``None``: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def chat_logprobs(items: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI ``ChatCompletionTokenLogprob`` objects (``bytes``: the token's UTF-8)."""
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return [{**one(t.token, t.logprob), "top_logprobs": [one(tok, lp) for tok, lp in t.top]}
            for t in items]


class ChatChoice:
    """One choice of a chat answer: turns engine chunks into stream deltas
    (:meth:`step`) and, at the end, into the ``choices[]`` entry (:meth:`final`).

    Args:
        stream: the answer is streamed: its calls' pieces (``call_deltas``) become
            ``delta.tool_calls`` entries as they come
            (:class:`~flowlift.proxy.wire.call_deltas.CallStream`); otherwise (and for
            an engine that sends none) each call is sent whole at the end.
    """

    def __init__(self, index: int, plan: ToolPlan | None, logprobs: bool,
                 stream: bool = True) -> None:
        self.index = index
        self.logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self.content: str | None = ""
        self.tool_calls: list[dict[str, Any]] | None = None
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.calls_only = plan is not None and plan.mode == "required"
        self._stream = stream
        self._calls = CallStream()

    def _delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None,
               finish: str | None = None) -> dict[str, Any]:
        lp = None if logprobs is None else {"content": logprobs, "refusal": None}
        return {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def first(self) -> dict[str, Any]:
        return self._delta({"role": "assistant", "content": None if self.calls_only else ""})

    def step(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        """The stream's choice entries for ``chunk`` (none, a content delta, tool call
        deltas, the finish).

        Raises:
            EngineError: ``code="invalid_tool_call"``: a streamed call that the answer
                does not hold in the end (:meth:`CallStream.finish`).
        """
        self.usage = chunk.usage or self.usage
        text = chunk.text
        lp = chat_logprobs(chunk.logprobs) if chunk.logprobs and self.logprobs is not None \
            else None
        self.content = (self.content or "") + text
        self.logprobs = None if self.logprobs is None else [*self.logprobs, *(lp or ())]
        out = [self._delta({"content": text}, lp)] if text or lp else []
        if chunk.call_deltas and self._stream:
            out += [self._delta({"tool_calls": [entry]})
                    for entry in self._calls.feed(chunk.call_deltas)]
        if chunk.finish_reason:
            out.extend(self._finish(chunk.finish_reason, chunk.tool_calls))
        return out

    def _finish(self, reason: str, calls: tuple[ToolCall, ...] | None,
                ) -> list[dict[str, Any]]:
        """The rest of the calls (OpenAI's entries: one per chunk) and the finish entry."""
        out = [self._delta({"tool_calls": [entry]}) for entry in self._calls.finish(calls)]
        if self._calls.calls:
            self.tool_calls = self._calls.calls
            self.content = self.content or None
        self.finish = reason
        return [*out, self._delta({}, finish=reason)]

    def final(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content,
                                   "refusal": None}
        if self.tool_calls is not None:
            message["tool_calls"] = self.tool_calls
        lp = None if self.logprobs is None else {"content": self.logprobs, "refusal": None}
        return {"index": self.index, "message": message, "logprobs": lp,
                "finish_reason": self.finish or "stop"}

    def calls(self) -> tuple[ToolCall, ...]:
        """The answer's tool calls, as the engine's :class:`ToolCall` values."""
        return tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                     for c in self.tool_calls or ())

    def output_text(self) -> str:
        """What ``on_output`` gets: the content, or the tool calls' JSON text."""
        return tool_calls_text(self.tool_calls) if self.tool_calls else self.content or ""


def prepare(body: ChatCompletionRequest, request_id: str, model: str, backend: Backend,
            session_id: str | None, stream: bool | None = None,
            ) -> tuple[GenerationRequest, list[ChatChoice], ToolPlan | None]:
    """The engine request of a chat completion, one :class:`ChatChoice` per ``n``, and
    its tool plan (the Responses API runs its turns through this too; ``stream``: whether
    the answer reaches its client streamed, default ``body.stream``).

    Raises:
        RequestError: a field the embedded engine cannot honour, bad tools or logprobs.
    """
    reject_unsupported(body, _UNSUPPORTED)
    plan, k = body.tool_plan(), body.logprobs_k()
    schema = body.response_schema()
    if k is not None and not backend.engine.capabilities.logprobs:
        raise RequestError("this engine does not report logprobs; leave `logprobs` out",
                           param="logprobs")
    gen = GenerationRequest(
        request_id=request_id, model=model, messages=engine_messages(body.messages, plan),
        sampling=body.sampling(body.max_completion_tokens or body.max_tokens, k),
        constraint=None if schema is None else OutputConstraint(json_schema=schema),
        session_id=session_id)
    if plan is not None:  # tool_generate offers them in the model's format
        gen = dataclasses.replace(
            gen, messages=conversation(body.messages), tools=tool_defs(plan.tools),
            tool_choice=plan.mode, parallel_tool_calls=plan.parallel)
    streamed = bool(body.stream) if stream is None else stream
    return gen, [ChatChoice(i, plan, k is not None, streamed)
                 for i in range(body.n or 1)], plan


def next_turn_request(gen: GenerationRequest, content: str,
                      calls: tuple[ToolCall, ...]) -> GenerationRequest:
    """A session's next turn as far as it is known while ``calls`` are out: ``gen``'s
    conversation, this answer, and the first call's result as the hole
    (:func:`flowlift.proxy.workflows.ahead.next_turn_prefix`), for a prefill-ahead."""
    return dataclasses.replace(gen, request_id=f"{gen.request_id}:next",
                               messages=next_turn_prefix(gen.messages, content, calls))


async def chat_completions(request: web.Request, data: Any, model: str, backend: Backend, *,
                           on_output: OnOutput | None = None,
                           traced: RequestTrace | None = None) -> web.StreamResponse:
    """Answer one chat completion request (``data``: the parsed JSON body) on ``backend``.

    Args:
        model: the served model name (aliases resolved).
        on_output: called once when the answer completes (streamed or not) with the
            first choice's text (for tool calls: the JSON text of its ``tool_calls``
            list) and the ``usage`` object; not called for a failed answer.
        traced: the request's trace, from where it was dispatched (None: untraced).

    Returns:
        A ``chat.completion`` JSON response, or an SSE stream of
        ``chat.completion.chunk`` objects for ``stream: true``.

    Raises:
        RequestError: a malformed request or a field the embedded engine cannot honour
            (400, named in ``param``); a prompt too long or a schema the engine rejects.
        EngineError: the engine failed before the first token (503).
    """
    body = parse_model(ChatCompletionRequest, data, "chat completion request")
    on_output = observe(request, backend.name, on_output)  # per-session turn accounting
    cid = f"chatcmpl-{secrets.token_hex(12)}"
    gen, choices, plan = prepare(body, cid, model, backend,
                                 request.headers.get("x-flowlift-session"))
    head = {"id": cid, "created": int(time.time()), "model": model}

    program = program_of(request)

    def done() -> dict[str, Any]:
        usage = usage_json(total_usage([c.usage for c in choices]))
        notify(on_output, choices[0].output_text(), usage)
        if choices[0].tool_calls and program is not None:
            # a session's tool is out: its next turn is likely; keep its KV and prefill
            # what is known of that turn (the conversation and these calls)
            backend.slots.programs.keep(program)
            request.app[STATE].backends.ahead.issue(
                next_turn_request(gen, choices[0].content or "", choices[0].calls()), HOLE)
        return usage

    timing = Timing(traced=traced)
    try:
        async with started(backend, fan_out(gen, len(choices)), timing,
                           Priority.of("interactive", program=program)) as chunks:
            if body.stream:
                return await stream_choices(
                    request, {**head, "object": "chat.completion.chunk"},
                    body.include_usage, [c.first() for c in choices], chunks,
                    lambda i, chunk: choices[i].step(chunk), done)
            async for index, chunk in chunks:
                choices[index].step(chunk)
    except RequestError as exc:
        if plan is not None and exc.param == "response_format":
            exc.param = "tools"  # the schema the engine rejected was built from the tools
        raise
    return web.json_response({**head, "object": "chat.completion",
                              "choices": [c.final() for c in choices], "usage": done()},
                             headers={"Server-Timing": timing.server_timing()})


async def embeddings(request: web.Request, data: Any, model: str,
                     backend: Backend) -> web.StreamResponse:
    """``POST /v1/embeddings`` for a model of the embedded engine: always refused.

    Raises:
        RequestError: 400, ``param="model"``, ``code="model_not_supported"``: the
            embedded engine serves generative models, which cannot embed.
    """
    err = RequestError(
        f"model {model!r} does not support embeddings: the embedded engine serves "
        "generative models only. Configure an embeddings model as an upstream backend "
        "and send the request to that model.", param="model")
    err.code = "model_not_supported"
    raise err
