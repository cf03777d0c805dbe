"""Tool-calling generations on the embedded engine, above the engine interface.

A :class:`~flowlift.local_engine.base.GenerationRequest` with ``tools`` (an agent step's
turn) becomes what the drop-in ``/v1/chat/completions`` path sends for an OpenAI request
with ``tools`` (:mod:`flowlift.proxy.wire.tool_calls`): the tool definitions
in the system message, the conversation's calls and results as plain text, and the
output constrained to ``{"tool_calls": [...]}`` or ``{"content": <answer>}``. The
answer is read back with the same
:class:`~flowlift.proxy.wire.tool_output.ToolOutputDecoder`: content
streams as it is decoded; the calls come whole on the last chunk (``tool_calls``), and
each one also as soon as its JSON is complete (``ready_calls``,
:mod:`flowlift.proxy.wire.early_calls`).

The final answer's content keeps the request's own constraint: a JSON Schema stays its
schema, a label set becomes an ``enum``, a regex a string ``pattern``. Logprobs are not
reported for such answers (as on the drop-in path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flowlift.local_engine.base import (
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    OutputConstraint,
    ToolCall,
)
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
            for t in request.tools), request.tool_choice, True,
            content_schema(request.constraint))
        self._decoder = ToolOutputDecoder(plan)
        self._early = EarlyCalls()
        self.request = dataclasses.replace(
            request, tools=(), messages=engine_messages([_history(m) for m in
                                                         request.messages], plan),
            constraint=OutputConstraint(json_schema=plan.schema()),
            sampling=dataclasses.replace(request.sampling, logprobs=None))

    def read(self, chunk: GenerationChunk) -> GenerationChunk:
        """The answer's chunk for one engine chunk: decoded content as it streams; the
        last one carries the calls (``finish_reason="tool_calls"``) or the content's
        rest."""
        text = self._decoder.feed(chunk.text)
        if chunk.finish_reason is None:
            return GenerationChunk(text, ready_calls=self._early.feed(chunk.text) or None)
        self._early.close()
        answer = self._decoder.result(chunk.finish_reason)
        calls = None if answer.tool_calls is None else tuple(
            ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in answer.tool_calls)
        return GenerationChunk(text + answer.unsent, finish_reason=answer.finish_reason,
                               usage=chunk.usage, tool_calls=calls)
