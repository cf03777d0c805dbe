"""Agent steps on the SDK side: ``@step(tools=[...], max_turns=N)``.

The listed ``@tool`` functions become the step's tool definitions on the wire
(:class:`~flowlift.graph.ToolSpec`): the name, the docstring as the description, and a
JSON Schema of the arguments made by pydantic from the signature (``TypeAdapter`` of the
function: annotations, defaults, ``Annotated[..., Field(description=...)]``). The proxy
runs the loop; when its model calls a tool, the proxy sends ``tool.wanted`` with the
call's own id (``<step id>:call_<n>``) and ``agent_step``, and the SDK runs the function
with the arguments validated into its annotated types (``pydantic.validate_call``).

A step may also name tools the proxy runs itself (:func:`proxy_tool`, a ``[tools.*]``
server of the proxy's config: :mod:`flowlift.proxy.tools`), mixed with ``@tool``
functions: on the wire they are a :class:`~flowlift.graph.ToolSpec` with ``server`` set,
and the proxy fills in their description and schema from the server.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError, validate_call

from flowlift.errors import UserError
from flowlift.graph import ToolSpec
from flowlift.tool_schema import NoSchema, function_schema

if TYPE_CHECKING:
    from flowlift.sdk.steps import Tool
    from flowlift.sdk.workflow import Workflow

_PROXY_TOOL = re.compile(r"([A-Za-z0-9_-]{1,64})\.([a-zA-Z0-9_-]{1,64})")


@dataclass(frozen=True, slots=True)
class ProxyTool:
    """A tool the proxy runs itself: ``name`` of the proxy's ``[tools.<server>]``
    (made by :func:`proxy_tool`)."""

    server: str
    name: str

    def spec(self) -> ToolSpec:
        """Its wire definition (the proxy describes it when the graph is submitted)."""
        return ToolSpec(name=self.name, server=self.server)


def proxy_tool(ref: str) -> ProxyTool:
    """Name a tool the proxy runs itself, for ``@step(tools=[...])``.

    Args:
        ref: ``"server.tool"``: a ``[tools.<server>]`` of the proxy's config file (an
            MCP server or configured Python callables) and one of its tools.

    Returns:
        A :class:`ProxyTool`, mixable with ``@tool`` functions in ``tools=[...]``.

    Raises:
        UserError: ``ref`` is not ``server.tool`` (each part 1-64 letters, digits, _ or
            -). An unknown server or tool is the proxy's answer, when the workflow runs
            (an invalid graph, HTTP 400).
    """
    match = _PROXY_TOOL.fullmatch(ref) if isinstance(ref, str) else None
    if match is None:
        raise UserError(f"proxy_tool({ref!r}): name a tool as \"server.tool\" (the "
                        "proxy's [tools.<server>] and one of its tools; each part 1-64 "
                        "letters, digits, _ or -)", param="tools")
    return ProxyTool(match[1], match[2])


def tool_spec(tool: Tool[Any, Any]) -> ToolSpec:
    """The wire definition of a ``@tool`` a model may call.

    Raises:
        UserError: the function takes positional-only or ``*args`` parameters (a model
            passes arguments by name), or pydantic cannot describe an annotation.
    """
    fn = tool.fn
    try:
        schema = function_schema(fn)
    except NoSchema as exc:
        raise UserError(f"tool {tool.name!r}: {exc}", param="tools") from None
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
        UserError: an entry is not a ``@tool`` or :func:`proxy_tool`, two share a
            name, or :func:`tool_spec` refuses one.
    """
    from flowlift.sdk.steps import Tool

    if not tools:
        raise UserError(f"step {step_name!r}: tools=[] lists no tool; leave `tools` out "
                        "for a step without tools", param="tools")
    callables: dict[str, Tool[Any, Any]] = {}
    specs: list[ToolSpec] = []
    for t in tools:
        if not isinstance(t, Tool | ProxyTool):
            raise UserError(f"step {step_name!r}: tools=[...] takes @tool functions and "
                            f"flowlift.proxy_tool(\"server.tool\"), not {t!r}; decorate "
                            "it with @tool", param="tools")
        if any(s.name == t.name for s in specs):
            raise UserError(f"step {step_name!r}: two tools are named {t.name!r} (the "
                            "model calls tools by name)", param="tools")
        if isinstance(t, ProxyTool):
            specs.append(t.spec())
            continue
        specs.append(tool_spec(t))
        callables[t.name] = Tool(validate_call(t.fn), t.name)
    return callables, tuple(specs)


def wanted_call(wf: Workflow, data: Mapping[str, Any]) -> dict[str, Any]:
    """Make an agent step's ``tool.wanted`` runnable as any other: the call id gets its
    tool in ``wf.tools``; returns the call's keyword arguments."""
    wf.tools[data["step_id"]] = wf.agent_tools[data["agent_step"]][data["name"]]
    return dict(data["kwargs"])
