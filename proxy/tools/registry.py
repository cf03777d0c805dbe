"""The proxy's tool servers (``[tools.*]`` of the config) and the two things the rest of
the proxy asks of them: fill in a submitted graph's proxy tools, and run one call.

:meth:`ToolServers.resolve` (at ``POST /v1/workflows``): each tool of an agent step
with ``server`` set must name a configured server the request's tenant reaches and a
tool that server lists and ``allow``\\s; its ``description`` and ``parameters`` are
replaced by the server's own (what the model sees and what :func:`check_call` checks).
Every problem is listed at once (``GraphError``, HTTP 400 naming the node and field).
Nodes appended to an open run go through the same (:meth:`ToolServers.resolve_appended`).

:meth:`ToolServers.call` (from the agent loop): the tool runs under its server's
``timeout_s`` and its result is bounded by ``max_result_bytes``; whatever goes wrong
(unknown server after a config change, a dead or hung server, a tool that raised, a
result too large) is an outcome with ``error``, never an exception: the run goes on.

:meth:`ToolServers.check` (at start, then again while one fails): each server is asked
for its tools; :meth:`ToolServers.problems` names those that cannot start or answer and
why, which ``/readyz`` reports (503) and a graph naming such a server is refused with,
once per server (issue 38, item 7).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from flowlift.errors import GraphError
from flowlift.graph import Graph, LLMNode, ToolSpec
from flowlift.proxy.config import ToolServerSpec
from flowlift.proxy.tenants import Tenant
from flowlift.proxy.tools.callables import CallableServer
from flowlift.proxy.tools.mcp_server import McpServer, ServerUnreachable, reason_of
from flowlift.proxy.tools.outcome import ServerTool, ToolOutcome, ToolServer, bounded


def make_server(name: str, spec: ToolServerSpec) -> ToolServer:
    """The server a ``[tools.<name>]`` describes (callables are imported now).

    Raises:
        ConfigError: a callable does not load or cannot be described.
    """
    if spec.callables is not None:
        return CallableServer(name, spec.callables)
    return McpServer(name, spec)


class ToolServers:
    """Every ``[tools.*]`` server of one proxy.

    Args:
        specs: server name -> its config.
        servers: server name -> the server (tests inject their own), one per name of
            ``specs``; default: made from ``specs`` by :func:`make_server`.
    """

    def __init__(self, specs: Mapping[str, ToolServerSpec],
                 servers: Mapping[str, ToolServer] | None = None) -> None:
        self.specs = dict(specs)
        self.servers = dict(servers) if servers is not None else {
            name: make_server(name, spec) for name, spec in self.specs.items()}
        self._notes: dict[tuple[str, str], dict[str, Any]] = {}  # MCP tool annotations

        self.failing: dict[str, str] = {}
        """Server name -> why it could not start or answer the last time it was asked."""

    async def check(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Ask each server (``names``; default: all) for its tools, concurrently, and
        keep what fails (:attr:`failing`).

        Returns:
            Server name -> why it cannot be used, for those that failed now.
        """
        names = list(self.servers) if names is None else list(names)
        found = await asyncio.gather(*(self.servers[n].tools() for n in names),
                                     return_exceptions=True)
        for name, result in zip(names, found, strict=True):
            self._note(name, result if isinstance(result, BaseException) else None)
        return {n: self.failing[n] for n in names if n in self.failing}

    def _note(self, name: str, exc: BaseException | None) -> None:
        if exc is None:
            self.failing.pop(name, None)
        else:
            self.failing[name] = str(exc) if isinstance(exc, ServerUnreachable) else \
                reason_of(exc)

    def problems(self) -> str | None:
        """Why some servers cannot be used (naming each), or None."""
        if not self.failing:
            return None
        return "; ".join(f"tool server {name!r} cannot be used: {why}"
                         for name, why in sorted(self.failing.items()))

    def __bool__(self) -> bool:
        return bool(self.servers)

    async def resolve(self, graph: Graph, tenant: Tenant | None) -> Graph:
        """``graph`` with its proxy tools described by their servers.

        Raises:
            GraphError: every proxy tool that names an unknown server or tool, a server
                the tenant does not reach, a tool not allowed, or a server that cannot
                be reached.
        """
        problems: list[str] = []
        nodes = []
        down: dict[str, str] = {}  # servers found unreachable now: asked once per graph
        for node in graph.nodes:
            if isinstance(node, LLMNode) and any(t.server for t in node.tools or ()):
                tools = [await self._describe(node.id, i, t, tenant, problems, down)
                         for i, t in enumerate(node.tools or ())]
                node = node.model_copy(update={"tools": tuple(tools)})
            nodes.append(node)
        if problems:
            raise GraphError(problems)
        if nodes == list(graph.nodes):
            return graph
        return graph.model_copy(update={"nodes": tuple(nodes)})

    async def resolve_appended(self, data: Any, tenant: Tenant | None) -> Any:
        """The body of an append to an open run (``{"nodes": [...], ...}``) with its
        proxy tools described, as :meth:`resolve` does for a whole graph; a body whose
        nodes do not parse is returned as it is (the append reports its problems).

        Raises:
            GraphError: as :meth:`resolve`.
        """
        nodes = data.get("nodes") if isinstance(data, dict) else None
        if not isinstance(nodes, list) or not nodes:
            return data
        try:
            graph = Graph.model_validate({"nodes": nodes})
        except ValidationError:
            return data
        resolved = await self.resolve(graph, tenant)
        if resolved is graph:
            return data
        return {**data, "nodes": [n.model_dump(mode="json", by_alias=True)
                                  for n in resolved.nodes]}

    async def _describe(self, step: str, index: int, tool: ToolSpec, tenant: Tenant | None,
                        problems: list[str], down: dict[str, str]) -> ToolSpec:
        server = tool.server
        if server is None:
            return tool
        where = f"node {step!r} tools.{index} ({server}.{tool.name})"
        if server not in self.servers or server not in self.specs:
            problems.append(f"{where}: the proxy has no tool server {server!r} "
                            f"(configured: {', '.join(sorted(self.servers)) or 'none'}; "
                            f"add [tools.{server}] to its config)")
            return tool
        if tenant is not None and not tenant.reaches(server):
            problems.append(f"{where}: tenant {tenant.name!r} may not use tool server "
                            f"{server!r} (add it to [tenants.{tenant.name}] tools)")
            return tool
        if server in down:  # (named once: every tool of it fails the same way)
            return tool
        try:
            found = await self._lookup(server, tool.name)
        except ServerUnreachable as exc:
            self._note(server, exc)
            down[server] = str(exc)
            problems.append(f"{where}: tool server {server!r} cannot be reached: {exc}")
            return tool
        self._note(server, None)
        if isinstance(found, str):
            problems.append(f"{where}: {found}")
            return tool
        return tool.model_copy(update={"description": found.description,
                                       "parameters": found.parameters})

    async def _lookup(self, server: str, name: str) -> ServerTool | str:
        """The tool, or why it cannot be named."""
        listing = await self.servers[server].tools()
        allow = self.specs[server].allow
        offered = sorted(n for n in listing if allow is None or n in allow)
        if name not in listing:
            return (f"tool server {server!r} has no tool {name!r} (it offers: "
                    f"{', '.join(offered) or 'none'})")
        if name not in offered:
            return (f"tool {name!r} of server {server!r} is not in its allow list "
                    f"([tools.{server}] allow = {allow})")
        self._notes[server, name] = listing[name].annotations or {}
        return listing[name]

    def starts_early(self, server: str, name: str) -> bool:
        """Whether a call of ``server``'s tool ``name`` may start while the model's turn
        still streams (before the turn is known to end well): per the server's
        ``early`` setting; by default only for a tool its server annotates
        ``readOnlyHint`` or ``idempotentHint`` (MCP tool annotations, read when a graph
        named it), since a turn that then fails or is cut off may never have meant it."""
        spec = self.specs.get(server)
        if spec is None or spec.early == "never":
            return False
        if spec.early == "always":
            return True
        notes = self._notes.get((server, name)) or {}
        return bool(notes.get("readOnlyHint") or notes.get("idempotentHint"))

    async def call(self, server: str, name: str, args: dict[str, Any]) -> ToolOutcome:
        """Run ``server``'s tool ``name`` with ``args`` (already checked against its
        schema), bounded by the server's ``timeout_s`` and ``max_result_bytes``."""
        spec, found = self.specs.get(server), self.servers.get(server)
        if spec is None or found is None:  # a resumed run after a config change
            return ToolOutcome(error=f"the proxy has no tool server {server!r} any more")
        if spec.allow is not None and name not in spec.allow:
            return ToolOutcome(error=f"tool {name!r} of server {server!r} is not allowed")
        try:
            async with asyncio.timeout(spec.timeout_s):
                outcome = await found.call(name, args)
        except TimeoutError:
            return ToolOutcome(error=f"{server}.{name} did not answer within its "
                                     f"timeout_s={spec.timeout_s:g}")
        return bounded(outcome, f"{server}.{name}", spec.max_result_bytes)

    async def aclose(self) -> None:
        """Stop every server (stdio processes end); at proxy shutdown."""
        await asyncio.gather(*(s.aclose() for s in self.servers.values()),
                             return_exceptions=True)
