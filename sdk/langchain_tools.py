"""Tools and structured output for :class:`flowlift.sdk.langchain.FlowliftChat`.

A call whose model has tools bound (``bind_tools``, what LangGraph's
``create_react_agent`` does) needs the model's decision now -- which tool, which
arguments -- so it cannot be a deferred step: it is a chat completion on the proxy
(``POST /v1/chat/completions`` with OpenAI ``tools``), answered in the model's own
tool-call format (:mod:`flowlift.proxy.dispatch.tool_turns`), and turned into an
``AIMessage`` with ``tool_calls``. Messages go over with LangChain's own OpenAI
conversion (``convert_to_openai_messages``), tools with ``convert_to_openai_tool``.

Errors: :class:`~flowlift.errors.UserError` for options a call cannot honour;
:class:`~flowlift.errors.UpstreamError` when the proxy answers with an error;
:class:`~flowlift.errors.ProxyUnavailable` when it cannot be reached.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx
from langchain_core.messages import AIMessage, BaseMessage, convert_to_openai_messages
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableLambda
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

from flowlift.errors import ProxyUnavailable, UpstreamError, UserError

if TYPE_CHECKING:
    from flowlift.sdk.langchain import FlowliftChat

TIMEOUT_S = 600.0
"""How long one call with tools may take (a small model on a busy CPU is slow)."""

_CHOICES = {"any": "required", "required": "required", "auto": "auto", "none": "none"}


def bound_tools(tools: Sequence[Any], tool_choice: Any) -> dict[str, Any]:
    """The ``tools`` and ``tool_choice`` of a chat completion for ``bind_tools``."""
    out: dict[str, Any] = {"tools": [convert_to_openai_tool(t) for t in tools]}
    if tool_choice is True:
        tool_choice = "required"
    if isinstance(tool_choice, str):
        out["tool_choice"] = _CHOICES.get(tool_choice) or {
            "type": "function", "function": {"name": tool_choice}}
    elif tool_choice is not None:
        out["tool_choice"] = tool_choice
    return out


def chat_body(llm: FlowliftChat, messages: Sequence[BaseMessage],
              options: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion of one call with tools (the model's sampling fields).

    Raises:
        UserError: an option other than ``tools``, ``tool_choice``, ``stop``.
    """
    extra = sorted(k for k in options if k not in ("tools", "tool_choice", "stop"))
    if extra:
        raise UserError(f"FlowliftChat takes no per-call options (got {extra}): set "
                        "sampling as fields", param=extra[0])
    body: dict[str, Any] = {
        "model": llm.model or "default", "messages": convert_to_openai_messages(
            list(messages)), "tools": options["tools"], "temperature": llm.temperature,
        "top_p": llm.top_p, "max_tokens": llm.max_tokens}
    if options.get("tool_choice") is not None:
        body["tool_choice"] = options["tool_choice"]
    if options.get("stop"):
        body["stop"] = list(options["stop"])
    if llm.seed is not None:
        body["seed"] = llm.seed
    return body


def _first_model(listed: Mapping[str, Any]) -> str:
    models = [m.get("id") for m in listed.get("data", ()) if m.get("id")]
    if not models:
        raise UserError("the proxy serves no model: give FlowliftChat(model=...)",
                        param="model")
    return str(models[0])


def default_model(base_url: str, headers: dict[str, str]) -> str:
    """The proxy's first served model (``GET /v1/models``): the model of a call with
    tools when ``FlowliftChat.model`` is None (a step would take the proxy's default).

    Raises:
        UserError: the proxy serves none; UpstreamError, ProxyUnavailable: as
            :func:`post_sync`.
    """
    try:
        return _first_model(_checked(httpx.get(f"{base_url}/v1/models", headers=headers,
                                               timeout=30)))
    except httpx.TransportError as exc:
        raise ProxyUnavailable(base_url, str(exc)) from exc


async def default_model_async(base_url: str, headers: dict[str, str]) -> str:
    """:func:`default_model` without blocking the event loop."""
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            return _first_model(_checked(await client.get(f"{base_url}/v1/models",
                                                          headers=headers)))
    except httpx.TransportError as exc:
        raise ProxyUnavailable(base_url, str(exc)) from exc


def _checked(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code >= 400:
        raise UpstreamError(f"the proxy answered {resp.status_code}: {resp.text[:500]}",
                            status=resp.status_code, body=resp.content, retryable=False)
    data: dict[str, Any] = resp.json()
    return data


def post_sync(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """POST ``body`` to ``url``; the JSON answer.

    Raises:
        UpstreamError: an error status; ProxyUnavailable: no answer.
    """
    try:
        return _checked(httpx.post(url, json=body, headers=headers, timeout=TIMEOUT_S))
    except httpx.TransportError as exc:
        raise ProxyUnavailable(url, str(exc)) from exc


async def post_async(url: str, body: dict[str, Any], headers: dict[str, str],
                     ) -> dict[str, Any]:
    """:func:`post_sync` without blocking the event loop."""
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            return _checked(await client.post(url, json=body, headers=headers))
    except httpx.TransportError as exc:
        raise ProxyUnavailable(url, str(exc)) from exc


def _args(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_answer(data: Mapping[str, Any]) -> ChatResult:
    """A chat completion as LangChain's result: an ``AIMessage`` with its text and
    ``tool_calls`` (``args`` parsed from the JSON ``arguments``)."""
    message = data["choices"][0]["message"]
    calls = [{"name": c["function"]["name"], "args": _args(c["function"]["arguments"]),
              "id": c["id"], "type": "tool_call"} for c in message.get("tool_calls") or ()]
    ai = AIMessage(content=message.get("content") or "", tool_calls=calls,
                   response_metadata={"finish_reason": data["choices"][0].get(
                       "finish_reason"), "model_name": data.get("model")},
                   usage_metadata=_usage(data.get("usage")))
    return ChatResult(generations=[ChatGeneration(message=ai)])


def _usage(usage: Mapping[str, Any] | None) -> Any:
    if not usage:
        return None
    return {"input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
            "total_tokens": usage.get("total_tokens", 0)}


def _parse(schema: Any, text: str) -> Any:
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_validate_json(text)
    if isinstance(schema, Mapping):
        return json.loads(text)
    return text


def structured_parser(schema: Any) -> RunnableLambda[BaseMessage, Any]:
    """Reads a structured step's answer into ``schema``: outside a workflow the text is
    the value; inside one it is the step's marker, whose value is awaited
    (:func:`flowlift.sdk.langchain.areveal`)."""
    from flowlift.sdk.langchain import areveal, reveal
    from flowlift.sdk.workflow import current_workflow

    def parse(message: BaseMessage) -> Any:
        text = str(message.content)
        return _parse(schema, reveal(text) if current_workflow() is not None else text)

    async def aparse(message: BaseMessage) -> Any:
        text = str(message.content)
        return _parse(schema, await areveal(text) if current_workflow() is not None
                      else text)

    return RunnableLambda(parse, afunc=aparse)
