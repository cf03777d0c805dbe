"""Tool calling on the embedded engine, built on structured outputs.

The engine has no native tool-call format, so flowlift makes one:

* the tool definitions are rendered into the system message (:meth:`ToolPlan.system_text`);
* generation is constrained to a JSON Schema (:meth:`ToolPlan.schema`):
  ``{"tool_calls": [{"name": <a tool's name>, "arguments": <its parameters>}, ...]}``
  for ``tool_choice: "required"`` or a named function (``maxItems: 1`` when
  ``parallel_tool_calls`` is false, only that function when one is named), and for
  ``"auto"`` (the default) either that or ``{"content": <the answer>}``;
* :class:`~flowlift.proxy.wire.tool_output.ToolOutputDecoder` turns the
  constrained JSON into OpenAI ``tool_calls`` (``id: "call_..."``, ``type: "function"``,
  ``function: {name, arguments}`` with ``arguments`` a JSON string) or into plain
  content. Content of an ``"auto"`` answer is decoded while it streams; tool calls
  stream as they are generated (a call's name, then its arguments' text:
  :mod:`flowlift.proxy.wire.call_deltas`).

Conversation history with tool calls (assistant messages carrying ``tool_calls``, and
``role: "tool"`` results) is rendered into plain system/user/assistant text, in the same
JSON form the model is asked to produce (:func:`engine_messages`), so any chat template
takes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flowlift.local_engine.base import ChatMessage, ToolDef
from flowlift.local_engine.base import ToolCall as EngineCall


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    """A tool call in the conversation history (an earlier assistant message)."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One chat message: ``content`` text (or text parts); an assistant message may carry
    ``tool_calls``; a ``tool`` message answers the call named by ``tool_call_id``."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it "
                             "answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _a_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_schema(value)
        return value


def check_schema(schema: dict[str, Any]) -> None:
    """Raise ``ValueError`` (what pydantic reports with the field's path) for a
    document that is not a JSON Schema (draft 2020-12)."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(top)"
        raise ValueError(f"not a valid JSON Schema at {where}: {exc.message}") from None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    function: FunctionDef

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"tool type {value!r} is not supported by the embedded "
                             'engine; describe the tool as {"type": "function", '
                             '"function": {"name", "description", "parameters"}}')
        return value


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request uses its tools.

    Attributes:
        tools: the tools the model may call (only the named one for a named choice).
        mode: ``"auto"`` (content or calls) or ``"required"`` (calls only).
        parallel: more than one call allowed.
        content_schema: schema of the ``content`` of an ``"auto"`` answer (a string,
            or the ``response_format`` schema).
    """

    tools: tuple[Tool, ...]
    mode: Literal["auto", "required"]
    parallel: bool = True
    content_schema: dict[str, Any] | None = None

    @property
    def text_content(self) -> bool:
        """Whether an ``"auto"`` answer's content is plain text (decoded as it streams)."""
        return self.mode == "auto" and (self.content_schema or {}).get("type") == "string"

    def schema(self) -> dict[str, Any]:
        """The JSON Schema the output is constrained to (see the module docstring)."""
        defs: dict[str, Any] = {}
        variants = []
        for tool in self.tools:
            fn = tool.function
            params = _hoist_defs(fn.parameters or {"type": "object", "properties": {}},
                                 f"{fn.name}__", defs)
            variants.append({"type": "object", "additionalProperties": False,
                             "properties": {"name": {"const": fn.name}, "arguments": params},
                             "required": ["name", "arguments"]})
        calls: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": variants[0] if len(variants) == 1
                                 else {"anyOf": variants}}
        if not self.parallel:
            calls["maxItems"] = 1
        out: dict[str, Any] = {"type": "object", "additionalProperties": False,
                               "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
        if self.mode == "auto":
            content = {"type": "object", "additionalProperties": False,
                       "properties": {"content": self.content_schema or {"type": "string"}},
                       "required": ["content"]}
            out = {"anyOf": [out, content]}
        return {**out, "$defs": defs} if defs else out

    def system_text(self) -> str:
        """The instructions and tool definitions added to the system message."""
        how = ('{"tool_calls": [{"name": <function name>, "arguments": {<arguments>}}]}')
        many = "one or more of these functions" if self.parallel else "one of these functions"
        if self.mode == "auto":
            head = (f"You can call {many}. Answer with one JSON object: either "
                    f'{{"content": <your answer>}} to answer directly, or {how} to call '
                    "functions; their results come back in the next message.")
        else:
            head = f"Call {many} now. Answer with one JSON object: {how}."
        lines = [head, "Functions:"]
        for tool in self.tools:
            fn = tool.function
            params = json.dumps(fn.parameters or {"type": "object", "properties": {}})
            lines.append(f"- {fn.name}: {fn.description or '(no description)'} "
                         f"Arguments (JSON Schema): {params}")
        return "\n".join(lines)


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None,
               content_schema: dict[str, Any] | None) -> ToolPlan | None:
    """The :class:`ToolPlan` of a request, or ``None`` when it uses no tools (none given,
    or ``tool_choice: "none"``).

    Raises:
        ValueError: ``tool_choice`` names a function that is not in ``tools``, or is
            set without tools (the message says which).
    """
    if not tools:
        if choice is not None and choice != "none":
            raise ValueError("tool_choice needs tools; send the functions in `tools`")
        return None
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            names = ", ".join(t.function.name for t in tools)
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which "
                             f"is not in tools ({names})")
        return ToolPlan(tuple(named), "required", parallel is not False)
    return ToolPlan(tuple(tools), "required" if choice == "required" else "auto",
                    parallel is not False, content_schema or {"type": "string"})


