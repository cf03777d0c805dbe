"""A tiny MCP server for the proxy-tool tests (the ``mcp`` package's ``MCPServer``,
FastMCP's successor): ``python tests/tools_mcp_server.py`` serves stdio,
``... http PORT`` Streamable HTTP on 127.0.0.1:PORT/mcp. ``COUNT_FILE`` (env): each
``add`` call appends a line to it (the kill -9 test counts calls). ``MCP_TOKEN`` (env):
the HTTP server answers 401 to a request without ``Authorization: Bearer <token>``.

The tools beyond ``add`` are the failure kinds other MCP clients mishandle: a result
with only ``structuredContent`` (``point``), one that fails its declared output schema
(``shaped``), a JSON-RPC error (``rpc_error``), non-text content (``picture``), and a
read-only tool (``lookup``, annotated ``readOnlyHint``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CallToolResult,
    ImageContent,
    ResourceLink,
    TextContent,
    ToolAnnotations,
)

mcp = MCPServer("flowlift-test")


@mcp.tool()
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    path = os.environ.get("COUNT_FILE")
    if "SECRET_OF_THE_PROXY" in os.environ:  # the proxy's environment must not leak in
        raise RuntimeError("the server got the proxy's environment")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{a}+{b}\n")
    return a + b


@mcp.tool()
async def hang(seconds: float = 3600.0) -> str:
    """Sleep (a tool that hangs)."""
    await asyncio.sleep(seconds)
    return "woke up"


@mcp.tool()
def big(n: int) -> str:
    """Return n bytes of text."""
    return "x" * n


@mcp.tool()
def die() -> str:
    """Kill the server process in the middle of the call."""
    os._exit(3)


@mcp.tool()
def boom() -> str:
    """Raise."""
    raise ValueError("the tool broke")


@mcp.tool()
def point() -> CallToolResult:
    """A point, as structured content only."""
    return CallToolResult(content=[], structured_content={"x": 1, "y": 2})


@mcp.tool()
def shaped() -> CallToolResult:
    """A result that does not fit its declared output schema."""
    return CallToolResult(content=[TextContent(type="text", text="{}")],
                          structured_content={"x": 1})


# advertised, so the client checks it (the server does not: no output model)
mcp._tool_manager.get_tool("shaped").fn_metadata.output_schema = {  # type: ignore[union-attr]
    "type": "object", "properties": {"z": {"type": "integer"}}, "required": ["z"]}


@mcp.tool()
def rpc_error() -> str:
    """Answer with a JSON-RPC error."""
    raise MCPError(-32602, "rpc_error always refuses")


@mcp.tool()
def picture() -> CallToolResult:
    """Text, an image and a resource link."""
    return CallToolResult(content=[
        TextContent(type="text", text="a red dot:"),
        ImageContent(type="image", data="iVBORw0KGgo=", mime_type="image/png"),
        ResourceLink(type="resource_link", uri="file:///dot.png", name="dot.png",
                     mime_type="image/png")])


@mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
def lookup(key: str) -> str:
    """Look a key up (read-only)."""
    path = os.environ.get("COUNT_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"lookup {key}\n")
    return f"value of {key}"


def _serve_http(port: int) -> None:
    token = os.environ.get("MCP_TOKEN")
    if not token:
        mcp.run("streamable-http", host="127.0.0.1", port=port)
        return
    import uvicorn
    from starlette.responses import PlainTextResponse

    app = mcp.streamable_http_app()

    async def guarded(scope, receive, send):  # type: ignore[no-untyped-def]
        headers = dict(scope.get("headers") or ())
        if scope["type"] == "http" and headers.get(b"authorization") != (
                f"Bearer {token}".encode()):
            await PlainTextResponse("unauthorized", status_code=401)(scope, receive, send)
            return
        await app(scope, receive, send)

    uvicorn.run(guarded, host="127.0.0.1", port=port, log_level="warning")


def wait_for_port(port: int, timeout_s: float = 30.0) -> None:
    """Return once 127.0.0.1:``port`` takes connections (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)


@contextlib.contextmanager
def serving_http(port: int, script: str = __file__, env: dict[str, str] | None = None
                 ) -> Iterator[subprocess.Popen[bytes]]:
    """``script`` (this server, by default) serving Streamable HTTP on 127.0.0.1:``port``
    (``/mcp``) in a process of its own (``env`` added to its environment), killed on
    exit."""
    proc = subprocess.Popen([sys.executable, script, "http", str(port)],
                            env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        yield proc
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        _serve_http(int(sys.argv[2]))
    else:
        mcp.run()
