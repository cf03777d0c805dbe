"""One Responses turn's generations: opening each on the route's backend, ``truncation``,
and the hosted-MCP loop.

:class:`Opener` opens one chat completion of the turn on the backend the route picks
(the embedded engine through the chat completions generation path, or an upstream's
``/chat/completions`` stream: :mod:`.sources`) and returns it already started, so a
prompt too long or every backend down is an error before any event is sent.

:func:`open_first` opens the turn's first generation. With ``truncation: "auto"`` a
conversation too long for the model's context (``context_length_exceeded``, from the
engine or an upstream) loses its oldest unit (:func:`~.pairing.drop_oldest`: a call and
its output go together) and is tried again, until it fits or only the turn's own input
is left; with ``"disabled"`` (the default, as OpenAI's) the error is the answer: a 400
before any event.

:class:`Loop` runs the generations: when one ends calling hosted MCP tools (and no
client function), the proxy runs those calls (concurrently), adds the calls and their
results to the conversation and asks again, until the model answers, calls a client
function, is cut short, or has made ``max_tool_calls`` hosted calls (or
:data:`MAX_ROUNDS` generations): then one last generation with ``tool_choice: "none"``
asks it for the answer. A generation after hosted results is held back from the
client while it may still be no answer (:func:`~flowlift.proxy.wire.content_calls.
undecided`: empty so far, or starting with markup or JSON); one that ends so
(:func:`~flowlift.proxy.wire.content_calls.no_answer`: empty, an echoed
``<tool_response>``, a piece of JSON) is never sent: the generation is asked again once
with the reason, as an agent step does, and a second such answer fails the response
(:class:`~flowlift.errors.NoAnswer`; streamed: ``response.failed``). Source of the
loop's shape: OpenAI's Remote MCP guide (the response holds ``mcp_list_tools``, each
``mcp_call`` with its output, then the answer).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from flowlift.errors import ContextLengthExceeded, NoAnswer, UpstreamError
from flowlift.proxy.dispatch.backends import Backend, Local
from flowlift.proxy.dispatch.routing.routing import Route
from flowlift.proxy.dispatch.upstream.attempts import open_answer
from flowlift.proxy.dispatch.upstream.forward import demand_of
from flowlift.proxy.dispatch.upstream.provider import forwarded_headers
from flowlift.proxy.openai.generation import Timing
from flowlift.proxy.openai.responses import sources
from flowlift.proxy.openai.responses.events import NOT_RUN, Event, ResponseBuilder
from flowlift.proxy.openai.responses.hosted import Hosted
from flowlift.proxy.openai.responses.pairing import drop_oldest
from flowlift.proxy.openai.responses.translation import assistant_message
from flowlift.proxy.state import STATE
from flowlift.proxy.wire.content_calls import no_answer, retry_message, undecided

MAX_ROUNDS = 16
"""Generations of one turn at most (hosted-MCP loop); the last one may not call tools."""
Message = dict[str, Any]


@dataclass
class Generation:
    """One started chat completion: its chunks, the backend that runs it, and what
    closes it (``close``: release the upstream answer or the engine slot)."""

    chunks: sources.ChatChunks
    backend: str
    local: bool
    close: contextlib.AsyncExitStack


class Opener:
    """Opens the generations of one turn (see the module doc).

    Args:
        request: the HTTP request (its headers go upstream).
        route: the model's route.
        conversation: the affinity key and the engine's session id.
        timing: the embedded engine's stage times (``Server-Timing``).
        program: the program the embedded engine schedules the turn's generations in
            (:mod:`flowlift.proxy.dispatch.slots.programs`; None: the request's own).
        stream: the turn is streamed to its client (the embedded engine's calls then
            come in pieces as they are generated).
    """

    def __init__(self, request: web.Request, route: Route, conversation: str,
                 timing: Timing, program: str | None = None, stream: bool = True) -> None:
        self.request, self.route = request, route
        self.conversation, self.timing = conversation, timing
        self.program, self.stream = program, stream
        self.engine: Backend | None = None  # the last generation's, when embedded

    async def open(self, chat: dict[str, Any]) -> Generation:
        """Start ``chat`` (a chat completions body, streamed).

        Raises:
            RequestError: a bad field (``param`` in the Responses names), a prompt too
                long (``ContextLengthExceeded``).
            UpstreamError: every upstream attempt failed.
            EngineError: the engine failed before the first token.
        """
        state, route = self.request.app[STATE], self.route
        raw = orjson.dumps(chat)
        opened = await open_answer(
            state.backends, route, path="/chat/completions",
            headers=forwarded_headers(self.request.headers), stream="events",
            body_for=lambda up: orjson.dumps(_upstream_body(
                chat, up.spec.stream_usage, up.upstream_model(route.model))),
            affinity=self.conversation, demand=demand_of(raw, chat, self.conversation))
        stack = contextlib.AsyncExitStack()
        self.engine = opened.backend if isinstance(opened, Local) else None
        if not isinstance(opened, Local):
            traced = self.timing.traced
            if traced is not None:
                traced.upstream(opened.upstream.name)
            release = _once(opened.release)
            chunks = sources.upstream(opened, release)
            stack.push_async_callback(release)  # (a generation never read: still released)
            stack.push_async_callback(chunks.aclose)  # type: ignore[attr-defined]
            return Generation(chunks, opened.upstream.name, False, stack)
        backend = opened.backend
        backend.admitted += 1  # as forward does: no burst slips through
        stack.callback(_unadmit, backend)
        try:
            chunks = await stack.enter_async_context(sources.embedded(
                chat, opened.model, backend, self.conversation, self.timing, self.program,
                self.stream))
        except BaseException:
            await stack.aclose()
            raise
        return Generation(chunks, backend.name, True, stack)

    def keep(self, response: dict[str, Any]) -> None:
        """Set the program's keep mark on the embedded engine when the turn's
        ``response`` (the Responses object) ended calling the client's functions: the
        next turn is known to come, its KV is worth keeping while they are out."""
        if self.engine is None or self.program is None:
            return
        if any(item.get("type") == "function_call" for item in response.get("output", ())):
            self.engine.slots.programs.keep(self.program)


def _once(release: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """``release``, run on the first call only."""
    done = False

    async def once() -> None:
        nonlocal done
        if not done:
            done = True
            await release()
    return once


def _unadmit(backend: Backend) -> None:
    backend.admitted -= 1


def _upstream_body(chat: dict[str, Any], stream_usage: bool, model: str) -> dict[str, Any]:
    body = {**chat, "model": model}
    if not stream_usage:
        body.pop("stream_options", None)
    return body


def too_long(exc: Exception) -> bool:
    """Whether ``exc`` says the prompt does not fit the model's context."""
    if isinstance(exc, ContextLengthExceeded):
        return True
    return (isinstance(exc, UpstreamError) and exc.status == 400
            and b"context_length_exceeded" in (exc.body or b""))


async def open_first(opener: Opener, build: Callable[[list[Message]], dict[str, Any]],
                     messages: list[Message], truncation: str | None
                     ) -> tuple[Generation, list[Message], dict[str, Any]]:
    """The turn's first generation, ``messages`` (the conversation and the turn's input)
    truncated as ``truncation`` says; returns it, the messages kept and the chat body.

    Raises:
        ContextLengthExceeded, UpstreamError: too long even when truncated, or with
            ``truncation`` ``"disabled"``; as :meth:`Opener.open` otherwise.
    """
    while True:
        chat = build(messages)
        try:
            return await opener.open(chat), messages, chat
        except (ContextLengthExceeded, UpstreamError) as exc:
            fewer = drop_oldest(messages) if truncation == "auto" and too_long(exc) else None
            if fewer is None:
                raise
            messages = fewer


@dataclass
class Loop:
    """The generations of one turn (see the module doc).

    Attributes:
        produced: the chat messages the turn added to the conversation (each
            generation's assistant message, the hosted calls' tool messages).
        backend: the backend of the last generation.
    """

    builder: ResponseBuilder
    opener: Opener
    hosted: Hosted
    max_tool_calls: int | None
    produced: list[Message] = field(default_factory=list)
    backend: str | None = None
    _held: list[Event] | None = field(default=None, init=False, repr=False)

    async def run(self, first: Generation, chat: dict[str, Any]) -> AsyncIterator[Event]:
        """The events of every generation and hosted call, in order (not the terminal
        one: :meth:`ResponseBuilder.finish_events`).

        Raises:
            NoAnswer: the answer after hosted results was no answer twice.
        """
        builder, generation, calls, rounds = self.builder, first, 0, 1
        retried = False  # a no-answer after hosted results gets one more try, with the reason
        while True:
            mark = builder.mark()
            self._held = [] if rounds > 1 else None  # judged before it is sent
            async for event in self._generate(generation):
                yield event
            held, self.backend = self._held, generation.backend
            why = self._no_answer() if held is not None else None
            if why is not None:
                if retried:
                    builder.rewind(mark)  # (never sent: not in the failed response)
                    raise NoAnswer(f"no answer after the hosted MCP calls: {why}, twice "
                                   "(the second time after being told why)")
                retried, chat = True, self._retry(chat, mark, why)
                generation = await self.opener.open(chat)
                continue
            items = builder.current_items()
            for event in [*(held or ()), *builder.end_generation()]:
                yield event
            pending = list(builder.pending)
            message = assistant_message(items)
            self.produced.append(message)
            if not pending or builder.finish not in (None, "stop", "tool_calls"):
                self.produced += [{"role": "tool", "tool_call_id": i["call_id"],  # cut off:
                                   "content": f"error: {NOT_RUN}"} for i in pending]
                return
            async for event in self._run_hosted(pending):
                yield event
            if any(i["type"] == "function_call" for i in items):
                return  # the client runs its functions; the next turn goes on
            calls, rounds = calls + len(pending), rounds + 1
            last = rounds >= MAX_ROUNDS or (self.max_tool_calls is not None
                                            and calls >= self.max_tool_calls)
            chat = {**chat, "messages": [*chat["messages"], message,
                                         *self.produced[-len(pending):]]}
            if last:
                chat["tool_choice"] = "none"
            builder.finish = None
            generation = await self.opener.open(chat)

    async def _generate(self, generation: Generation) -> AsyncIterator[Event]:
        """``generation``'s events as they come; while :attr:`_held` is a list and the
        generation may still be no answer (:meth:`_undecided`), they go there instead."""
        async with generation.close:
            async for chunk in generation.chunks:
                events = self.builder.feed(chunk)
                if self._held is not None:
                    self._held += events
                    if self._undecided():
                        continue
                    events, self._held = self._held, None
                for event in events:
                    yield event

    async def _run_hosted(self, pending: list[dict[str, Any]]) -> AsyncIterator[Event]:
        """Run the ``pending`` hosted calls concurrently: their events, their results
        added to :attr:`produced` as tool messages."""
        builder = self.builder
        for event in builder.mcp_started():
            yield event
        results = await asyncio.gather(*(self.hosted.call(i["name"], i["arguments"])
                                         for i in pending))
        for item, (output, error) in zip(pending, results, strict=True):
            for event in builder.mcp_finished(item, output, error):
                yield event
            self.produced.append({"role": "tool", "tool_call_id": item["call_id"],
                                  "content": output if error is None else
                                  f"error: {error.get('content', error.get('message'))}"})

    def _undecided(self) -> bool:
        """Whether the generation so far (no calls, text) may still be no answer."""
        items = self.builder.current_items()
        return all(item["type"] == "message" for item in items) and undecided(
            assistant_message(items)["content"] or "")

    def _no_answer(self) -> str | None:
        """Why the generation that ended, held back whole, is no answer (None: it is
        one, or it was cut short and ends the response as such)."""
        if self.builder.finish not in (None, "stop"):
            return None
        return no_answer(assistant_message(self.builder.current_items())["content"] or "",
                         after_tools=True)

    def _retry(self, chat: dict[str, Any], mark: tuple[int, int], why: str
               ) -> dict[str, Any]:
        """Forget the held generation (its events never sent) and ask again with the
        reason, as an agent step does (:func:`~flowlift.proxy.wire.content_calls.
        retry_message`); the request's span records it (``flowlift.no_answer``)."""
        text = assistant_message(self.builder.current_items())["content"] or ""
        self.builder.rewind(mark)
        traced = self.opener.timing.traced
        if traced is not None and traced.recording:
            traced.span.add_event("flowlift.no_answer", {"reason": why, "retried": True})
        final = chat.get("tool_choice") == "none"
        return {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": text},
                                     {"role": "user", "content": retry_message(why, final)}]}
