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
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from mcp import Client
from mcp.client._transport import Transport, TransportStreams
from mcp.client.stdio import StdioServerParameters, get_default_environment
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import CONNECTION_CLOSED, INVALID_REQUEST, REQUEST_TIMEOUT

from flowlift.proxy.config import ToolServerSpec
from flowlift.proxy.tools.mcp_content import outcome_of
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

    def __init__(self, target: Target, mode: Literal["auto", "legacy"] = "auto") -> None:
        self._target, self._mode = target, mode
        self._ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self.dead = False
        self._task = asyncio.create_task(self._own(), name="mcp connection")

    async def _own(self) -> None:
        try:
            target = self._target() if callable(self._target) else self._target
            async with Client(target, mode=self._mode) as client:
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


Target = StdioServerParameters | str | Callable[[], Transport]
"""What ``mcp.Client`` connects to; a callable makes a fresh transport per connection."""


@contextlib.asynccontextmanager
async def _http_with_headers(url: str, headers: dict[str, str]
                             ) -> AsyncIterator[TransportStreams]:
    """Streamable HTTP to ``url`` with ``headers`` on every request (the ``mcp``
    client's HTTP client, its default timeouts, closed with the transport)."""
    async with create_mcp_http_client(headers=headers) as http, \
            streamable_http_client(url, http_client=http) as streams:
        yield streams


def _target(spec: ToolServerSpec) -> Target:
    if spec.url is not None:
        if spec.headers:
            url, headers = spec.url, dict(spec.headers)
            return lambda: _http_with_headers(url, headers)
        return spec.url
    assert spec.command is not None  # the spec has exactly one kind
    # not the proxy's environment (its secrets): mcp's minimal one (HOME, PATH, ...)
    return StdioServerParameters(command=spec.command[0], args=spec.command[1:],
                                 env={**get_default_environment(), **spec.env})


def _session_gone(exc: Exception) -> bool:
    """Whether ``exc`` says the server no longer knows this connection's Streamable HTTP
    session (it expired, or the server restarted: HTTP 404 on a request that carries
    ``Mcp-Session-Id``, MCP specification "Session Management"): the request did not
    run, and a new session (``initialize``) may send it again."""
    return (isinstance(exc, MCPError) and exc.code == INVALID_REQUEST
            and "session" in exc.error.message.lower())


def _answered(exc: Exception) -> bool:
    """Whether ``exc`` is the server's answer to this one call (a JSON-RPC error
    response, or a result that fails the tool's declared ``outputSchema``, which the
    ``mcp`` client checks): the connection it came on is as good as before."""
    if isinstance(exc, MCPError):
        return exc.code not in (CONNECTION_CLOSED, REQUEST_TIMEOUT) and not _session_gone(exc)
    return isinstance(exc, RuntimeError) and (
        "structured content" in str(exc) or str(exc).startswith("Invalid schema for tool"))


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
                self._conn, self._listing = _Connection(self._target, self.spec.mode), None
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
                        notes = (t.annotations.model_dump(by_alias=True, exclude_none=True)
                                 if t.annotations is not None else None)
                        listing[t.name] = ServerTool(t.name, t.description or "",
                                                     dict(t.input_schema), notes)
                    cursor = page.next_cursor
                    if not cursor:
                        break
        except _BELOW_THE_TOOL as exc:  # TimeoutError included
            await self._dead()
            raise ServerUnreachable(f"tools/list failed: {reason_of(exc)}") from None
        self._listing = listing
        return listing

    async def call(self, name: str, args: dict[str, Any]) -> ToolOutcome:
        """Run tool ``name`` (see :class:`~flowlift.proxy.tools.outcome.ToolServer`).

        A JSON-RPC error or a result failing the tool's output schema is this call's
        error, and the shared connection stays open for the other calls; a session the
        server no longer knows (404) is opened again and the call sent once more (it
        did not run); any other failure closes the connection (the next call opens a
        new one)."""
        for attempt in (1, 2):
            try:
                client = await self._client()
                result = await client.call_tool(name, args)
            except ServerUnreachable as exc:
                return ToolOutcome(error=f"MCP server {self.name!r} is unreachable: {exc}")
            except _BELOW_THE_TOOL as exc:
                if _answered(exc):
                    return ToolOutcome(error=f"MCP server {self.name!r} answered the call "
                                             f"with an error: {_described(exc)}")
                await self._dead()
                if attempt == 1 and _session_gone(exc):
                    continue
                return ToolOutcome(error=f"MCP server {self.name!r} failed during the call "
                                         f"({reason_of(exc)})")
            break
        return outcome_of(result, name)

    async def _dead(self) -> None:
        """Close the connection (the next call opens a new one)."""
        async with self._lock:
            conn, self._conn, self._listing = self._conn, None, None
        if conn is not None:
            await conn.close()

    async def aclose(self) -> None:
        await self._dead()


def _described(exc: Exception) -> str:
    if isinstance(exc, MCPError):
        return f"JSON-RPC error {exc.code}: {exc.error.message}"
    return str(exc)
