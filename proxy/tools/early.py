"""Tool calls whose JSON is complete while the model's turn still streams.

The embedded engine writes a turn that calls tools as constrained JSON,
``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``
(:mod:`flowlift.proxy.openai.chat_completion.tools`). :class:`EarlyCalls` is fed that
text piece by piece and returns each array item as soon as its closing brace arrives,
so a proxy tool can start before the turn ends. It parses with ijson's push interface
(``items_coro``: an incremental, event-based JSON parser over yajl), never by hand;
text that is not that JSON (a plain answer, ``{"content": ...}``) yields nothing, and
whatever it yielded is only a head start: the turn's final calls, parsed whole, are
what the loop runs (:mod:`flowlift.proxy.workflows.agent` matches them by name and
arguments).
"""

from __future__ import annotations

import json
from typing import Any

import ijson

from flowlift.local_engine.base import ToolCall


class EarlyCalls:
    """The complete ``tool_calls`` items of one streamed turn, in order."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._parser: Any = ijson.items_coro(_Sink(self._items), "tool_calls.item",
                                             use_float=True)
        self._seen = 0
        self._broken = False

    def feed(self, text: str) -> tuple[ToolCall, ...]:
        """Add generated ``text``; returns the calls completed by it (may be none).

        Returns:
            One :class:`ToolCall` per newly complete item (id ``early_<n>``, arguments
            as compact JSON); none once the text stopped being tool-call JSON.
        """
        if self._broken or not text:
            return ()
        try:
            self._parser.send(text.encode())
        except ijson.JSONError:
            self._broken = True
        new, self._seen = self._items[self._seen:], len(self._items)
        return tuple(_call(self._seen - len(new) + i, item) for i, item in enumerate(new)
                     if isinstance(item, dict) and isinstance(item.get("name"), str))


class _Sink:
    """ijson's coroutine target: a list the parsed items are appended to."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def send(self, value: Any) -> None:
        self.items.append(value)

    def close(self) -> None:
        return None


def _call(index: int, item: dict[str, Any]) -> ToolCall:
    args = item.get("arguments", {})
    return ToolCall(f"early_{index}", item["name"],
                    args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def call_key(name: str, arguments: str) -> tuple[str, str] | None:
    """What makes two calls the same call: the name and the arguments as canonical
    JSON (None: arguments that are not JSON)."""
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return None
    return name, json.dumps(parsed, sort_keys=True, ensure_ascii=False)
