"""Hosted MCP tools in the Responses API: ``tools: [{"type": "mcp", ...}]`` as OpenAI
defines them (``MCPTool`` in OpenAI's OpenAPI description), run by the proxy.

A request's MCP tool names a server by ``server_label`` (a ``[tools.<label>]`` of the
proxy's config) or by ``server_url``, which must be the ``url`` of a configured server
(the proxy connects to no other address: a URL the config does not name is a 403, as
is a server the request's tenant may not reach, ``[tenants.*] tools``). ``headers``
(and ``authorization``, sent as ``Authorization: Bearer ...``) go to that server on a
connection of the request's own, closed when the request ends. ``allowed_tools`` (a
list of names or ``{"tool_names": [...]}``) narrows what the server's config
``allow``\\s. ``require_approval`` must be ``"never"`` (spelled out: its default is
``"always"``): approval round trips (``mcp_approval_request`` items) are not served,
and a request that asks for them is a 400 rather than a call run without approval.

:func:`resolve` lists each server's tools (the response's ``mcp_list_tools`` items)
and returns :class:`Hosted`: the tools as chat function tools for the model, and
:meth:`Hosted.call` to run one call under its server's ``timeout_s`` and
``max_result_bytes`` (:meth:`flowlift.proxy.tools.registry.ToolServers.call`).

Source: OpenAI's "Remote MCP" guide and ``MCPTool`` / ``MCPListTools`` / ``MCPToolCall``
schemas (openai-openapi.yaml).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flowlift.errors import PermissionDenied, RequestError, ToolServerUnavailable
from flowlift.graph import render_value
from flowlift.proxy.openai.responses.translation import parsed
from flowlift.proxy.tenants import Tenant
from flowlift.proxy.tools.mcp_server import McpServer, ServerUnreachable
from flowlift.proxy.tools.outcome import ServerTool
from flowlift.proxy.tools.registry import ToolServers


class McpToolSpec(BaseModel):
    """One ``{"type": "mcp", ...}`` entry of ``tools`` (the fields flowlift acts on)."""

    model_config = ConfigDict(extra="allow")
    type: str
    server_label: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    server_url: str | None = None
    headers: dict[str, str] | None = None
    authorization: str | None = None
    allowed_tools: list[str] | dict[str, Any] | None = None
    require_approval: str | dict[str, Any] | None = "always"
    server_description: str | None = None


@dataclass
class _Server:
    label: str
    registry: ToolServers  # the proxy's, or one of the request's own (headers)
    name: str  # the server's name in ``registry``
    owned: bool  # a connection of this request's: closed when it ends


@dataclass
class Hosted:
    """The hosted MCP tools of one request.

    Attributes:
        tools: tool name -> (its server, its definition), as the model sees them.
        listings: ``(server_label, MCPListToolsTool list)`` per server, in order.
    """

    tools: dict[str, tuple[_Server, ServerTool]] = field(default_factory=dict)
    listings: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    _servers: list[_Server] = field(default_factory=list)

    def labels(self) -> dict[str, str]:
        """Tool name -> its server's label (for the response's ``mcp_call`` items)."""
        return {name: server.label for name, (server, _) in self.tools.items()}

    def chat_tools(self) -> list[dict[str, Any]]:
        """The tools in the chat completions shape."""
        return [{"type": "function", "function": {
            "name": name, "description": tool.description, "parameters": tool.parameters}}
            for name, (_, tool) in self.tools.items()]

    async def call(self, name: str, arguments: str) -> tuple[str | None, dict[str, Any] | None]:
        """Run one call; ``(output text, None)`` or ``(None, MCPToolCallError)``."""
        server, _ = self.tools[name]
        try:
            args = json.loads(arguments or "{}")
        except ValueError as exc:
            return None, _error(f"the arguments are not JSON: {exc}")
        if not isinstance(args, dict):
            return None, _error("the arguments must be a JSON object")
        outcome = await server.registry.call(server.name, name, args)
        if outcome.error is not None:
            return None, _error(outcome.error)
        return render_value(outcome.value), None

    async def aclose(self) -> None:
        """Close the connections of this request's own (``headers``)."""
        for server in self._servers:
            if server.owned:
                await server.registry.aclose()


def _error(text: str) -> dict[str, Any]:
    return {"type": "mcp_tool_execution_error", "content": text}


def split(tools: list[dict[str, Any]] | None
          ) -> tuple[list[dict[str, Any]], list[tuple[int, McpToolSpec]]]:
    """``tools`` as (the others, the MCP ones with their index)."""
    others: list[dict[str, Any]] = []
    mcp: list[tuple[int, McpToolSpec]] = []
    for i, tool in enumerate(tools or ()):
        if isinstance(tool, dict) and tool.get("type") == "mcp":
            mcp.append((i, _parse(tool, i)))
        else:
            others.append(tool)
    return others, mcp


