"""An MCP server as a proxy tool server: the official ``mcp`` client (``mcp.Client``),
over Streamable HTTP (``url``) or stdio (``command``: the proxy starts the process).

One connection per server, opened on first use and shared by every call (MCP
multiplexes requests by id). The ``mcp`` client's transports live in anyio task groups
that must be entered and left by one task, so each connection is owned by a task of
its own (:class:`_Connection`) and calls go through its session from any task. A call
that fails below the tool (the process died, the HTTP server went away: ``MCPError``,
a transport error) marks the connection dead; the next call opens a new one. The
tools a server lists are read once per connection (``tools/list``).

Source: the Model Context Protocol specification, https://modelcontextprotocol.io/specification
(tools, Streamable HTTP and stdio transports).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters, get_default_environment

from flowlift.proxy.config import ToolServerSpec
from flowlift.proxy.tools.outcome import ServerTool, ToolOutcome

_BELOW_THE_TOOL = (Exception,)
"""What the ``mcp`` client raises when the server or its transport failed: ``MCPError``
("Connection closed"), its HTTP client's errors (``httpx2``), ``OSError``, anyio's
stream errors, a result that does not validate. All are translated here, the one
place, into a tool error (never :class:`asyncio.CancelledError`: not an ``Exception``)."""


class ServerUnreachable(Exception):
    """The MCP server could not be started or reached; ``str(exc)`` says why."""


def reason_of(exc: BaseException) -> str:
    """Why ``exc`` happened, for a person: the ``mcp`` client's anyio task groups wrap the
    cause in an ``ExceptionGroup`` ("unhandled errors in a TaskGroup"), so the groups
    are opened down to their leaves (each named once)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(dict.fromkeys(reason_of(e) for e in exc.exceptions))
    return f"{type(exc).__name__}: {exc}"


class _Connection:
    """One open ``mcp.Client``, owned by its own task until :meth:`close`."""

    def __init__(self, target: StdioServerParameters | str) -> None:
        self._target = target
        self._ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self.dead = False
        self._task = asyncio.create_task(self._own(), name="mcp connection")

    async def _own(self) -> None:
        try:
            async with Client(self._target) as client:
                self._ready.set_result(client)
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(ServerUnreachable(reason_of(exc)))
        finally:
            self.dead = True

    async def client(self, timeout_s: float) -> Client:
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(self._ready)
        except TimeoutError:
            await self.close()
            raise ServerUnreachable(f"no answer within connect_timeout_s={timeout_s:g}"
                                    ) from None

    async def close(self) -> None:
        self.dead = True
        self._stop.set()
        if not self._ready.done():
            self._task.cancel()
        with contextlib.suppress(BaseException):
            async with asyncio.timeout(5.0):
                await self._task
        if not self._task.done():
            self._task.cancel()


def _target(spec: ToolServerSpec) -> StdioServerParameters | str:
    if spec.url is not None:
        return spec.url
    assert spec.command is not None  # the spec has exactly one kind
    # not the proxy's environment (its secrets): mcp's minimal one (HOME, PATH, ...)
    return StdioServerParameters(command=spec.command[0], args=spec.command[1:],
                                 env={**get_default_environment(), **spec.env})


def _text(result: Any) -> str:
    """A ``CallToolResult``'s content as the text the model reads."""
    parts = []
    for item in result.content:
        text = getattr(item, "text", None)
        parts.append(text if isinstance(text, str) else f"[{item.type} content]")
    return "\n".join(parts)


class McpServer:
    """A ``[tools.<name>]`` with ``url`` or ``command``.

    Args:
        name: the server's name (for messages).
        spec: its config.
    """

    def __init__(self, name: str, spec: ToolServerSpec) -> None:
        self.name, self.spec = name, spec
        self._target = _target(spec)
        self._conn: _Connection | None = None
        self._listing: dict[str, ServerTool] | None = None
        self._lock = asyncio.Lock()

    async def _client(self) -> Client:
        async with self._lock:
            if self._conn is None or self._conn.dead:
                if self._conn is not None:
                    await self._conn.close()
                self._conn, self._listing = _Connection(self._target), None
            conn = self._conn
        return await conn.client(self.spec.connect_timeout_s)

    async def tools(self) -> dict[str, ServerTool]:
        """The server's tools (``tools/list``, every page).

        Raises:
            ServerUnreachable: it does not start, answer or list its tools in time.
        """
        client = await self._client()
        if self._listing is not None:
            return self._listing
        listing: dict[str, ServerTool] = {}
        cursor: str | None = None
        try:
            async with asyncio.timeout(self.spec.connect_timeout_s):
                while True:
                    page = await client.list_tools(cursor=cursor)
                    for t in page.tools:
                        listing[t.name] = ServerTool(t.name, t.description or "",
                                                     dict(t.input_schema))
                    cursor = page.next_cursor
                    if not cursor:
                        break
        except _BELOW_THE_TOOL as exc:  # TimeoutError included
            await self._dead()
            raise ServerUnreachable(f"tools/list failed: {reason_of(exc)}") from None
        self._listing = listing
        return listing

    async def call(self, name: str, args: dict[str, Any]) -> ToolOutcome:
        try:
            client = await self._client()
            result = await client.call_tool(name, args)
        except ServerUnreachable as exc:
            return ToolOutcome(error=f"MCP server {self.name!r} is unreachable: {exc}")
        except _BELOW_THE_TOOL as exc:
            await self._dead()
            return ToolOutcome(error=f"MCP server {self.name!r} failed during the call "
                                     f"({reason_of(exc)})")
        text = _text(result)
        if result.is_error:
            return ToolOutcome(error=text or f"tool {name!r} reported an error")
        return ToolOutcome(text)

    async def _dead(self) -> None:
        async with self._lock:
            conn, self._conn, self._listing = self._conn, None, None
        if conn is not None:
            await conn.close()

    async def aclose(self) -> None:
        await self._dead()
