"""The output side of tool calling on the embedded engine: the constrained JSON of a
choice (see :mod:`flowlift.proxy.wire.tool_calls`) read into OpenAI ``tool_calls`` or
plain content, while it streams.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from flowlift.proxy.wire.tool_calls import ToolPlan

_CONTENT_KEY = '{"content":"'
_HIGH_SURROGATES = ("\ud800", "\udbff")


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """A finished tool-mode answer: ``tool_calls`` (OpenAI shape) or ``content``;
    ``unsent`` is content not yet returned by :meth:`ToolOutputDecoder.feed`."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    unsent: str = ""


class ToolOutputDecoder:
    """Reads the constrained JSON of one choice, fed piece by piece.

    :meth:`feed` returns content text as soon as it can be decoded (only for an
    ``"auto"`` answer with plain-text content: ``{"content": "...`` is decoded while it
    streams); everything else is buffered until :meth:`result`. Output cut off by
    ``max_tokens`` (small models may repeat calls until then) keeps the calls that were
    complete, with the engine's ``finish_reason`` (``"length"``); other output that is
    not the expected JSON is returned as content, as it is.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._buf = ""
        self._kind: Literal["unknown", "text", "buffered"] = (
            "unknown" if plan.text_content else "buffered")
        self._reader = _JsonStringReader()
        self._sent = ""

    def feed(self, text: str) -> str:
        """Add generated ``text``; returns newly decoded content (may be empty)."""
        self._buf += text
        if self._kind == "text":
            return self._emit(self._reader.feed(text))
        if self._kind == "unknown":
            compact = re.sub(r"\s+", "", self._buf[:64])
            if compact.startswith(_CONTENT_KEY):
                self._kind = "text"
                start = re.match(r'\s*\{\s*"content"\s*:\s*"', self._buf)
                assert start is not None  # the compact form matched
                return self._emit(self._reader.feed(self._buf[start.end():]))
            if not _CONTENT_KEY.startswith(compact):
                self._kind = "buffered"
        return ""

    def _emit(self, text: str) -> str:
        self._sent += text
        return text

    def _calls(self, calls: list[Any], finish_reason: str) -> ToolAnswer:
        out = [_openai_call(c) for c in calls if isinstance(c, dict)]
        return ToolAnswer(None, out if self.plan.parallel else out[:1], finish_reason)

    def result(self, finish_reason: str) -> ToolAnswer:
        """The answer, once the generation finished with ``finish_reason``."""
        try:
            value = json.loads(self._buf)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            return self._calls(value["tool_calls"], "tool_calls")
        if value is None and (complete := _complete_calls(self._buf)):
            return self._calls(complete, finish_reason)  # cut off after whole calls
        if isinstance(value, dict) and "content" in value:
            content = value["content"]
            text = content if isinstance(content, str) else json.dumps(content,
                                                                       ensure_ascii=False)
        elif self._kind == "text":  # cut off inside the content string
            text = self._sent
        else:
            text = self._buf
        return ToolAnswer(text, None, finish_reason, text[len(self._sent):])


def tool_calls_text(calls: list[dict[str, Any]]) -> str:
    """The JSON text of OpenAI ``tool_calls`` (what ``on_output`` receives for them)."""
    return json.dumps(calls, ensure_ascii=False)

def _complete_calls(text: str) -> list[Any]:
    """The whole call objects at the start of a cut-off ``{"tool_calls": [...`` text."""
    start = re.match(r'\s*\{\s*"tool_calls"\s*:\s*\[', text)
    if start is None:
        return []
    decoder, i = json.JSONDecoder(), start.end()
    out: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return out
        out.append(value)


def _openai_call(call: dict[str, Any]) -> dict[str, Any]:
    args = call.get("arguments", {})
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": str(call.get("name", "")),
                         "arguments": json.dumps(args, ensure_ascii=False,
                                                 separators=(",", ":"))}}

class _JsonStringReader:
    """Decodes the body of a JSON string (after its opening quote) fed in pieces:
    each :meth:`feed` returns the text whose escapes are complete, up to the closing
    quote; a high surrogate waits for its pair (``held``)."""

    def __init__(self) -> None:
        self._raw = ""
        self._pos = 0
        self._closed = False
        self.held = ""

    def feed(self, piece: str) -> str:
        self._raw += piece
        if self._closed:
            return ""
        raw, i = self._raw, self._pos
        while i < len(raw):
            if raw[i] == '"':
                self._closed = True
                break
            step = (6 if raw[i + 1:i + 2] == "u" else 2) if raw[i] == "\\" else 1
            if i + step > len(raw):
                break
            i += step
        try:
            text: str = json.loads(f'"{raw[self._pos:i]}"', strict=False)
        except ValueError:
            text = raw[self._pos:i]
        self._pos = i
        text = (self.held + text).encode("utf-16", "surrogatepass").decode(
            "utf-16", "surrogatepass")
        self.held = ""
        if text and _HIGH_SURROGATES[0] <= text[-1] <= _HIGH_SURROGATES[1]:
            self.held, text = text[-1], text[:-1]
        return text
