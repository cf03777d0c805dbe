"""The Responses API request as flowlift reads it (OpenAI's ``CreateResponse``), and the
input items it takes.

Input items: messages (``{"role", "content"}``, ``type: "message"`` optional; content a
string or ``input_text`` / ``output_text`` parts), ``function_call`` (an earlier call of
the model, replayed) and ``function_call_output`` (a tool's result, ``call_id`` naming
the call). Tools: ``{"type": "function", "name", "description", "parameters"}``.
Request fields: those of OpenAI's ``CreateResponse`` that flowlift acts on are
:class:`ResponsesRequest`'s; :data:`IGNORED` lists the ones it accepts and ignores
(documented in docs/responses.md), :data:`REFUSED` those it takes only at their default;
any other field is a 400 naming it (:func:`check_fields`), never silently dropped. A
field or item the proxy cannot honour is a 400 naming it (:mod:`.translation`).
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flowlift.errors import RequestError

IGNORED = frozenset({"include", "reasoning", "service_tier", "prompt_cache_key",
                     "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
                     "top_logprobs", "stream_options", "moderation", "context_management"})
"""``CreateResponse`` fields accepted and ignored: hints about OpenAI's own service
(tiers, caching keys, moderation, reasoning effort, extra ``include`` data) that change
nothing in the answer a flowlift backend gives."""
REFUSED: dict[str, tuple[Any, ...]] = {"background": (None, False), "conversation": (None,),
                                        "prompt": (None,)}
"""``CreateResponse`` fields taken only at these values (background mode, the
Conversations API and stored prompt templates are not served)."""


def new_id(prefix: str) -> str:
    """A fresh OpenAI-style id: ``resp_``, ``msg_``, ``fc_`` or ``call_`` and 48 hex digits
    (192 random bits: unguessable, so an id alone is no way into another's response)."""
    return f"{prefix}_{secrets.token_hex(24)}"


class InputText(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    """``EasyInputMessage`` / ``InputMessage`` / an earlier ``OutputMessage``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = "{}"


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    """The fields of ``POST /v1/responses`` flowlift acts on (OpenAI's names, ranges and
    meanings); ``input`` and ``tools`` are checked item by item in :mod:`.translation`."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)


_ACTED_ON = frozenset(ResponsesRequest.model_fields)


def check_fields(data: dict[str, Any]) -> None:
    """Refuse a request field flowlift neither acts on nor lists as ignored.

    Raises:
        RequestError: an unknown field, or one of :data:`REFUSED` at another value
            (``param``: the field).
    """
    for key, value in data.items():
        if key in _ACTED_ON or key in IGNORED:
            continue
        if key in REFUSED:
            if value in REFUSED[key]:
                continue
            raise RequestError(f"{key}={value!r} is not supported by flowlift's Responses "
                               "API; leave it out", param=key)
        raise RequestError(f"unknown field {key!r} in the responses request (flowlift acts "
                           f"on {', '.join(sorted(_ACTED_ON))}; ignores "
                           f"{', '.join(sorted(IGNORED))})", param=key)
