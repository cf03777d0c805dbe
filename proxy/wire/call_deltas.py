"""Tool calls streamed as they are generated, the way OpenAI streams them.

OpenAI streams a call as ``delta.tool_calls`` entries of one ``index``: the first with
``id``, ``type: "function"``, ``function.name`` and ``function.arguments: ""``, then
``function.arguments`` fragments as the model writes them (``ChatCompletionMessageToolCallChunk``
in ``shared/specs/openai-openapi.yaml``; the ``openai`` SDK's stream helpers join the
fragments of each index). Two parts, both pure:

* :class:`CallScanner` reads the constrained protocol's answer
  (``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``,
  :mod:`flowlift.proxy.wire.tool_calls`) while it streams: a call opens once its name is
  read, then its arguments' text is passed on as it is generated: under constrained
  decoding the generated text *is* the JSON, so nothing is re-encoded. The text is
  tokenised by ijson's pure-Python lexer (each lexeme with its offset; strings and
  escapes are ijson's business), and a small state machine over the lexemes follows
  this one grammar; any other JSON (``{"content": ...}``) makes no calls.
* :class:`CallStream` turns one choice's :class:`~flowlift.local_engine.base.ToolCallDelta`
  pieces (from :class:`CallScanner`, or from vLLM's tool parser for the native format:
  :mod:`flowlift.local_engine.native_tools`) into those entries, and at the end checks
  them against the answer's calls: the rest of a call's arguments is sent, a call not
  yet sent is sent whole, and a call that was sent but is not the answer's (its JSON
  did not parse in the end, the answer was cut off inside it) is an error, never a
  silently different call.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ijson

from flowlift.errors import EngineError
from flowlift.local_engine.base import ToolCall, ToolCallDelta
from flowlift.proxy.wire.early_calls import call_key

__all__ = ["CallScanner", "CallStream", "invalid_call"]


def invalid_call(message: str) -> EngineError:
    """The error of a call that was streamed but cannot be completed (in a stream: the
    ``{"error": ...}`` event that ends it; ``code: "invalid_tool_call"``)."""
    err = EngineError(f"{message}; the streamed tool call is not usable: retry the "
                      "request (with a larger max_tokens if it was cut off)")
    err.code = "invalid_tool_call"
    return err


_LEXER: Any = ijson.get_backend("python").Lexer
"""ijson's pure-Python lexer: a coroutine fed text, sending ``(offset, lexeme)`` on."""


@dataclass(slots=True)
class _Item:
    """One call of the constrained answer: where its arguments' text lies."""

    index: int
    id: str
    name: str | None = None
    start: int | None = None  # offset of its arguments' first character
    end: int | None = None  # offset just past its arguments (None: still being written)
    sent: int | None = None  # how far its arguments were passed on
    opened: bool = False


class CallScanner:
    """The calls of one constrained answer, read piece by piece (see the module).

    :meth:`feed` returns the pieces the new text completes: a call's opening piece
    (``id``, ``name``) once its name is read (calls open in order: call ``n + 1`` waits
    until call ``n``'s arguments are whole), then fragments of its arguments' text.
    :meth:`settle` gives the answer's final calls the ids and text that were streamed.
    """

    def __init__(self) -> None:
        self._text = ""
        self._items: list[_Item] = []
        self._stack: list[list[Any]] = []  # each open container: [its bracket, its key]
        self._key: str | None = None  # the last string read where a key goes
        self._off = False  # not the tool-call JSON (or the answer ended)
        self._lexer: Any = _LEXER(_Target(self._lexeme))
        self._close = weakref.finalize(self, _close_quietly, self._lexer)

    def feed(self, text: str) -> tuple[ToolCallDelta, ...]:
        """Add generated ``text``; returns the pieces it completes (may be none)."""
        if text and not self._off:
            self._text += text
            try:
                self._lexer.send(text)
            except Exception:  # ijson gave up on the text: no more calls from it
                self._stop()
        return self._pieces()

    def settle(self, calls: Sequence[ToolCall]) -> tuple[ToolCall, ...]:
        """``calls`` (the answer's, parsed whole) with the ids this scanner streamed and
        the arguments' text as generated, where it is the same call (same name, same
        JSON value); the scanner stops."""
        self._stop()
        out = []
        for i, call in enumerate(calls):
            item = self._items[i] if i < len(self._items) else None
            if item is not None and item.start is not None and item.end is not None:
                text = self._text[item.start:item.end]
                key = call_key(call.name, text)
                if key is not None and item.name == call.name and \
                        key == call_key(call.name, call.arguments):
                    call = ToolCall(item.id, call.name, text)
            out.append(call)
        return tuple(out)

    def _stop(self) -> None:
        self._off = True
        self._close()

    def _pieces(self) -> tuple[ToolCallDelta, ...]:
        out = []
        for item in self._items:
            if item.name is None:
                break
            if not item.opened:
                item.opened = True
                out.append(ToolCallDelta(item.index, "", item.id, item.name))
            if item.start is not None:
                end = item.end if item.end is not None else len(self._text)
                sent = item.start if item.sent is None else item.sent
                if end > sent:
                    out.append(ToolCallDelta(item.index, self._text[sent:end]))
                    item.sent = end
            if item.end is None:
                break  # the next call waits until this one's arguments are whole
        return tuple(out)

    def _lexeme(self, pos: int, lexeme: str | None) -> None:
        """One lexeme of the answer at offset ``pos`` (``None``: the end)."""
        if lexeme is None or self._off:
            return
        stack = self._stack
        if lexeme in ("{", "["):
            self._value(pos, lexeme)
            stack.append([lexeme, None])
        elif lexeme in ("}", "]"):
            if not stack:
                self._off = True
                return
            stack.pop()
            if len(stack) == 3 and stack[-1][1] == "arguments":
                self._ended(pos + 1)
        elif lexeme == ":":
            if stack and stack[-1][0] == "{":
                stack[-1][1] = self._key
        elif lexeme == ",":
            if stack and stack[-1][0] == "{":
                stack[-1][1] = None
        elif stack and stack[-1][0] == "{" and stack[-1][1] is None:
            self._key = json.loads(lexeme) if lexeme.startswith('"') else None
            # an answer ({"content": ...}) is not read on: its text may be long
            self._off = len(stack) == 1 and self._key != "tool_calls"
        else:
            self._value(pos, lexeme)
            if len(stack) == 3 and stack[-1][1] == "arguments":
                self._ended(pos + len(lexeme))

    def _value(self, pos: int, lexeme: str) -> None:
        """A value starts at ``pos``: where it is in the grammar decides what it is."""
        stack, depth = self._stack, len(self._stack)
        if depth == 0:
            self._off = lexeme != "{"
        elif depth == 1:
            self._off = stack[0][1] != "tool_calls" or lexeme != "["
        elif depth == 2:
            if stack[1][0] != "[" or lexeme != "{":
                self._off = True
                return
            self._items.append(_Item(len(self._items), f"call_{secrets.token_hex(12)}"))
        elif depth == 3:
            item, key = self._items[-1], stack[2][1]
            if key == "name" and lexeme.startswith('"') and item.name is None:
                item.name = json.loads(lexeme)
            elif key == "arguments" and item.start is None:
                item.start = pos

    def _ended(self, end: int) -> None:
        item = self._items[-1]
        if item.start is not None and item.end is None:
            item.end = end


