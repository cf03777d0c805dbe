"""Function calls and their outputs in a Responses conversation (pure: no I/O).

:func:`check_pairs`: every ``function_call_output`` answers a call of the conversation
(the stored one or this turn's input), once; and every call has its output before the
model is asked again -- else a 400 ``invalid_request_error`` naming the ``call_id``,
before any generation (OpenAI answers these three mistakes the same way: "No tool call
found for function call output with call_id ...", "No tool output found for function
call ...", a duplicate output).

:func:`drop_oldest` is ``truncation: "auto"``: the conversation less its oldest unit,
where a unit is a message, or an assistant message that calls tools together with the
tool messages that answer it -- so a call is never separated from its output.
"""

from __future__ import annotations

from typing import Any

from flowlift.errors import RequestError
from flowlift.proxy.openai.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
)

Message = dict[str, Any]


def check_pairs(history: list[Message], items: list[InputItem]) -> None:
    """Check the calls and outputs of ``history`` (the stored conversation, chat
    messages) and ``items`` (this turn's input).

    Raises:
        RequestError: an output whose call is not in the conversation or that answers
            an answered call (``param``: ``input[i].call_id``); a call left without
            its output (``param``: ``input``).
    """
    calls: list[str] = []
    answered: set[str] = set()
    for message in history:
        calls += [c["id"] for c in message.get("tool_calls") or ()]
        if message.get("role") == "tool":
            answered.add(message.get("tool_call_id") or "")
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            if item.call_id not in calls:
                calls.append(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            where = f"input[{i}].call_id"
            if item.call_id not in calls:
                raise RequestError(
                    f"No tool call found for function call output with call_id "
                    f"{item.call_id!r}: send the function_call it answers (or continue the "
                    "response that made it with previous_response_id)", param=where)
            if item.call_id in answered:
                raise RequestError(
                    f"Duplicate function call output for call_id {item.call_id!r}: each "
                    "call takes one output", param=where)
            answered.add(item.call_id)
    missing = [c for c in calls if c not in answered]
    if missing:
        raise RequestError(
            f"No tool output found for function call {missing[0]!r}: send a "
            f"function_call_output item with call_id {missing[0]!r} in this turn's input",
            param="input")


def units(messages: list[Message]) -> list[list[Message]]:
    """``messages`` grouped so that tool messages stay with the call they answer."""
    out: list[list[Message]] = []
    for message in messages:
        if message.get("role") == "tool" and out:
            out[-1].append(message)
        else:
            out.append([message])
    return out


def drop_oldest(messages: list[Message]) -> list[Message] | None:
    """``messages`` less their oldest unit (see the module doc); None when one unit is
    left (the turn's own input cannot be dropped)."""
    grouped = units(messages)
    if len(grouped) <= 1:
        return None
    return [m for unit in grouped[1:] for m in unit]