def _parse(tool: dict[str, Any], i: int) -> McpToolSpec:
    spec: McpToolSpec = parsed(McpToolSpec, tool, f"tools[{i}]")
    for key in ("connector_id", "tunnel_id"):
        if tool.get(key) is not None:
            raise RequestError(f"tools[{i}].{key}: connectors and tunnels are not served; "
                               "name a server of the proxy's [tools.*] config by "
                               "server_label or server_url", param=f"tools[{i}].{key}")
    if spec.require_approval != "never":
        raise RequestError(
            f"tools[{i}].require_approval={spec.require_approval!r}: flowlift runs hosted "
            "MCP calls without approval round trips (no mcp_approval_request items); send "
            'require_approval: "never" (its default is "always")',
            param=f"tools[{i}].require_approval")
    return spec


def _allowed(spec: McpToolSpec, i: int) -> set[str] | None:
    allowed = spec.allowed_tools
    if allowed is None or isinstance(allowed, list):
        return None if allowed is None else set(allowed)
    names = allowed.get("tool_names")
    if not isinstance(names, list) or set(allowed) - {"tool_names", "read_only"}:
        raise RequestError(f"tools[{i}].allowed_tools: send a list of tool names or "
                           '{"tool_names": [...]}', param=f"tools[{i}].allowed_tools")
    return set(names)


def _server_name(spec: McpToolSpec, i: int, registry: ToolServers) -> str:
    """The configured server ``spec`` names.

    Raises:
        PermissionDenied: a ``server_url`` no configured server has.
        RequestError: a label without a URL that names no configured server.
    """
    if spec.server_url is not None:
        url = spec.server_url.rstrip("/")
        named = [n for n, s in registry.specs.items()
                 if s.url is not None and s.url.rstrip("/") == url]
        if not named:
            raise PermissionDenied(
                f"tools[{i}].server_url {spec.server_url!r} is not a tool server this proxy "
                "allows: it connects only to the url of a [tools.*] server of its config",
                param=f"tools[{i}].server_url")
        return spec.server_label if spec.server_label in named else named[0]
    if spec.server_label not in registry.specs:
        raise RequestError(
            f"tools[{i}].server_label {spec.server_label!r} names no tool server of the "
            f"proxy (configured: {', '.join(sorted(registry.specs)) or 'none'}); give its "
            "server_url or a configured label", param=f"tools[{i}].server_label")
    return spec.server_label


async def resolve(entries: list[tuple[int, McpToolSpec]], registry: ToolServers,
                  tenant: Tenant | None, taken: set[str]) -> Hosted:
    """The servers and tools of ``entries`` (``split``'s), listed now.

    Args:
        taken: the request's function tool names (an MCP tool may not shadow one).

    Raises:
        PermissionDenied: a URL the config does not allow, a server the tenant does not
            reach (403).
        RequestError: an unknown label, a tool name used twice (400).
        ToolServerUnavailable: a server that cannot be reached or list its tools (424).
    """
    hosted = Hosted()
    try:
        for i, spec in entries:
            name = _server_name(spec, i, registry)
            if tenant is not None and not tenant.reaches(name):
                raise PermissionDenied(
                    f"tools[{i}]: tenant {tenant.name!r} may not use tool server {name!r} "
                    f"(add it to [tenants.{tenant.name}] tools)", param=f"tools[{i}]")
            server = _server(spec, name, registry)
            hosted._servers.append(server)
            await _list(hosted, server, spec, i, taken)
    except BaseException:
        await hosted.aclose()
        raise
    return hosted


def _server(spec: McpToolSpec, name: str, registry: ToolServers) -> _Server:
    headers = dict(spec.headers or {})
    if spec.authorization:
        headers["Authorization"] = f"Bearer {spec.authorization}"
    config = registry.specs[name]
    if not headers:
        return _Server(spec.server_label, registry, name, owned=False)
    if config.url is None:
        raise RequestError(f"headers are for a server reached by URL; {name!r} is not",
                           param="tools")
    own = config.model_copy(update={"headers": {**config.headers, **headers}})
    return _Server(spec.server_label, ToolServers({name: own}, {name: McpServer(name, own)}),
                   name, owned=True)


async def _list(hosted: Hosted, server: _Server, spec: McpToolSpec, i: int,
                taken: set[str]) -> None:
    try:
        listing = await server.registry.servers[server.name].tools()
    except ServerUnreachable as exc:
        raise ToolServerUnavailable(
            f"Error retrieving tool list from MCP server {spec.server_label!r}: {exc}",
            param=f"tools[{i}]") from None
    allow, wanted = server.registry.specs[server.name].allow, _allowed(spec, i)
    shown = []
    for tool in listing.values():
        if (allow is not None and tool.name not in allow) or (
                wanted is not None and tool.name not in wanted):
            continue
        if tool.name in taken or tool.name in hosted.tools:
            raise RequestError(f"tools[{i}]: tool name {tool.name!r} of MCP server "
                               f"{spec.server_label!r} is also another tool's name",
                               param=f"tools[{i}]")
        hosted.tools[tool.name] = (server, tool)
        shown.append({"name": tool.name, "description": tool.description or None,
                      "input_schema": tool.parameters, "annotations": tool.annotations})
    hosted.listings.append((spec.server_label, shown))