class _Target:
    """ijson's lexer target: ``(offset, lexeme)`` pairs to a callback."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def send(self, value: tuple[int, str | None]) -> None:
        self.callback(*value)

    def close(self) -> None:
        return None


def _close_quietly(lexer: Any) -> None:
    # an unfinished document at the end no longer matters: the answer is parsed whole
    with contextlib.suppress(Exception):
        lexer.close()


class CallStream:
    """One choice's tool calls as OpenAI streams them (see the module).

    :meth:`feed` and :meth:`finish` return ``delta.tool_calls`` entries (each for its own
    chunk); :attr:`calls` is what they add up to: the answer's ``message.tool_calls``.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def feed(self, pieces: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
        """The entries of ``pieces``.

        Raises:
            EngineError: ``code="invalid_tool_call"``: a piece of a call that has not
                been opened (no name yet), or that opens a call out of order.
        """
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if piece.index == len(self.calls) and piece.name:
                call = {"id": piece.id or f"call_{secrets.token_hex(12)}", "type": "function",
                        "function": {"name": piece.name, "arguments": ""}}
                self.calls.append(call)
                out.append({"index": piece.index, **call,
                            "function": {"name": piece.name, "arguments": ""}})
            elif piece.index >= len(self.calls):
                raise invalid_call(f"tool call {piece.index} was streamed before its name "
                                   f"(or before call {len(self.calls)})")
            elif piece.id is not None and piece.id != self.calls[piece.index]["id"]:
                raise invalid_call(f"tool call {piece.index} was streamed, then the answer "
                                   "was generated again with other calls")
            if piece.arguments:
                self.calls[piece.index]["function"]["arguments"] += piece.arguments
                out.append({"index": piece.index,
                            "function": {"arguments": piece.arguments}})
        return out

    def finish(self, calls: Sequence[ToolCall] | None) -> list[dict[str, Any]]:
        """The entries that complete the stream with the answer's ``calls``: the rest of
        each call's arguments, and the calls not streamed yet, whole (an opening entry,
        then the arguments).

        Raises:
            EngineError: ``code="invalid_tool_call"``: a streamed call the answer does
                not hold (the model's call did not parse in the end, or the answer was
                cut off inside it), or whose name or arguments differ from what was
                streamed.
        """
        calls = tuple(calls or ())
        if len(self.calls) > len(calls):
            lost = self.calls[len(calls)]
            raise invalid_call(f"tool call {len(calls)} ({lost['function']['name']!r}) "
                               "was streamed, but the model's answer does not hold it "
                               "(its JSON did not parse, or the answer was cut off "
                               "inside it)")
        out: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if i == len(self.calls):
                out += self.feed([ToolCallDelta(i, call.arguments, call.id, call.name)])
                continue
            sent = self.calls[i]["function"]
            if sent["name"] != call.name or not call.arguments.startswith(sent["arguments"]):
                raise invalid_call(f"tool call {i} ({sent['name']!r}) was streamed as "
                                   f"{sent['arguments']!r}, but the model's answer reads "
                                   f"it as {call.name!r} with {call.arguments!r}")
            out += self.feed([ToolCallDelta(i, call.arguments[len(sent["arguments"]):])])
        return out
