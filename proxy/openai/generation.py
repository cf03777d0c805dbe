"""Running the generations of one OpenAI request on the embedded engine.

A request with ``n`` choices (or a legacy completion with several prompts) is several
engine requests. :func:`generate_streams` runs them concurrently, each in its own engine
slot (waiting in flowlift's priority queue, like every other request), and interleaves
their chunks as they come, tagged with the choice index. :func:`collect` gathers a whole
answer for the non-streaming replies. Usage of a request sums the completion tokens of
its choices and counts each distinct prompt once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from aiohttp_sse import sse_response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flowlift.errors import FlowliftError, RequestError
from flowlift.local_engine.base import (
    GenerationChunk,
    GenerationRequest,
    SamplingOptions,
    TokenLogprob,
    Usage,
)
from flowlift.proxy.dispatch.backends import Backend
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.dispatch.tool_turns import tool_generate
from flowlift.proxy.telemetry import requests as request_tracing
from flowlift.tracing import get_logger

log = get_logger("flowlift.proxy")
OnOutput = Callable[[str, "dict[str, Any] | None"], None]
Chunks = AsyncIterator[tuple[int, GenerationChunk]]
Unsupported = dict[str, tuple[Callable[[Any], bool], str]]
_DONE = object()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The request fields chat and legacy completions share (OpenAI names, ranges and
    meanings); unknown fields are accepted."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"key {key!r} is not a token id (a whole number in a "
                                 "string, in the model's tokenizer)")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias {bias} of token {key} is outside [-100, 100]")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
        """The engine's sampling options (temperature and top_p default to 1.0)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingOptions(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, stop=stop, seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, logprobs=logprobs,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()))


@dataclass(slots=True)
class Timing:
    """Wall-clock split of one request (``time.monotonic`` seconds): ``queued`` when it
    arrived, ``started`` when its first generation got an engine slot; ``traced``: the
    API request's trace, handed down from where the request was dispatched (its slot,
    chunks and waits are noted there: :func:`generate_streams`), None when untraced."""

    queued: float = field(default_factory=time.monotonic)
    started: float | None = None
    traced: request_tracing.RequestTrace | None = None

    def server_timing(self) -> str:
        """The ``Server-Timing`` header value: ``queue`` and ``engine`` durations in ms."""
        now = time.monotonic()
        started = self.started if self.started is not None else now
        return (f"queue;dur={(started - self.queued) * 1000:.1f}, "
                f"engine;dur={(now - started) * 1000:.1f}")


