"""Where a Responses turn's chat completion comes from: the embedded engine (the chat
completions generation path, :func:`flowlift.proxy.openai.chat_completion.serving.prepare`)
or an upstream's ``/chat/completions`` stream. Both give ``chat.completion.chunk``
objects (the last one with ``usage``) to :class:`~.events.ResponseBuilder`.

Each source is an async context manager that has its first output (or its failure) when
it enters, so a prompt too long, a schema the engine rejects or every upstream down is
an HTTP error even for a streamed turn, before any event is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from flowlift.errors import EngineError, RequestError
from flowlift.proxy.dispatch.backends import Backend
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.dispatch.upstream.attempts import Opened
from flowlift.proxy.dispatch.upstream.http import TRANSPORT_ERRORS, translate
from flowlift.proxy.http import parse_model
from flowlift.proxy.openai.chat_completion.serving import (
    ChatChoice,
    ChatCompletionRequest,
    prepare,
)
from flowlift.proxy.openai.generation import Chunks, Timing, started, usage_json

ChatChunks = AsyncIterator[dict[str, Any]]


_NAMES = (("response_format.json_schema.schema", "text.format.schema"),
          ("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
          ("messages", "input"))
"""Chat fields and the Responses fields they came from."""


def _in_responses_terms(exc: RequestError) -> None:
    """Name the fields of ``exc`` (message and ``param``) as the Responses request does."""
    for chat, ours in _NAMES:
        exc.message = exc.message.replace(chat, ours)
        if exc.param is not None and exc.param.startswith(chat):
            exc.param = ours + exc.param[len(chat):]
    exc.args = (exc.message,)


@contextlib.asynccontextmanager
async def embedded(chat: dict[str, Any], model: str, backend: Backend, session: str | None,
                   timing: Timing, program: str | None = None,
                   stream: bool = True) -> AsyncIterator[ChatChunks]:
    """The chat chunks of ``chat`` (a chat completions body) on the embedded ``backend``;
    ``session`` is the engine's session id (the conversation: prefix-cache locality);
    ``program`` the program its slot is scheduled in
    (:mod:`flowlift.proxy.dispatch.slots.programs`); ``stream``: the turn is streamed to
    its client (its calls' arguments come in pieces as they are generated; otherwise
    each call whole at the end).

    Raises:
        RequestError: a bad or unsupported field (``param`` in the Responses names).
        EngineError: the engine failed before the first token.
    """
    plan = None
    try:
        body = parse_model(ChatCompletionRequest, chat, "responses request")
        gen, choices, plan = prepare(body, f"resp-{secrets.token_hex(12)}", model, backend,
                                     session, stream)
        async with started(backend, [gen], timing,
                           Priority.of("interactive", program=program)) as chunks:
            yield _chat_chunks(chunks, choices[0])
    except RequestError as exc:
        if plan is not None and exc.param == "response_format":
            exc.param = "tools"  # the schema the engine rejected was built from the tools
        _in_responses_terms(exc)
        raise


async def _chat_chunks(chunks: Chunks, choice: ChatChoice) -> ChatChunks:
    async for _, chunk in chunks:
        entries = choice.step(chunk)
        if entries:
            yield {"choices": entries, "usage": None}
    yield {"choices": [], "usage": usage_json(choice.usage)}


async def upstream(opened: Opened, release: Callable[[], Awaitable[None]] | None = None
                   ) -> ChatChunks:
    """The chat chunks of an upstream stream opened with ``stream="events"``, each event
    within the upstream's idle timeout; the answer is released (``release``, default
    ``opened.release``) on every exit.

    Raises:
        EngineError: the stream stalled, failed or ended before its finish reason.
    """
    idle_s, finished, name = opened.upstream.spec.idle_timeout_s, False, opened.upstream.name
    try:
        event = opened.first
        while event is not None and event.data != "[DONE]":
            try:
                doc = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                doc = None
            if isinstance(doc, dict):
                if isinstance(doc.get("error"), dict):
                    raise EngineError(f"backend {name!r}: "
                                      f"{doc['error'].get('message') or 'stream error'}")
                finished = finished or any(
                    isinstance(c, dict) and c.get("finish_reason")
                    for c in doc.get("choices") or ())
                yield doc
            async with asyncio.timeout(idle_s):
                event = await anext(opened.events, None)  # type: ignore[arg-type]
    except TRANSPORT_ERRORS as exc:
        opened.call.failed("request")
        raise EngineError(str(translate(exc, name, stage="mid-stream"))) from None
    finally:
        await (release or opened.release)()
    if not finished:
        opened.call.failed("request")
        raise EngineError(f"backend {name!r} ended the stream before it finished")
    opened.succeeded()
