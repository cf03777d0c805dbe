"""Agent steps on the SDK side: ``@step(tools=[...], max_turns=N)``.

The listed ``@tool`` functions become the step's tool definitions on the wire
(:class:`~flowlift.graph.ToolSpec`): the name, the docstring as the description, and a
JSON Schema of the arguments made by pydantic from the signature (``TypeAdapter`` of the
function: annotations, defaults, ``Annotated[..., Field(description=...)]``). The proxy
runs the loop; when its model calls a tool, the proxy sends ``tool.wanted`` with the
call's own id (``<step id>:call_<n>``) and ``agent_step``, and the SDK runs the function
with the arguments validated into its annotated types (``pydantic.validate_call``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from pydantic import PydanticSchemaGenerationError, TypeAdapter, ValidationError, validate_call

from flowlift.errors import UserError
from flowlift.graph import ToolSpec

if TYPE_CHECKING:
    from flowlift.sdk.steps import Tool
    from flowlift.sdk.workflow import Workflow

_NOT_BY_NAME = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)


def tool_spec(tool: Tool[Any, Any]) -> ToolSpec:
    """The wire definition of a ``@tool`` a model may call.

    Raises:
        UserError: the function takes positional-only or ``*args`` parameters (a model
            passes arguments by name), or pydantic cannot describe an annotation.
    """
    fn = tool.fn
    for p in inspect.signature(fn).parameters.values():
        if p.kind in _NOT_BY_NAME:
            raise UserError(f"tool {tool.name!r}: parameter {p.name!r} cannot be passed by "
                            "name; a model calls tools with named arguments",
                            param="tools")
    try:
        schema = TypeAdapter(cast(Any, fn)).json_schema()  # a function: its arguments
    except (PydanticSchemaGenerationError, TypeError, NameError) as exc:
        raise UserError(f"tool {tool.name!r}: its arguments have no JSON Schema ({exc}); "
                        "annotate them with JSON-able types or pydantic models defined "
                        "at module level", param="tools") from None
    try:
        return ToolSpec(name=tool.name, description=inspect.getdoc(fn) or "",
                        parameters=schema)
    except ValidationError as exc:
        raise UserError(f"tool {tool.name!r}: {exc.errors(include_url=False)[0]['msg']} "
                        "(a tool name is 1-64 letters, digits, _ or -)",
                        param="tools") from None


def agent_tools(tools: Sequence[Any], step_name: str
                ) -> tuple[dict[str, Tool[Any, Any]], tuple[ToolSpec, ...]]:
    """``(name -> callable tool, wire definitions)`` of a step's ``tools=[...]``; the
    callable tools validate their JSON arguments into the annotated types.

    Raises:
        UserError: an entry is not a ``@tool``, two share a name, or :func:`tool_spec`
            refuses one.
    """
    from flowlift.sdk.steps import Tool

    if not tools:
        raise UserError(f"step {step_name!r}: tools=[] lists no tool; leave `tools` out "
                        "for a step without tools", param="tools")
    callables: dict[str, Tool[Any, Any]] = {}
    specs = []
    for t in tools:
        if not isinstance(t, Tool):
            raise UserError(f"step {step_name!r}: tools=[...] takes @tool functions, not "
                            f"{t!r}; decorate it with @tool", param="tools")
        if t.name in callables:
            raise UserError(f"step {step_name!r}: two tools are named {t.name!r}",
                            param="tools")
        specs.append(tool_spec(t))
        callables[t.name] = Tool(validate_call(t.fn), t.name)
    return callables, tuple(specs)


def wanted_call(wf: Workflow, data: Mapping[str, Any]) -> dict[str, Any]:
    """Make an agent step's ``tool.wanted`` runnable as any other: the call id gets its
    tool in ``wf.tools``; returns the call's keyword arguments."""
    wf.tools[data["step_id"]] = wf.agent_tools[data["agent_step"]][data["name"]]
    return dict(data["kwargs"])
