"""A chat completion's chunks as one Responses API response (pure: no I/O).

:class:`ResponseBuilder` reads ``chat.completion.chunk`` objects (from the embedded
engine or an upstream) and returns the Responses stream events each one causes, in
OpenAI's order: ``response.created`` and ``response.in_progress`` first; for text, a
``message`` item (``response.output_item.added``, ``response.content_part.added``, then
``response.output_text.delta`` per piece, closed by ``response.output_text.done``,
``response.content_part.done`` and ``response.output_item.done``); for each tool call,
a ``function_call`` item (``output_item.added``, ``function_call_arguments.delta`` per
piece, ``function_call_arguments.done``, ``output_item.done``). Items are opened and
closed one after another: the next item's ``output_item.added`` comes after the last
one's ``output_item.done``, and the ids in the events are the final items' ids.
A call of a hosted MCP tool (``hosted``: tool name -> server label) is an ``mcp_call``
item instead, with ``response.mcp_call_arguments.delta`` / ``.done``; it stays open
until the proxy ran it (:meth:`ResponseBuilder.mcp_started`, :meth:`mcp_finished`:
``response.mcp_call.in_progress``, ``.completed`` or ``.failed``, ``output_item.done``).
A turn may hold several generations (the hosted-MCP loop): their usages add up. Last
one terminal event
with the whole response and its usage: ``response.completed``, ``response.incomplete``
(``finish_reason`` ``length``: ``incomplete_details.reason = "max_output_tokens"``) or
``response.failed``. Every event has a ``sequence_number`` from 0.
"""

from __future__ import annotations

import time
from typing import Any

from flowlift.proxy.openai.responses.protocol import new_id
from flowlift.proxy.openai.responses.translation import add_usage, responses_usage

Event = dict[str, Any]
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
NOT_RUN = "not run: the response ended before the call could run"


