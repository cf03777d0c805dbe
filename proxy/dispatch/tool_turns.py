"""Tool-calling generations on the embedded engine, above the engine interface.

:func:`tool_generate` is the one path of every tool-calling turn on an embedded engine
(chat completions, the Responses API, agent steps). When the model's ``tool_format`` is
``"native"`` and the request leaves the choice to the model, the tools go to the engine
as they are (its chat template renders them, vLLM's parser reads the calls:
:mod:`flowlift.local_engine.native_tools`), and :class:`NativeTurn` checks the content
for calls written as JSON (:mod:`flowlift.proxy.wire.content_calls`).
Otherwise, and when a native answer is refused, the turn is constrained:

A :class:`~flowlift.local_engine.base.GenerationRequest` with ``tools`` (an agent step's
turn) becomes what the drop-in ``/v1/chat/completions`` path sends for an OpenAI request
with ``tools`` (:mod:`flowlift.proxy.wire.tool_calls`): the tool definitions
in the system message, the conversation's calls and results as plain text, and the
output constrained to ``{"tool_calls": [...]}`` or ``{"content": <answer>}``. The
answer is read back with the same
:class:`~flowlift.proxy.wire.tool_output.ToolOutputDecoder`: content
streams as it is decoded; each call's name and then its arguments' text as they are
generated (``call_deltas``, :mod:`flowlift.proxy.wire.call_deltas`); the calls come whole
on the last chunk (``tool_calls``), and each one also as soon as its JSON is complete
(``ready_calls``, :mod:`flowlift.proxy.wire.early_calls`).

The final answer's content keeps the request's own constraint: a JSON Schema stays its
schema, a label set becomes an ``enum``, a regex a string ``pattern``. Logprobs are not
reported for such answers (as on the drop-in path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import AsyncGenerator
from typing import Any

from flowlift.local_engine.base import (
    ChatMessage,
    Engine,
    GenerationChunk,
    GenerationRequest,
    OutputConstraint,
    ToolCall,
    Usage,
)
from flowlift.proxy.wire.call_deltas import CallScanner
from flowlift.proxy.wire.content_calls import hold_from, recognise
from flowlift.proxy.wire.early_calls import EarlyCalls
from flowlift.proxy.wire.tool_calls import (
    FunctionCall,
    FunctionDef,
    Message,
    Tool,
    ToolPlan,
    engine_messages,
)
from flowlift.proxy.wire.tool_calls import ToolCall as HistoryCall
from flowlift.proxy.wire.tool_output import ToolOutputDecoder
from flowlift.tracing import get_logger

log = get_logger("flowlift.proxy.dispatch.tool_turns")


def content_schema(constraint: OutputConstraint | None) -> dict[str, Any]:
    """The JSON Schema of a final answer's ``content`` under ``constraint``."""
    if constraint is None:
        return {"type": "string"}
    if constraint.json_schema is not None:
        return constraint.json_schema
    if constraint.choices:
        return {"enum": list(constraint.choices)}
    if constraint.regex is not None:
        return {"type": "string", "pattern": constraint.regex}
    return {"type": "string"}


def _history(m: ChatMessage) -> Message:
    calls = [HistoryCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in m.tool_calls] or None
    return Message(role=m.role, content=m.content,  # type: ignore[arg-type]
                   tool_calls=calls, tool_call_id=m.tool_call_id)


class ToolTurn:
    """One tool-calling generation on the embedded engine.

    Args:
        request: a request with ``tools``.

    Attributes:
        request: the plain request the engine gets (no tools; a JSON constraint).
    """

    def __init__(self, request: GenerationRequest) -> None:
        plan = ToolPlan(tuple(Tool(type="function", function=FunctionDef(
            name=t.name, description=t.description or None, parameters=t.parameters))
            for t in request.tools), request.tool_choice, request.parallel_tool_calls,
            content_schema(request.constraint))
        self._decoder = ToolOutputDecoder(plan)
        self._early = EarlyCalls()
        self._scanner = CallScanner()
        self.request = dataclasses.replace(
            request, tools=(), messages=engine_messages([_history(m) for m in
                                                         request.messages], plan),
            constraint=OutputConstraint(json_schema=plan.schema()),
            sampling=dataclasses.replace(request.sampling, logprobs=None))

    def read(self, chunk: GenerationChunk) -> GenerationChunk:
        """The answer's chunk for one engine chunk: decoded content as it streams, the
        calls' pieces as they are written (``call_deltas``:
        :class:`~flowlift.proxy.wire.call_deltas.CallScanner`); the last one carries the
        calls (``finish_reason="tool_calls"``, with the streamed ids and arguments'
        text) or the content's rest."""
        text = self._decoder.feed(chunk.text)
        pieces = self._scanner.feed(chunk.text) or None
        if chunk.finish_reason is None:
            return GenerationChunk(text, ready_calls=self._early.feed(chunk.text) or None,
                                   call_deltas=pieces)
        self._early.close()
        answer = self._decoder.result(chunk.finish_reason)
        calls = None if answer.tool_calls is None else self._scanner.settle([
            ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in answer.tool_calls])
        return GenerationChunk(text + answer.unsent, finish_reason=answer.finish_reason,
                               usage=chunk.usage, tool_calls=calls, call_deltas=pieces)


