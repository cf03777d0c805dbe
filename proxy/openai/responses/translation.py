"""Responses API <-> chat completions (pure: no I/O).

A Responses turn becomes one chat completions request: ``instructions`` the first
(system) message, then the stored conversation (for ``previous_response_id``), then the
turn's input items as chat messages -- ``function_call`` items an assistant message's
``tool_calls``, ``function_call_output`` items ``role: "tool"`` messages. Function tools
take the chat shape (``{"type": "function", "function": {...}}``), ``text.format`` becomes
``response_format``, ``max_output_tokens`` ``max_completion_tokens``. The answer's
message comes back as output items (:mod:`.events`). As OpenAI's, the instructions of
an earlier turn are not carried into the next one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from flowlift.errors import RequestError
from flowlift.proxy.openai.responses.protocol import (
    ITEM_TYPES,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    ResponsesRequest,
    new_id,
)

_SAMPLING = ("temperature", "top_p", "seed", "user", "parallel_tool_calls")


def parsed(model: type[BaseModel], data: Any, param: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise RequestError(f"{param}{'.' + where if where else ''}: {err['msg']}",
                           param=f"{param}.{where}" if where else param) from None


def input_items(raw: str | list[dict[str, Any]]) -> list[InputItem]:
    """The turn's input as items (a string is one user message).

    Raises:
        RequestError: an item of a type the proxy cannot take (``param``: ``input[i]``).
    """
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    out: list[InputItem] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message" if "role" in item else None)
        model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise RequestError(
                f"input[{i}].type {kind!r} is not supported by flowlift's Responses API; "
                f"send messages, function_call or function_call_output items "
                f"({', '.join(ITEM_TYPES)})", param=f"input[{i}].type")
        _text_parts(item.get("content", item.get("output")), f"input[{i}]")
        out.append(parsed(model, item, f"input[{i}]"))
    return out


def _text_parts(content: Any, where: str) -> None:
    """Raise for a content part that is not text (images, files, audio)."""
    for j, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise RequestError(
                f"{where}.content[{j}].type {kind!r} is not supported: flowlift's Responses "
                "API takes text only; send the text as an input_text part",
                param=f"{where}.content[{j}].type")


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """``items`` as chat messages (consecutive function calls: one assistant message)."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or ()), call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": item.text()})
    return out


def without_replayed(history: list[dict[str, Any]], new: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
    """``new`` less the function calls the stored conversation already holds (a client
    that continues by ``previous_response_id`` may still send the calls it answers, as
    ``function_call`` items before their outputs): each call appears once."""
    known = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    out = []
    for message in new:
        if not message.get("tool_calls"):
            out.append(message)
            continue
        calls = [c for c in message["tool_calls"] if c["id"] not in known]
        if calls:
            out.append({**message, "tool_calls": calls})
        elif message.get("content"):
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape.

    Raises:
        RequestError: a tool that is not a function (``param``: ``tools[i].type``).
    """
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise RequestError(
                f"tools[{i}].type {tool.get('type')!r} is not supported by flowlift's "
                "Responses API (no hosted tools); describe it as a function tool: "
                '{"type": "function", "name", "description", "parameters"}',
                param=f"tools[{i}].type")
        fn: FunctionTool = parsed(FunctionTool, tool, f"tools[{i}]")
        out.append({"type": "function", "function": {
            k: v for k, v in (("name", fn.name), ("description", fn.description),
                              ("parameters", fn.parameters)) if v is not None}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in the chat shape (``{"type": "function", "name"}`` nests).

    Raises:
        RequestError: a hosted or MCP tool choice.
    """
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"tool_choice {choice!r} is not supported; send \"auto\", \"none\", "
                       '"required" or {"type": "function", "name": ...}',
                       param="tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat ``response_format`` (None: plain text).

    Raises:
        RequestError: an unknown format type or a json_schema without ``schema``.
    """
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format.schema must be a JSON Schema object",
                               param="text.format.schema")
        spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"],
                **({"strict": fmt["strict"]} if "strict" in fmt else {})}
        return {"type": "json_schema", "json_schema": spec}
    raise RequestError(f"text.format.type {fmt['type']!r} is not one of text, json_object, "
                       "json_schema", param="text.format.type")


def chat_request(req: ResponsesRequest, model: str, history: list[dict[str, Any]],
                 new: list[dict[str, Any]], *, stream: bool,
                 tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat completions body of one turn: ``instructions``, ``history`` (the stored
    conversation), ``new`` (this turn's messages) and the sampling fields; ``tools``:
    the chat tools when given (the hosted MCP ones included), else ``req.tools``'."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": model, "messages": [*system, *history, *new]}
    body.update({k: getattr(req, k) for k in _SAMPLING if getattr(req, k) is not None})
    extra = (("tools", tools if tools is not None else chat_tools(req.tools)),
             ("tool_choice", chat_tool_choice(req.tool_choice)),
             ("response_format", response_format(req.text)),
             ("max_completion_tokens", req.max_output_tokens))
    body.update({k: v for k, v in extra if v is not None})
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """One generation's output items as the chat assistant message the next turn (or
    generation) replays: its text, its function and hosted MCP calls."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] in ("function_call", "mcp_call")]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    elif not text:
        message["content"] = ""
    return message


def item_json(item: InputItem) -> dict[str, Any]:
    """An input item as ``GET /v1/responses/{id}/input_items`` lists it (with an id)."""
    doc = item.model_dump(exclude_none=True)
    prefix = "msg" if isinstance(item, MessageItem) else (
        "fc" if isinstance(item, FunctionCallItem) else "fco")
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        kind = "output_text" if item.role == "assistant" else "input_text"
        doc["content"] = [{"type": kind, "text": item.content}]
    return {"id": new_id(prefix), **doc, "status": "completed"}


def add_usage(total: dict[str, Any] | None, usage: dict[str, Any]) -> dict[str, Any]:
    """Two chat ``CompletionUsage`` objects summed (the generations of one turn), their
    ``prompt_tokens_details`` and ``completion_tokens_details`` included."""
    if total is None:
        return usage
    out: dict[str, Any] = {}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        out[key] = int(total.get(key) or 0) + int(usage.get(key) or 0)
    for key in ("prompt_tokens_details", "completion_tokens_details"):
        a, b = total.get(key) or {}, usage.get(key) or {}
        out[key] = {k: int(a.get(k) or 0) + int(b.get(k) or 0) for k in {*a, *b}}
    return out


def responses_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Chat ``CompletionUsage`` as the Responses ``ResponseUsage`` object:
    ``cached_tokens`` from ``prompt_tokens_details``, ``reasoning_tokens`` from
    ``completion_tokens_details`` (the upstream's, when it sends them)."""
    u = usage or {}
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    reasoning = int((u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}
