"""Reading what an OpenAI-compatible upstream answers: one ``chat.completion.chunk`` or
``text_completion`` stream event, or one whole (non-streamed) answer, as a
:class:`Chunk`.

Pure: no I/O, and nothing here raises on an odd shape -- a field that is missing or of
the wrong type reads as absent (a choice that is not an object, or whose ``index`` is not
a whole number, is left out). What the fields mean is OpenAI's:

* each choice's text is ``delta.content`` (a chat stream), ``message.content`` (a whole
  chat answer) or ``text`` (completions), whichever is a string; a missing ``index``
  is 0;
* ``usage`` comes in the last event of a stream asked with ``include_usage`` (with
  ``choices: []``), or in a whole answer;
* an in-band ``error`` (an event an upstream sends instead of a chunk) is kept as its
  message;
* tool calls stream as pieces of ``delta.tool_calls`` (the first piece of a call has its
  ``index``, ``id`` and ``function.name``, the next ones more of ``function.arguments``):
  :class:`ToolCallPieces` joins them by ``index``.
* the Responses API (``/v1/responses``): a whole ``response`` object, or a stream event
  (``response.completed``, ``response.incomplete``, ``response.failed``...) holding one
  under ``response``, gives its ``usage`` (``input_tokens``, ``output_tokens``,
  ``input_tokens_details.cached_tokens``) and its ``status``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

from flowlift.local_engine.base import TokenLogprob, ToolCall, Usage


@dataclass(frozen=True, slots=True)
class ChunkChoice:
    """One entry of ``choices``.

    Attributes:
        index: the choice's ``index`` (0 when missing).
        text: its new text ("" when none).
        finish_reason: why it ended (``"stop"``, ``"length"``...), or None.
        logprobs: ``logprobs.content`` as :class:`TokenLogprob` entries (natural logs).
        message: a whole chat answer's ``message`` object as sent (tool calls
            included), or None.
        tool_calls: the entries of a stream event's ``delta.tool_calls`` that are
            objects, as sent (a whole answer's are in ``message``).
    """

    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    message: Mapping[str, Any] | None = None
    tool_calls: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one event (or whole answer) holds.

    Attributes:
        choices: its choices, in the order sent.
        model: the ``model`` it names, or None.
        usage: its token counts (missing counts are 0), or None when it has no usage.
        usage_json: the ``usage`` object as sent (for records that keep it whole), or None.
        error: the message of an in-band ``error`` ("" when it has none), or None when the
            event is no error.
        status: a Responses API response's ``status`` (``"completed"``,
            ``"incomplete"``, ``"failed"``, ``"in_progress"``...; ``"failed"`` for an
            ``error`` event), or None for anything else.
        service_tier: the ``service_tier`` the provider says served it, or None.
    """

    choices: tuple[ChunkChoice, ...] = ()
    model: str | None = None
    usage: Usage | None = None
    usage_json: Mapping[str, Any] | None = None
    error: str | None = None
    status: str | None = None
    service_tier: str | None = None

    def choice(self, index: int = 0) -> ChunkChoice | None:
        """The (first) choice with this ``index``, or None."""
        return next((c for c in self.choices if c.index == index), None)


def _is_map(value: object) -> TypeGuard[Mapping[str, Any]]:
    """``isinstance(value, Mapping)``, the ABC's check skipped for what JSON gives (a
    ``dict``, or None for a missing field): most of a chunk's reading time otherwise."""
    return type(value) is dict or (value is not None and isinstance(value, Mapping))


def parse(doc: Mapping[str, Any], *, choices: bool = True) -> Chunk:
    """Read one parsed event or whole answer (see the module for the fields).

    Args:
        doc: the event's (or answer's) JSON object.
        choices: False: leave ``choices`` empty (unread), for a reader that needs only
            the model, usage and status.

    Returns:
        The :class:`Chunk`; never raises on an odd shape.
    """
    response = doc.get("response")
    holder = response if _is_map(response) else doc  # Responses API events
    raw_usage = holder.get("usage")
    usage_json = raw_usage if _is_map(raw_usage) and raw_usage else None
    model = holder.get("model")
    raw_choices = doc.get("choices") if choices else None
    read = tuple(c for c in (_choice(entry) for entry in raw_choices)
                 if c is not None) if isinstance(raw_choices, list) else ()
    return Chunk(choices=read, model=model if isinstance(model, str) else None,
                 usage=None if usage_json is None else _usage(usage_json),
                 usage_json=usage_json,
                 error=_error(doc["error"]) if "error" in doc else None,
                 status=_status(doc, holder),
                 service_tier=tier if isinstance(tier := holder.get("service_tier"), str)
                 else None)


def _status(doc: Mapping[str, Any], holder: Mapping[str, Any]) -> str | None:
    if doc.get("type") == "error":
        return "failed"
    if holder.get("object") != "response":
        return None
    status = holder.get("status")
    return status if isinstance(status, str) else None


def parse_event(data: str | bytes, *, choices: bool = True) -> Chunk | None:
    """Read one stream event's ``data`` (``choices``: as :func:`parse`'s).

    Returns:
        Its :class:`Chunk`, or None when ``data`` is not a JSON object (``[DONE]``, a
        cut or garbled event).
    """
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return parse(doc, choices=choices) if isinstance(doc, dict) else None


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _usage(doc: Mapping[str, Any]) -> Usage:
    """Chat/completions names (``prompt_tokens``...) or the Responses API's
    (``input_tokens``...)."""
    details = doc.get("prompt_tokens_details", doc.get("input_tokens_details"))
    cached = details.get("cached_tokens") if _is_map(details) else None
    prompt = doc.get("prompt_tokens", doc.get("input_tokens"))
    completion = doc.get("completion_tokens", doc.get("output_tokens"))
    return Usage(prompt_tokens=_whole(prompt) or 0,
                 completion_tokens=_whole(completion) or 0,
                 cached_tokens=_whole(cached) or 0)


def _error(value: object) -> str:
    if _is_map(value):
        message = value.get("message")
        return message if isinstance(message, str) else ""
    return value if isinstance(value, str) else ""


def _text(choice: Mapping[str, Any]) -> str:
    for holder in (choice.get("delta"), choice.get("message")):
        if _is_map(holder) and isinstance(holder.get("content"), str):
            return str(holder["content"])
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _choice(entry: object) -> ChunkChoice | None:
    if not _is_map(entry):
        return None
    index = 0 if entry.get("index") is None else _whole(entry.get("index"))
    if index is None:
        return None
    finish = entry.get("finish_reason")
    message = entry.get("message")
    return ChunkChoice(index=index, text=_text(entry),
                       finish_reason=finish if isinstance(finish, str) and finish else None,
                       logprobs=token_logprobs(entry),
                       message=message if _is_map(message) else None,
                       tool_calls=_tool_calls(entry))


def _tool_calls(choice: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    delta = choice.get("delta")
    calls = delta.get("tool_calls") if _is_map(delta) else None
    return tuple(c for c in calls if _is_map(c)) if isinstance(calls, list) else ()


class ToolCallPieces:
    """The tool calls of one streamed choice, joined from its ``delta.tool_calls``
    pieces by ``index`` (a piece without one continues the last call)."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, str]] = {}
        self._ready = 0  # calls returned by ready()

    def add(self, pieces: tuple[Mapping[str, Any], ...]) -> None:
        """Add one event's pieces."""
        for piece in pieces:
            index = _whole(piece.get("index"))
            if index is None:
                index = max(self._calls, default=0)
            call = self._calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
            fn = piece.get("function")
            fn = fn if _is_map(fn) else {}
            if isinstance(piece.get("id"), str) and piece["id"]:
                call["id"] = piece["id"]
            if isinstance(fn.get("name"), str) and not call["name"]:
                call["name"] = fn["name"]
            if isinstance(fn.get("arguments"), str):
                call["arguments"] += fn["arguments"]

    def ready(self) -> tuple[ToolCall, ...]:
        """Calls complete since the last ``ready()``: every call below the highest
        ``index`` seen (a stream sends a call's pieces before the next call's)."""
        done = sorted(self._calls)[:-1]
        new = done[self._ready:]
        self._ready = len(done)
        return tuple(ToolCall(self._calls[i]["id"] or f"call_{i}", self._calls[i]["name"],
                              self._calls[i]["arguments"] or "{}") for i in new)

    def calls(self) -> tuple[ToolCall, ...] | None:
        """The calls in ``index`` order (a missing id becomes ``call_<index>``), or None
        when the answer had none."""
        if not self._calls:
            return None
        return tuple(ToolCall(c["id"] or f"call_{i}", c["name"], c["arguments"] or "{}")
                     for i, c in sorted(self._calls.items()))


def token_logprobs(choice: Mapping[str, Any]) -> tuple[TokenLogprob, ...]:
    """A choice's ``logprobs.content`` as :class:`TokenLogprob` entries; an entry without
    a numeric ``logprob`` is left out (a missing ``token`` reads as "")."""
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if _is_map(logprobs) else None
    out = []
    for entry in entries if isinstance(entries, list) else ():
        pair = _pair(entry)
        if pair is None:
            continue
        top = entry.get("top_logprobs")
        alternatives = tuple(p for p in (_pair(t) for t in top) if p is not None) \
            if isinstance(top, list) else ()
        out.append(TokenLogprob(pair[0], pair[1], alternatives))
    return tuple(out)


def _pair(entry: object) -> tuple[str, float] | None:
    if not _is_map(entry):
        return None
    token, logprob = entry.get("token", ""), _number(entry.get("logprob", 0.0))
    if logprob is None:
        return None
    return (token if isinstance(token, str) else "", logprob)
