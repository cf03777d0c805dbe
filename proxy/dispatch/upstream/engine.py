"""An :class:`~flowlift.local_engine.base.Engine` over the upstream providers of a route,
so workflow steps on upstream models run through the same scheduler, deadline and trace
as steps on the embedded engine.

Each generation is one streamed ``/chat/completions`` request (:func:`open_chat`) with
the same retries, fallbacks and replica affinity as drop-in traffic; the workflow's run
id is the affinity key, so every step of one run lands on one replica while it is
healthy (its prefix cache stays warm there), and all of them share the upstream's
pooled connections. Where a route also has the embedded engine, the choice between them
is the :class:`~flowlift.proxy.dispatch.steps.StepDispatcher`'s, above this engine: it
opens the answer with :func:`open_chat` and reads it with :meth:`UpstreamEngine.read`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from flowlift.errors import ContentRefused, EngineError, RequestError, UpstreamError
from flowlift.local_engine.base import (
    Capabilities,
    ChatMessage,
    Engine,
    GenerationChunk,
    GenerationRequest,
    ToolCall,
    Usage,
)
from flowlift.proxy.dispatch.batch.flex import tier_fields
from flowlift.proxy.dispatch.routing.fleet_hints import program_of
from flowlift.proxy.dispatch.routing.hints import StepHints, hint_fields, hint_headers
from flowlift.proxy.dispatch.routing.latency import CacheReport, Demand
from flowlift.proxy.dispatch.routing.routing import Route
from flowlift.proxy.dispatch.slots.scheduler import Slot
from flowlift.proxy.dispatch.upstream.attempts import Admit, Opened, open_answer
from flowlift.proxy.dispatch.upstream.http import TRANSPORT_ERRORS, translate
from flowlift.proxy.dispatch.upstream.kv_metrics import KvCache
from flowlift.proxy.dispatch.upstream.provider import Upstream, unretryable
from flowlift.proxy.wire import chunks
from flowlift.tracing.spans import inject

if TYPE_CHECKING:
    from flowlift.proxy.dispatch.backends import Backends, Local


def _message(m: ChatMessage) -> dict[str, Any]:
    """One OpenAI chat message (an assistant's ``tool_calls``, a tool result's id)."""
    if m.tool_calls:
        return {"role": m.role, "content": m.content or None, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]}
    if m.tool_call_id is not None:
        return {"role": m.role, "tool_call_id": m.tool_call_id, "content": m.content}
    return {"role": m.role, "content": m.content}


def chat_body(request: GenerationRequest, model: str) -> dict[str, Any]:
    """The OpenAI chat request for ``request`` (streamed, with usage; its ``tools`` as
    OpenAI function tools)."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": model, "stream": True, "stream_options": {"include_usage": True},
        "messages": [_message(m) for m in request.messages],
        "temperature": s.temperature, "top_p": s.top_p}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in request.tools]
        if request.tool_choice != "auto":
            body["tool_choice"] = request.tool_choice
    if s.max_tokens is not None:
        body["max_tokens"] = s.max_tokens
    for key, value in (("stop", list(s.stop)), ("seed", s.seed),
                       ("presence_penalty", s.presence_penalty),
                       ("frequency_penalty", s.frequency_penalty)):
        if value:
            body[key] = value
    if s.logprobs is not None:  # a cascade's confidence floor needs them
        body["logprobs"] = True
        if s.logprobs:
            body["top_logprobs"] = s.logprobs
    constraint = request.constraint
    if constraint is not None and constraint.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": constraint.json_schema, "strict": False}}
    elif constraint is not None and constraint.choices:
        labels = ", ".join(constraint.choices)
        body["messages"] = [{"role": "system", "content": "Answer with exactly one of: "
                             f"{labels}. Nothing else."}, *body["messages"]]
    elif constraint is not None and constraint.regex is not None:
        body["messages"] = [{"role": "system", "content": "Answer with text that matches "
                             f"the regular expression {constraint.regex} as a whole. "
                             "Nothing else."}, *body["messages"]]
    if request.prompt is not None:
        raise RequestError("raw prompts go to /v1/completions; upstream workflow steps use "
                           "chat messages", param="prompt")
    return body


def _read_event(data: str, backend: str
                ) -> tuple[chunks.ChunkChoice | None, Usage | None, str | None,
                           CacheReport | None]:
    """(choice 0, usage, service tier, the cache report in the usage) of one
    chat.completion.chunk (read by :func:`flowlift.proxy.wire.chunks.parse_event`).

    Raises:
        EngineError: an in-band error event, or an event that is not a JSON object.
    """
    chunk = chunks.parse_event(data)
    if chunk is None:
        raise EngineError(f"backend {backend!r} sent a stream event that is not JSON")
    if chunk.error is not None:
        raise EngineError(f"backend {backend!r}: {chunk.error or 'an error without a message'}")
    usage = chunk.usage_json
    return (chunk.choice(0), chunk.usage, chunk.service_tier,
            None if usage is None else CacheReport.of(dict(usage)))