def native(engine: Engine, request: GenerationRequest) -> bool:
    """Whether ``request``'s tools go to ``engine`` in the model's own format: the
    engine takes them (``capabilities.native_tools``: its model's ``tool_format`` is
    ``"native"``), the request leaves the choice to the model (``tool_choice: "auto"``;
    a request that demands a call is constrained, which always makes one) and its
    answer is plain text (a JSON Schema answer keeps the constrained protocol)."""
    return (engine.capabilities.native_tools and request.tool_choice == "auto"
            and request.constraint is None)


class NativeTurn:
    """One turn in the model's own tool-call format, read by the engine
    (:mod:`flowlift.local_engine.native_tools`), with a check of the content above it:
    content that may be a call written as JSON
    (:func:`~flowlift.proxy.wire.content_calls.hold_from`) is held back until the answer
    ends, then :func:`~flowlift.proxy.wire.content_calls.recognise` takes it as the call,
    passes it on as the answer, or refuses it (:attr:`refused`: the caller runs the turn
    again constrained)."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self._text = ""
        self._sent = 0
        self._held: int | None = None
        self.refused: str | None = None
        self.usage: Usage | None = None

    def read(self, chunk: GenerationChunk) -> GenerationChunk | None:
        """The chunk to pass on for one engine chunk (None: nothing to send yet, or the
        answer was refused: see :attr:`refused`)."""
        self._text += chunk.text
        if chunk.finish_reason is None:
            return dataclasses.replace(chunk, text=self._sendable()) \
                if chunk.text or chunk.ready_calls or chunk.call_deltas else None
        self.usage = chunk.usage
        if chunk.tool_calls:
            return dataclasses.replace(chunk, text=self._text[self._sent:])
        found = recognise(self._text, self.request.tools,
                          parallel=self.request.parallel_tool_calls,
                          id_prefix=f"call_{secrets.token_hex(6)}_")
        if found.kind == "answer":
            return dataclasses.replace(chunk, text=self._text[self._sent:])
        if found.kind == "refused":
            self.refused = found.reason
            return None
        log.info("tool_call_in_content", request_id=self.request.request_id,
                 calls=len(found.calls))
        return dataclasses.replace(chunk, text=found.content[self._sent:],
                                   tool_calls=found.calls, finish_reason="tool_calls")

    def _sendable(self) -> str:
        if self._held is None:
            self._held = hold_from(self._text)
        # backticks at the end may open a fence: wait for the next piece
        end = len(self._text.rstrip("`")) if self._held is None else self._held
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent:end], end
        return out


async def tool_generate(engine: Engine, request: GenerationRequest,
                        ) -> AsyncGenerator[GenerationChunk, None]:
    """``engine``'s answer to ``request``, its ``tools`` offered the way the model takes
    them (:func:`native`: its own format, checked by :class:`NativeTurn`; else
    constrained JSON, :class:`ToolTurn`); a request without tools goes as it is (its
    earlier calls and results written as text for an engine that takes no tools). A
    native answer that was refused is generated again, constrained (the usage of both
    is reported). Closing the iterator closes the engine's stream (aborting it).

    Raises:
        FlowliftError: what the engine raises.
    """
    if not request.tools:
        if not engine.capabilities.native_tools and any(
                m.tool_calls or m.tool_call_id is not None for m in request.messages):
            # calls and results of earlier turns (an agent step's last turn, tools off)
            # as the constrained protocol writes them
            request = dataclasses.replace(request, messages=engine_messages(
                [_history(m) for m in request.messages], None))
        stream = engine.generate(request)
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                yield chunk
        return
    first: Usage | None = None
    if native(engine, request):
        turn = NativeTurn(request)
        async with contextlib.aclosing(engine.generate(request)) as chunks:
            async for chunk in chunks:
                out = turn.read(chunk)
                if out is not None:
                    yield out
        if turn.refused is None:
            return
        log.info("native_tool_answer_refused", request_id=request.request_id,
                 reason=turn.refused)
        first = turn.usage
        request = dataclasses.replace(request, request_id=f"{request.request_id}-c")
    constrained = ToolTurn(request)
    async with contextlib.aclosing(engine.generate(constrained.request)) as chunks:
        async for chunk in chunks:
            out = constrained.read(chunk)
            if out.usage is not None and first is not None:
                out = dataclasses.replace(out, usage=Usage(
                    first.prompt_tokens + out.usage.prompt_tokens,
                    first.completion_tokens + out.usage.completion_tokens,
                    first.cached_tokens + out.usage.cached_tokens))
            yield out
