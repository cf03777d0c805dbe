"""Tool calls in the model's own format: its chat template renders the tools, vLLM's
tool parser for its family reads the calls back.

A model trained for tool calling ships a chat template that renders ``tools`` (Qwen2.5's
puts their JSON in ``<tools>...</tools>`` in the system message and asks for
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks; earlier calls and
``tool`` results are rendered in that same markup). vLLM ships the matching parsers
(``vllm.tool_parsers``: ``hermes`` for Qwen2.5 and Hermes models, ``llama3_json``,
``mistral``, ...); this module drives one of them the way vLLM's OpenAI server does:
:meth:`ToolParser.extract_tool_calls_streaming` while the answer streams (the content
that is safe to send: text before any call markup; and the calls' pieces, each call's
name and then its arguments' text, passed on as
:class:`~flowlift.local_engine.base.ToolCallDelta`) and
:meth:`ToolParser.extract_tool_calls` on the whole answer (the calls; a call that was
streamed keeps its streamed id and text).

Engines that render templates themselves (:class:`~flowlift.local_engine.vllm_engine.VLLMEngine`,
the Qwen-style fake of :mod:`flowlift.testing.native`) use :func:`template_messages` and
:func:`template_tools` for the template's inputs and :class:`NativeToolReader` for the
output. Which format a model uses is its ``tool_format`` (``"native"`` or
``"constrained"``, :mod:`flowlift.local_engine.packaged` has the shipped models'
defaults); the proxy decides per request (:mod:`flowlift.proxy.dispatch.tool_turns`).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Literal

from flowlift.errors import ConfigError
from flowlift.local_engine.base import (
    ChatMessage,
    GenerationChunk,
    ToolCall,
    ToolCallDelta,
    ToolDef,
)

ToolFormat = Literal["native", "constrained"]
"""``native``: the model's chat template and vLLM's parser; ``constrained``: the proxy's
JSON protocol under constrained decoding (:mod:`flowlift.proxy.dispatch.tool_turns`)."""


def template_tools(tools: Sequence[ToolDef]) -> list[dict[str, Any]]:
    """OpenAI ``tools`` entries (``{"type": "function", "function": {...}}``): what chat
    templates take as ``tools=``."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as chat-template messages: an assistant turn's ``tool_calls``
    with their ``arguments`` as objects (templates write them with ``tojson``, as vLLM's
    server passes them), a ``tool`` result with its ``tool_call_id``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": _arguments(c.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def parser_class(name: str) -> Any:
    """vLLM's tool parser class registered as ``name`` (``"hermes"``, ...).

    Raises:
        ConfigError: vLLM has no parser of that name (the message lists them).
    """
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ConfigError(f"vLLM has no tool parser {name!r}; tool_parser is one of: "
                          f"{known}", param="tool_parser") from None