class ResponseBuilder:
    """One response being built from chat chunks.

    Args:
        head: the response object's fixed fields (``id``, ``model``, ``instructions``,
            ``tools``... as :func:`flowlift.proxy.openai.responses.serving` sets them).
    """

    def __init__(self, head: dict[str, Any], hosted: dict[str, str] | None = None) -> None:
        self.head = head
        self.hosted = hosted or {}
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self._seq = 0
        self._message: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self._open: dict[str, Any] | None = None  # the function or MCP call item open now
        self.pending: list[dict[str, Any]] = []  # MCP calls of this generation, not run yet
        self._generation_at = 0  # where this generation's items start in output
        self.final_response: dict[str, Any] | None = None  # set once the turn finished

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object now (``status``: in_progress, completed, incomplete...)."""
        reason = _INCOMPLETE.get(self.finish or "") if status == "incomplete" else None
        done = status in ("completed", "incomplete", "failed")
        return {**self.head, "object": "response", "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": error, "incomplete_details": {"reason": reason} if reason else None,
                "output": [_shown(item) for item in self.output],
                **({"usage": responses_usage(self.usage)} if done else {})}

    def start(self) -> list[Event]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """The events of one ``chat.completion.chunk`` (its first choice only)."""
        if isinstance(chunk.get("usage"), dict):
            self.usage = add_usage(self.usage, chunk["usage"])
        out: list[Event] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str) and delta["content"]:
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def _text(self, text: str) -> list[Event]:
        out = self._close_call()
        if self._message is None:
            self._message = {"id": new_id("msg"), "type": "message", "role": "assistant",
                             "status": "in_progress", "content": []}
            index = len(self.output)
            self.output.append(self._message)
            out.append(self._event("response.output_item.added", output_index=index,
                                   item={**self._message, "content": []}))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            out.append(self._event("response.content_part.added", output_index=index,
                                   item_id=self._message["id"], content_index=0,
                                   part=dict(part)))
        self._message["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self._message["id"],
                               output_index=self.output.index(self._message),
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _call(self, piece: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        fn = piece.get("function") or {}
        index = piece.get("index", len(self._calls))
        item = self._calls.get(index)
        if item is None:
            out += self._close_message("completed") + self._close_call()
            name = fn.get("name") or ""
            call_id = piece.get("id") or new_id("call")
            if name in self.hosted:
                item = {"id": new_id("mcp"), "type": "mcp_call", "status": "in_progress",
                        "server_label": self.hosted[name], "name": name, "arguments": "",
                        "output": None, "error": None, "call_id": call_id}
            else:
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": call_id, "name": name, "arguments": ""}
            self._calls[index] = self._open = item
            self.output.append(item)
            out.append(self._event("response.output_item.added",
                                   output_index=len(self.output) - 1, item=_shown(item)))
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            item["arguments"] += args
            kind = ("response.mcp_call_arguments.delta" if item["type"] == "mcp_call"
                    else "response.function_call_arguments.delta")
            out.append(self._event(kind, item_id=item["id"],
                                   output_index=self.output.index(item), delta=args))
        return out

    def _close_call(self, status: str = "completed") -> list[Event]:
        """Close the call item open now (an MCP call: its arguments only, it stays
        pending until it ran)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        if item["type"] == "mcp_call":
            self.pending.append(item)
            return [self._event("response.mcp_call_arguments.done", item_id=item["id"],
                                output_index=index, arguments=item["arguments"])]
        item["status"] = status
        return [self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=item["name"],
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index,
                            item=_shown(item))]

    def end_generation(self) -> list[Event]:
        """One generation ended: close its open items (the calls of a hosted MCP tool
        become :attr:`pending`); the tool-call indexes start again for the next one."""
        status = "incomplete" if self.finish in _INCOMPLETE else "completed"
        out = self._close_message(status) + self._close_call(status)
        self._calls = {}
        self._generation_at = len(self.output)
        return out

    def mark(self) -> tuple[int, int]:
        """Where the next generation starts (its first output index, its first event's
        sequence number), for :meth:`rewind`."""
        return len(self.output), self._seq

    def rewind(self, mark: tuple[int, int]) -> None:
        """Forget the generation begun at ``mark`` (:meth:`mark`), none of whose events
        was sent and which called nothing (an answer held back and found to be no
        answer): its items and sequence numbers; its usage stays (its tokens were
        spent)."""
        del self.output[mark[0]:]
        self._seq, self._generation_at = mark[1], mark[0]
        self._message, self._open, self._calls, self.finish = None, None, {}, None

    def current_items(self) -> list[dict[str, Any]]:
        """The output items of the generation running now, with their chat call ids
        (what its assistant message is made of)."""
        return self.output[self._generation_at:]

    def list_tools(self, label: str, tools: list[dict[str, Any]]) -> list[Event]:
        """An ``mcp_list_tools`` item for server ``label`` (its ``tools`` as
        ``MCPListToolsTool``), added and done."""
        item = {"id": new_id("mcpl"), "type": "mcp_list_tools", "server_label": label,
                "tools": tools, "error": None}
        self.output.append(item)
        ids = {"item_id": item["id"], "output_index": len(self.output) - 1}
        return [self._event("response.output_item.added", output_index=ids["output_index"],
                            item={**item, "tools": []}),
                self._event("response.mcp_list_tools.in_progress", **ids),
                self._event("response.mcp_list_tools.completed", **ids),
                self._event("response.output_item.done", output_index=ids["output_index"],
                            item=dict(item))]

    def mcp_started(self) -> list[Event]:
        """``response.mcp_call.in_progress`` for each pending MCP call."""
        return [self._event("response.mcp_call.in_progress", item_id=item["id"],
                            output_index=self.output.index(item)) for item in self.pending]

    def mcp_finished(self, item: dict[str, Any], output: str | None,
                     error: dict[str, Any] | None) -> list[Event]:
        """A pending MCP call ran: ``output`` (its text) or ``error`` (an
        ``MCPToolCallError``: ``{"type": "mcp_tool_execution_error", "content"}`` or
        ``{"type": "mcp_protocol_error", "code", "message"}``)."""
        self.pending.remove(item)
        item.update(output=output, error=error,
                    status="failed" if error is not None else "completed")
        index = self.output.index(item)
        kind = "failed" if error is not None else "completed"
        return [self._event(f"response.mcp_call.{kind}", item_id=item["id"],
                            output_index=index),
                self._event("response.output_item.done", output_index=index,
                            item=_shown(item))]

    def _close_message(self, status: str) -> list[Event]:
        message, self._message = self._message, None
        if message is None:
            return []
        index, part = self.output.index(message), message["content"][0]
        message["status"] = status
        ids = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **ids, text=part["text"],
                            logprobs=[]),
                self._event("response.content_part.done", **ids, part=dict(part)),
                self._event("response.output_item.done", output_index=index,
                            item=dict(message))]

    def finish_events(self) -> list[Event]:
        """Close the open items; then the terminal event with the whole response."""
        status = "incomplete" if self.finish in _INCOMPLETE else "completed"
        out = self.end_generation()
        for item in list(self.pending):  # MCP calls the loop did not run: not run
            out += self.mcp_finished(item, None, {
                "type": "mcp_tool_execution_error",
                "content": NOT_RUN})
        return [*out, self._event(f"response.{status}", response=self.response(status))]

    def failed(self, message: str, code: str = "server_error") -> Event:
        """``response.failed`` for a turn that failed after the stream began (``code``:
        the error's, e.g. ``store_unavailable`` when it could not be stored)."""
        return self._event("response.failed", response=self.response(
            "failed", {"code": code, "message": message}))

    def final(self) -> dict[str, Any]:
        """The whole response (non-streamed answers): :meth:`finish_events`' last one's."""
        last: dict[str, Any] = self.finish_events()[-1]["response"]
        return last


def _shown(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the client sees it (an MCP call's chat ``call_id`` is the
    proxy's own: the conversation's chat messages use it, the client never does)."""
    if item["type"] == "mcp_call":
        return {k: v for k, v in item.items() if k != "call_id"}
    return dict(item)