def idempotency_key(request: GenerationRequest) -> str | None:
    """``run:step:attempt`` of a workflow step's generation (case N11), or None for a
    request that is no step of a run.

    A step's request id is ``<run>:<step>:<n>`` for its attempt ``n`` (its
    ``session_id`` is the run id; the attempt number is always there, so a step id that
    holds a colon cannot make two attempts' ids meet), so the key is the same for the
    same attempt whenever it is sent -- after a kill -9 and resume too -- and a provider
    that honours ``Idempotency-Key`` bills it once. Characters a header cannot carry are
    percent-encoded.
    """
    run = request.session_id
    if not run or not request.request_id.startswith(run + ":"):
        return None
    _, sep, number = request.request_id.rpartition(":")
    if not sep or not number.isdigit():
        return None
    return urllib.parse.quote(request.request_id, safe=":-._~!$&'()*+,;=@/")


def demand_of(request: GenerationRequest) -> Demand:
    """What the replica choice knows of a step's generation: its prompt length (4
    characters a token: the upstream's tokenizer is not here), ``max_tokens``, its run
    or session id."""
    chars = sum(len(m.content or "") for m in request.messages)
    return Demand(chars // 4, request.sampling.max_tokens, request.session_id)


async def open_chat(backends: Backends, route: Route, request: GenerationRequest, *,
                    admit: Admit | None = None) -> Opened | Local:
    """Open ``request`` as a streamed chat completion on ``route`` (affinity: its
    ``session_id``; ``Idempotency-Key``: :func:`idempotency_key`), or return the
    embedded backend the route chose instead.

    Raises:
        ContextLengthExceeded, ContentRefused: an upstream's answer no retry can change.
        EngineError: every attempt failed.
        Overloaded: nothing can take the request now.
    """
    body = chat_body(request, route.model)
    headers: dict[str, str] = {}
    key = idempotency_key(request)
    if key is not None:
        headers["idempotency-key"] = key
    inject(headers)  # the workflow run's span: the upstream request joins its trace
    if request.session_id is not None:  # SGLang sessions of the opted-in replicas
        await backends.sessions.open((backends.upstreams[n] for n in route.backends
                                      if n in backends.upstreams), request.session_id)
    granted: list[Slot] = []  # the slot an attempt was granted: its priority may have
    #                           been promoted while it waited (runs.Run.mark_awaited)

    async def admitted() -> Slot:
        assert admit is not None
        slot = await admit()
        granted.append(slot)
        return slot

    steps: list[int] = []  # this request's ordinal in its program, counted once

    def step_hints() -> StepHints:
        slot = granted[-1].priority if granted and not backends.fcfs else None
        program = program_of(request.session_id, request.agent_id)
        if not steps and program is not None:
            steps.append(backends.steps.next(program))
        return StepHints.of(request, None if slot is None else slot.engine_priority()
                            ).routed(slot, step=steps[0] if steps else None,
                                     kv_retention_ttl_s=backends.keep_ttl_s)

    def hints(up: Upstream) -> dict[str, Any]:
        if not up.spec.hints:  # the common case: nothing to compute
            return {}
        return hint_fields(up.spec, step_hints(), body,
                           session_open=backends.sessions.is_open(up.name,
                                                                  request.session_id))

    def body_for(up: Upstream) -> bytes:
        return orjson.dumps({
            **body, "model": up.upstream_model(route.model),
            **tier_fields(up.spec, body, deferred=request.service_tier == "flex"),
            **hints(up)})
    try:
        return await open_answer(
            backends, route, path="/chat/completions", body_for=body_for,
            headers=headers, stream="events", affinity=request.session_id,
            admit=None if admit is None else admitted, demand=demand_of(request),
            headers_for=lambda up: hint_headers(up.spec, step_hints()) if up.spec.hints
            else {})
    except UpstreamError as exc:
        raise unretryable(exc, route.model) or EngineError(
            f"model {route.model!r}: {exc.message}") from None


class UpstreamEngine(Engine):
    """Serves ``route.model`` from the route's upstream backends (its embedded ones, if
    any, are left to the dispatcher above the engines).

    Constrained outputs are asked for with ``response_format: json_schema``; a label set
    or a regex becomes an instruction (upstreams have no portable choice or regex
    constraint), so the proxy's contract check is what enforces it (case W3).
    """

    capabilities = Capabilities(structured_outputs=True, abort=True)

    def __init__(self, backends: Backends, route: Route) -> None:
        self.backends = backends
        self.route = route
        self._upstream = dataclasses.replace(
            route, replicas=tuple(n for n in route.replicas if n in backends.upstreams),
            fallbacks=tuple(n for n in route.fallbacks if n in backends.upstreams))
        self._open: dict[str, Opened] = {}  # request id -> its upstream stream
        self._aborted: set[str] = set()

    @property
    def model_names(self) -> Sequence[str]:
        return (self.route.model,)

    async def generate(self, request: GenerationRequest
                       ) -> AsyncGenerator[GenerationChunk, None]:
        opened = await open_chat(self.backends, self._upstream, request)
        if not isinstance(opened, Opened):  # never: this route lists upstreams only
            raise AssertionError(f"route {self.route.model!r} chose {opened!r}")
        async for chunk in self.read(opened, request.request_id):
            yield chunk

    async def read(self, opened: Opened, request_id: str,
                   ) -> AsyncGenerator[GenerationChunk, None]:
        """The chunks of an answer :func:`open_chat` opened (tracked under
        ``request_id`` for :meth:`abort`); the answer is released on every exit.

        Raises:
            EngineError: the stream failed or ended before its finish reason.
            ContentRefused: the provider's content filter cut the answer.
        """
        rid = request_id
        self._open[rid] = opened
        finish: str | None = None
        failure: str | None = None
        usage = Usage()
        calls: tuple[ToolCall, ...] | None = None
        tier: str | None = None
        pieces = 0  # text chunks: the output's length when the upstream reports no usage
        try:
            async for chunk in self._read(opened):
                if isinstance(chunk, GenerationChunk):
                    pieces += 1
                    yield chunk
                else:
                    finish, usage, calls, tier = chunk
        except TRANSPORT_ERRORS as exc:
            failure = str(translate(exc, opened.upstream.name, stage="mid-stream"))
        finally:
            self._open.pop(rid, None)
            await opened.release()
        if rid in self._aborted:
            self._aborted.discard(rid)
            yield GenerationChunk("", finish_reason="abort", usage=usage)
            return
        if failure is None and finish is None:
            failure = f"backend {opened.upstream.name!r} ended the stream before it finished"
        if failure is not None:
            opened.call.failed("request")  # mid-stream: about this request only
            raise EngineError(failure)
        opened.succeeded(usage.completion_tokens or pieces or None)
        if finish == "content_filter":
            raise ContentRefused(f"model {self.route.model!r}: the answer was cut by the "
                                 "provider's content filter")
        yield GenerationChunk("", finish_reason=finish, usage=usage, tool_calls=calls,
                              service_tier=tier)

    @staticmethod
    async def _read(opened: Opened) -> AsyncIterator[
            GenerationChunk
            | tuple[str | None, Usage, tuple[ToolCall, ...] | None, str | None]]:
        """Text chunks as they arrive, then ``(finish_reason, usage, tool calls, served
        service tier)``; the
        stream is read to its end so the connection goes back to the pool."""
        finish: str | None = None
        usage = Usage()
        calls = chunks.ToolCallPieces()
        tier: str | None = None
        idle_s = opened.upstream.spec.idle_timeout_s
        event = opened.first
        while event is not None and event.data != "[DONE]":
            choice, usage_now, tier_now, cache = _read_event(event.data,
                                                             opened.upstream.name)
            usage = usage_now or usage
            opened.cache = cache or opened.cache
            tier = tier_now or tier
            if choice is not None:
                finish = choice.finish_reason or finish
                calls.add(choice.tool_calls)
                if choice.text or choice.logprobs or choice.tool_calls:  # calls: no text
                    yield GenerationChunk(choice.text, logprobs=choice.logprobs or None,
                                          ready_calls=calls.ready() or None)
            async with asyncio.timeout(idle_s):  # not around the yield: the consumer's
                event = await anext(opened.events, None)  # type: ignore[arg-type]
        if event is not None:
            async with asyncio.timeout(idle_s):
                async for _ in opened.events:  # type: ignore[union-attr]
                    pass
        yield finish, usage, calls.calls(), tier

    def running(self) -> int:
        return len(self._open)

    def _kv_caches(self) -> list[KvCache] | None:
        """The KV caches of the route's replicas from their ``/metrics``
        (``kv_metrics: true``); None unless every replica's is known."""
        caches = []
        for name in self._upstream.replicas:
            kv = self.backends.upstreams[name].kv
            cache = None if kv is None else kv.current()
            if cache is None:
                return None
            caches.append(cache)
        return caches or None

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the replicas' KV caches hold together (their ``/metrics``): sessions
        stick to a replica, so the route's working set is fitted into the sum."""
        caches = self._kv_caches()
        return None if caches is None else sum(c.tokens for c in caches)

    def kv_block_tokens(self) -> int | None:
        """The replicas' KV block size (the largest, if they differ)."""
        caches = self._kv_caches()
        return None if caches is None else max(c.block_tokens for c in caches)

    async def abort(self, request_id: str) -> None:
        """Close the request's upstream stream; its generation ends with ``"abort"``.
        Unknown or finished ids are ignored."""
        opened = self._open.get(request_id)
        if opened is not None:
            self._aborted.add(request_id)
            await opened.answer.aclose()