class NativeToolReader:
    """Reads one answer in the model's tool-call format, fed as it streams.

    Args:
        parser: the vLLM parser's registered name (``"hermes"`` for Qwen2.5).
        tokenizer: the model's tokenizer (parsers look up their markup's token ids).
        tools: the request's tools.

    :meth:`feed` returns the content that can be sent now (the parser holds back what
    may start a call's markup) and the calls whose markup closed with this piece;
    :meth:`finish` returns the content not yet sent and every call of the answer.
    """

    def __init__(self, parser: str, tokenizer: Any, tools: Sequence[ToolDef]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self._request = ChatCompletionRequest(
            model="native-tools", messages=[{"role": "user", "content": ""}],
            tools=template_tools(tools))
        self._parser = parser_class(parser)(tokenizer, self._request.tools)
        self._text = ""
        self._sent = ""
        self._ready = 0
        self._in_call = False
        self._ids: dict[int, str] = {}  # call index -> the id its first piece had
        self._streamed: dict[int, str] = {}  # call index -> its arguments' text streamed

    def feed(self, piece: str) -> tuple[str, tuple[ToolCall, ...], tuple[ToolCallDelta, ...]]:
        """Add generated ``piece``: ``(content to send now, calls completed now, the
        calls' pieces read now)`` (the pieces: the parser's own streamed deltas, each
        call's name and then its arguments' text as it is written)."""
        previous, self._text = self._text, self._text + piece
        if not piece:
            return "", (), ()
        delta = self._parser.extract_tool_calls_streaming(
            previous, self._text, piece, [], [], [], self._request)
        content = "" if delta is None or self._in_call else (delta.content or "")
        pieces = self._pieces(delta.tool_calls or ()) if delta is not None else ()
        if delta is not None and delta.tool_calls:
            self._in_call = True  # content after a call's markup waits for finish()
        self._sent += content
        return content, self._complete_calls() if self._in_call else (), pieces

    def _pieces(self, deltas: Sequence[Any]) -> tuple[ToolCallDelta, ...]:
        """vLLM's ``DeltaToolCall`` entries as :class:`ToolCallDelta` (a call's first
        piece gets an id when the parser gave none); what each call streamed is kept
        for :meth:`finish`."""
        out = []
        for d in deltas:
            fn = d.function
            name = getattr(fn, "name", None) if fn is not None else None
            args = (getattr(fn, "arguments", None) if fn is not None else None) or ""
            call_id = None
            if d.index not in self._ids and (name or d.id):
                call_id = self._ids[d.index] = d.id or f"call_{secrets.token_hex(12)}"
            self._streamed[d.index] = self._streamed.get(d.index, "") + args
            out.append(ToolCallDelta(d.index, args, call_id, name))
        return tuple(out)

    def _complete_calls(self) -> tuple[ToolCall, ...]:
        calls = self._extract()[1]
        # the last call may still be open; only those before it are surely whole
        whole = calls if self._parser_done() else calls[:-1]
        new, self._ready = whole[self._ready:], max(self._ready, len(whole))
        return tuple(new)

    def _parser_done(self) -> bool:
        end = getattr(self._parser, "tool_call_end_token", None)
        start = getattr(self._parser, "tool_call_start_token", None)
        return bool(end and start and self._text.count(end) >= self._text.count(start))

    def _extract(self) -> tuple[str, list[ToolCall]]:
        info = self._parser.extract_tool_calls(self._text, self._request)
        if not info.tools_called:
            return self._text, []
        calls = [ToolCall(c.id or f"call_{n}", c.function.name, c.function.arguments or "{}")
                 for n, c in enumerate(info.tool_calls)]
        return info.content or "", calls

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """``(content not yet sent, every call of the answer)`` once it ended. Markup the
        parser cannot read (a call's JSON cut off) stays content, as vLLM's server
        leaves it. A call streamed in pieces keeps the id of its first piece, and the
        arguments' text the pieces made when it is the same JSON as the parser's (the
        parser re-encodes it: its pieces are the model's own text)."""
        content, calls = self._extract()
        unsent = content[len(self._sent):] if content.startswith(self._sent) else content
        return unsent, tuple(self._as_streamed(i, c) for i, c in enumerate(calls))

    def _as_streamed(self, index: int, call: ToolCall) -> ToolCall:
        streamed = self._streamed.get(index, "")
        args = streamed if _same_json(streamed, call.arguments) else call.arguments
        return ToolCall(self._ids.get(index, call.id), call.name, args)


def _same_json(a: str, b: str) -> bool:
    """Whether JSON texts ``a`` and ``b`` hold the same value (False: either is not
    JSON)."""
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


async def read_native(chunks: AsyncIterator[GenerationChunk], reader: NativeToolReader,
                      ) -> AsyncGenerator[GenerationChunk, None]:
    """An engine's plain chunks of a native-format answer, read by ``reader``: each
    chunk's text becomes the content safe to send (``ready_calls``: calls whose markup
    closed; ``call_deltas``: the calls' pieces as the parser streams them); the last
    chunk carries the rest of the content and, when the answer called tools,
    ``tool_calls`` with ``finish_reason="tool_calls"`` (a ``"length"`` cut keeps its
    reason: the calls before the cut are whole)."""
    async for chunk in chunks:
        text, ready, pieces = reader.feed(chunk.text)
        if chunk.finish_reason is None:
            if text or ready or pieces or chunk.logprobs:
                yield dataclasses.replace(chunk, text=text, ready_calls=ready or None,
                                          call_deltas=pieces or None)
            continue
        rest, calls = reader.finish()
        finish = chunk.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        yield dataclasses.replace(chunk, text=text + rest, finish_reason=finish,
                                  tool_calls=calls or None, call_deltas=pieces or None)
