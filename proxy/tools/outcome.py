"""What one proxy-run tool call gives back, and the shape every tool server has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from flowlift.graph import render_value


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """A call's result: ``value`` (any JSON) or ``error`` (its text, for the model or
    for ``tool_errors="raise"``), as a ``tool.result`` event records it."""

    value: Any = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ServerTool:
    """One tool a server offers: what the model sees of it, and its MCP ``annotations``
    (``readOnlyHint``, ``idempotentHint``...; None: it declares none)."""

    name: str
    description: str
    parameters: dict[str, Any]
    annotations: dict[str, Any] | None = None


class ToolServer(Protocol):
    """A ``[tools.<name>]`` server: its tools, and one call (no timeout of its own: the
    registry bounds every call, :meth:`~flowlift.proxy.tools.registry.ToolServers.call`)."""

    async def tools(self) -> dict[str, ServerTool]:
        """Tool name -> its definition (an MCP server: its ``tools/list``)."""
        ...

    async def call(self, name: str, args: dict[str, Any]) -> ToolOutcome:
        """Run tool ``name``; a failure of the tool is an outcome with ``error``."""
        ...

    async def aclose(self) -> None:
        """Stop it (a stdio server's process ends)."""
        ...


def bounded(outcome: ToolOutcome, label: str, max_bytes: int) -> ToolOutcome:
    """``outcome``, or an error when its value's text (what the model would read) is
    longer than ``max_bytes`` UTF-8 bytes: a refused result, never a cut one (a cut JSON
    value misleads the model)."""
    if outcome.error is not None:
        if len(outcome.error.encode()) > max_bytes:
            return ToolOutcome(error=outcome.error.encode()[:max_bytes].decode(
                errors="ignore") + " [error text cut at max_result_bytes]")
        return outcome
    size = len(render_value(outcome.value).encode())
    if size <= max_bytes:
        return outcome
    return ToolOutcome(error=f"the result of {label} was {size} bytes, over the proxy's "
                             f"max_result_bytes={max_bytes} for this tool server; ask for "
                             "less (a narrower query, a page, a summary)")
