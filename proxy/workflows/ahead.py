"""What to prefill ahead while a tool is out: the known start of the steps that come
next (pure: no I/O; the engine side is :mod:`flowlift.proxy.dispatch.slots.prefill_ahead`).

* A ``@tool`` step: every model step that reads its output directly is next. Its
  prompt template is known from the graph; with the outputs finished so far filled in,
  its prompt is known up to the first hole whose value is not (the tool's output, or
  another step's still running) -- :func:`known_prefix`.
* An agent step's tool calls: the next turn is the conversation so far, the turn that
  called the tools, and the results, whose first is the hole --
  :func:`next_turn_prefix`.

The hole is marked with :data:`HOLE` at the end of the known text; the engine prefills
the templated prompt up to it (:meth:`flowlift.local_engine.base.Engine.prefill`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flowlift.graph import LLMNode, MessageTemplate, Node, Ref, project, render_value
from flowlift.local_engine.base import (
    ChatMessage,
    GenerationRequest,
    OutputConstraint,
    SamplingOptions,
    ToolCall,
    ToolDef,
)

HOLE = "\ue000\ue001prefill-ahead-hole\ue001\ue000"
"""Marks where the known prompt ends (private-use characters: never in real text)."""


def _value(ref: Ref, outputs: Mapping[str, Any]) -> str | None:
    if ref.ref not in outputs:
        return None
    try:
        return render_value(project(outputs[ref.ref], ref.path))
    except (KeyError, IndexError):  # the run reports it when the step renders
        return None


def known_prefix(templates: Sequence[MessageTemplate],
                 outputs: Mapping[str, Any]) -> list[ChatMessage] | None:
    """The messages of a step as far as they are known: whole messages up to the one
    with the first hole whose value is not in ``outputs``, that one cut at the hole and
    ended with :data:`HOLE`.

    Args:
        templates: the step's message templates.
        outputs: step id -> finished output.

    Returns:
        The known messages, or ``None`` when nothing precedes the hole (a prompt that
        starts with it) or no hole is left (the step can run: nothing to do ahead).
    """
    out: list[ChatMessage] = []
    for template in templates:
        text: list[str] = []
        for part in template.content:
            if not isinstance(part, Ref):
                text.append(part.text)
                continue
            value = _value(part, outputs)
            if value is None:
                if not out and not "".join(text):
                    return None
                out.append(ChatMessage(template.role, "".join(text) + HOLE))
                return out
            text.append(value)
        out.append(ChatMessage(template.role, "".join(text)))
    return None


def consumers(readers: Iterable[Node], nodes: Mapping[str, Node],
              skip: Mapping[str, str]) -> list[LLMNode]:
    """The model steps among ``readers`` (the steps that read one output directly, in
    graph order), less those in ``skip`` (identical calls paid by another step: their
    representative, looked up in ``nodes``, is listed instead, once)."""
    found: dict[str, LLMNode] = {}
    for node in readers:
        if not isinstance(node, LLMNode):
            continue
        rep = nodes.get(skip.get(node.id, node.id), node)
        if isinstance(rep, LLMNode):
            found.setdefault(rep.id, rep)
    return list(found.values())


def next_turn_prefix(convo: Sequence[ChatMessage], text: str,
                     calls: Sequence[ToolCall]) -> list[ChatMessage]:
    """An agent step's next turn as far as it is known while its calls are out: the
    conversation, the turn that called the tools, and the first call's result as the
    hole (:data:`HOLE`)."""
    return [*convo, ChatMessage("assistant", text, tool_calls=tuple(calls)),
            ChatMessage("tool", HOLE, tool_call_id=calls[0].id)]


def ahead_request(node: LLMNode, model: str, messages: Sequence[ChatMessage],
                  request_id: str, session_id: str | None = None) -> GenerationRequest:
    """The request a prefill-ahead of ``node`` sends: its messages so far, with the
    step's tools and output constraint (an agent step's engine prompt depends on
    both)."""
    contract = node.contract
    return GenerationRequest(
        request_id=request_id, model=model, messages=tuple(messages),
        sampling=SamplingOptions(max_tokens=1),
        constraint=(OutputConstraint(json_schema=contract.json_schema,
                                     choices=contract.choices, regex=contract.regex)
                    if contract else None),
        session_id=session_id,
        tools=tuple(ToolDef(t.name, t.description, t.parameters) for t in node.tools or ()),
        tool_choice=node.tool_choice, agent_id=node.id if node.tools else None)