def conversation(messages: list[Message]) -> list[ChatMessage]:
    """The conversation as engine messages that keep their tool calls and results
    (``developer`` becomes ``system``): what a turn with tools is built from, in either
    tool format (:func:`flowlift.proxy.dispatch.tool_turns.tool_generate`)."""
    return [ChatMessage("system" if m.role == "developer" else m.role, m.text(),
                        tool_calls=tuple(EngineCall(c.id, c.function.name,
                                                    c.function.arguments)
                                         for c in m.tool_calls or ()),
                        tool_call_id=m.tool_call_id) for m in messages]


def tool_defs(tools: tuple[Tool, ...]) -> tuple[ToolDef, ...]:
    """The engine's definitions of OpenAI ``tools``."""
    return tuple(ToolDef(t.function.name, t.function.description or "",
                         t.function.parameters or {"type": "object", "properties": {}})
                 for t in tools)


def engine_messages(messages: list[Message], plan: ToolPlan | None) -> list[ChatMessage]:
    """The conversation as plain-text chat messages for the engine's chat template:
    ``developer`` becomes ``system``; the tool definitions join the first system message
    (or start one); assistant tool calls become their JSON text; consecutive ``tool``
    results become one ``user`` message naming each call."""
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    out: list[ChatMessage] = []
    for m in messages:
        if m.role == "tool":
            result = (f"Result of {names.get(m.tool_call_id or '', 'the function')} "
                      f"(call {m.tool_call_id}):\n{m.text()}")
            if out and out[-1].role == "user" and out[-1].content.startswith("Result of "):
                result = f"{out.pop().content}\n\n{result}"
            out.append(ChatMessage("user", result))
        elif m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}
                     for c in m.tool_calls]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append(ChatMessage("assistant", f"{m.text()}\n{text}".lstrip("\n")))
        else:
            out.append(ChatMessage("system" if m.role == "developer" else m.role, m.text()))
    if plan is not None:
        if out and out[0].role == "system":
            out[0] = ChatMessage("system", f"{out[0].content}\n\n{plan.system_text()}")
        else:
            out.insert(0, ChatMessage("system", plan.system_text()))
    return out

def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _hoist_defs(schema: Any, prefix: str, defs: dict[str, Any]) -> Any:
    """``schema`` with its ``$defs``/``definitions`` moved into ``defs`` (names
    prefixed) and its ``$ref``s rewritten, so it can sit inside a larger schema."""
    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                for root in ("#/$defs/", "#/definitions/"):
                    if value.startswith(root):
                        value = f"#/$defs/{prefix}{value[len(root):]}"
                out[key] = value
            else:
                out[key] = rewrite(value)
        return out

    if not isinstance(schema, dict):
        return schema
    for key in ("$defs", "definitions"):
        found = schema.get(key)
        for name, sub in (found if isinstance(found, dict) else {}).items():
            defs[f"{prefix}{name}"] = rewrite(sub)
    return rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
