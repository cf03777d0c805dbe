"""Tool calls whose JSON is complete while the model's turn still streams.

The embedded engine writes a turn that calls tools as constrained JSON,
``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``
(:mod:`flowlift.proxy.wire.tool_calls`). :class:`EarlyCalls` is fed that
text piece by piece and returns each array item as soon as its closing brace arrives,
so a proxy tool can start before the turn ends. It parses with ijson's push interface
(``items_coro``: an incremental, event-based JSON parser), never by hand; ijson's pure
Python backend, which reads numbers as ``json.loads`` does (yajl's C backend refuses
integers past 64 bits);
text that is not that JSON (a plain answer, ``{"content": ...}``) yields nothing, and
whatever it yielded is only a head start: the turn's final calls, parsed whole, are
what the loop runs (:mod:`flowlift.proxy.workflows.agent` matches them by name and
arguments).
"""

from __future__ import annotations

import contextlib
import json
import weakref
from typing import Any

import ijson

from flowlift.local_engine.base import ToolCall


class EarlyCalls:
    """The complete ``tool_calls`` items of one streamed turn, in order."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._parser: Any = _BACKEND.items_coro(_Sink(self._items), "tool_calls.item",
                                                use_float=True)
        self._seen = 0
        self._broken = False  # not tool-call JSON, or the turn ended: feed ignores text
        # an abandoned turn (aborted stream) closes its parser quietly when collected
        self._close = weakref.finalize(self, _close_quietly, self._parser)

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
            self.close()
        new, self._seen = self._items[self._seen:], len(self._items)
        return tuple(_call(self._seen - len(new) + i, item) for i, item in enumerate(new)
                     if isinstance(item, dict) and isinstance(item.get("name"), str))


    def close(self) -> None:
        """The turn ended (or its text is not tool-call JSON): stop the parser now, so
        no unfinished document is reported when it is collected."""
        self._broken = True
        self._close()


def _close_quietly(parser: Any) -> None:
    # whatever the parser says about an unfinished or broken document no longer
    # matters: the turn's final calls are parsed whole elsewhere
    with contextlib.suppress(Exception):
        parser.close()


_BACKEND: Any = ijson.get_backend("python")


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