@dataclass(slots=True)
class Finished:
    """One whole generation: text, finish reason, usage and (when asked) logprobs."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.text += chunk.text
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage
        if chunk.logprobs is not None:
            self.logprobs = [*(self.logprobs or ()), *chunk.logprobs]


def fan_out(base: GenerationRequest, n: int) -> list[GenerationRequest]:
    """``n`` copies of ``base`` with ids ``<id>-<i>`` (the id itself when ``n == 1``) and
    seeds ``seed + i`` when a seed is set, so the choices differ but are reproducible."""
    if n == 1:
        return [base]
    seed = base.sampling.seed
    return [replace(base, request_id=f"{base.request_id}-{i}",
                    sampling=replace(base.sampling,
                                     seed=None if seed is None else seed + i))
            for i in range(n)]


async def generate_streams(backend: Backend, requests: Sequence[GenerationRequest],
                           timing: Timing | None = None,
                           priority: Priority | None = None,
                           ) -> AsyncGenerator[tuple[int, GenerationChunk], None]:
    """Run ``requests`` concurrently on ``backend`` and yield ``(index, chunk)`` pairs as
    chunks arrive (chunks of one request stay in order).

    Use it inside ``contextlib.aclosing``: closing it early cancels the generations left
    (their engine requests are aborted). A slow consumer slows every generation (the
    buffer holds a few chunks per request). ``timing.traced``, when set, notes each
    slot taken, each chunk and each wait on the engine.

    Raises:
        FlowliftError: the first failure of any generation (the others are cancelled).
    """
    priority = priority or Priority.of("interactive")
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=4 * len(requests))

    traced = timing.traced if timing is not None else None

    async def pump(index: int, request: GenerationRequest) -> None:
        try:
            async with backend.slots.slot(priority):
                if timing is not None and timing.started is None:
                    timing.started = time.monotonic()
                if traced is not None:
                    traced.slot(backend.engine, request.model, backend.name)
                stream = tool_generate(backend.engine, request)
                try:
                    async for chunk in stream:
                        _seen(backend, priority, traced, index, chunk)
                        await queue.put((index, chunk))
                finally:
                    await stream.aclose()
            await queue.put((index, _DONE))
        except Exception as exc:  # handed to the consumer, raised there
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            if traced is None:
                index, item = await queue.get()
            else:  # waiting on the engine (slot and chunks): not the proxy's overhead
                asked = time.monotonic()
                index, item = await queue.get()
                traced.waited_s += time.monotonic() - asked
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _seen(backend: Backend, priority: Priority, traced: Any, index: int,
          chunk: GenerationChunk) -> None:
    """A chunk came: into the request's trace, and a last chunk's usage into its
    session's KV footprint (working-set admission:
    :mod:`flowlift.proxy.dispatch.slots.working_set`)."""
    if traced is not None:
        traced.chunk(index, chunk)
    if chunk.usage is not None:
        backend.slots.observed(priority, chunk.usage.prompt_tokens
                               + chunk.usage.completion_tokens)


async def collect(backend: Backend, requests: Sequence[GenerationRequest],
                  timing: Timing | None = None) -> list[Finished]:
    """Every generation of ``requests``, whole, in request order.

    Raises:
        FlowliftError: the first failure of any generation.
    """
    out = [Finished() for _ in requests]
    async with contextlib.aclosing(generate_streams(backend, requests, timing)) as stream:
        async for index, chunk in stream:
            out[index].add(chunk)
    return out


@contextlib.asynccontextmanager
async def started(backend: Backend, requests: Sequence[GenerationRequest],
                  timing: Timing | None = None,
                  priority: Priority | None = None) -> AsyncIterator[Chunks]:
    """:func:`generate_streams` once its first chunk has come, so that what fails before
    any output (a prompt too long, a schema the engine rejects, the engine down) raises
    here, before a response (or a stream's headers) is sent. Leaving the block closes
    the generations. ``priority``: the slot order (default interactive; its
    ``program``, a session's, orders it by attained service).

    Raises:
        FlowliftError: a generation failed before the first chunk.
    """
    async with contextlib.aclosing(generate_streams(backend, requests, timing,
                                                    priority)) as stream:
        first = await anext(stream, None)
        yield _chain(first, stream)


async def _chain(first: tuple[int, GenerationChunk] | None, rest: Chunks) -> Chunks:
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def stream_choices(request: web.Request, head: dict[str, Any], include_usage: bool,
                         opening: list[dict[str, Any]], chunks: Chunks,
                         step: Callable[[int, GenerationChunk], list[dict[str, Any]]],
                         done: Callable[[], dict[str, Any]]) -> web.StreamResponse:
    """Send an answer as server-sent events: a chunk for each ``opening`` choice entry,
    then one for each entry ``step(index, chunk)`` returns, then (``include_usage``) a
    last chunk with ``choices: []`` and ``done()``'s usage, then ``[DONE]``. Every chunk
    is ``head`` plus one choice entry (and ``usage: null`` with ``include_usage``). A
    failure after the headers is sent in band as an ``{"error": ...}`` event, with no
    ``[DONE]``.
    """
    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> str:
        data = {**head, "choices": choices}
        if include_usage:
            data["usage"] = usage
        return json.dumps(data, ensure_ascii=False)

    async with sse_response(request, sep="\n", allow_all_methods=True) as resp:
        for entry in opening:
            await resp.send(event([entry], None))
        try:
            async for index, piece in chunks:
                for entry in step(index, piece):
                    await resp.send(event([entry], None))
        except FlowliftError as exc:  # headers are out: report in band, never a clean finish
            await resp.send(json.dumps(exc.to_openai()))
            return resp
        usage = done()
        if include_usage:
            await resp.send(event([], usage))
        await resp.send("[DONE]")
    return resp


def total_usage(usages: Sequence[Usage | None], prompts: int = 1) -> Usage:
    """Usage of a request whose ``len(usages)`` generations came from ``prompts``
    distinct prompts (each prompt's ``n`` copies share one prompt, counted once):
    completion tokens sum; prompt and cached tokens sum over one copy per prompt."""
    us = [u or Usage() for u in usages]
    per_prompt = max(1, len(us) // max(prompts, 1))
    firsts = us[::per_prompt]
    return Usage(sum(u.prompt_tokens for u in firsts),
                 sum(u.completion_tokens for u in us),
                 sum(u.cached_tokens for u in firsts))


def usage_json(u: Usage | None) -> dict[str, Any]:
    """OpenAI's ``CompletionUsage`` object."""
    u = u or Usage()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def reject_unsupported(body: Any, fields: Unsupported) -> None:
    """Raise for the first field of ``body`` its test says the engine cannot honour.

    Args:
        fields: field name -> (``value -> True`` when it cannot be honoured, the fix).

    Raises:
        RequestError: 400 with ``param`` set to the field.
    """
    extra = body.model_extra or {}
    for name, (bad, fix) in fields.items():
        value = getattr(body, name, None) if name in type(body).model_fields else extra.get(name)
        if value is not None and _cannot(bad, value):
            shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
            raise RequestError(f"{name}={shown} is not supported by the embedded engine; "
                               f"{fix}", param=name)


def _cannot(bad: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bad(value)
    except TypeError:  # a value of another type than the field takes: not honoured either
        return True


def notify(on_output: OnOutput | None, text: str, usage: dict[str, Any] | None) -> None:
    """Call ``on_output(text, usage)`` once; its failure is logged, never the client's."""
    if on_output is None:
        return
    try:
        on_output(text, usage)
    except Exception:
        log.exception("on_output_failed")
