"""A tiny MCP server for the proxy-tool tests (the ``mcp`` package's ``MCPServer``,
FastMCP's successor): ``python tests/tools_mcp_server.py`` serves stdio,
``... http PORT`` Streamable HTTP on 127.0.0.1:PORT/mcp. ``COUNT_FILE`` (env): each
``add`` call appends a line to it (the kill -9 test counts calls)."""

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
def serving_http(port: int, script: str = __file__) -> Iterator[subprocess.Popen[bytes]]:
    """``script`` (this server, by default) serving Streamable HTTP on 127.0.0.1:``port``
    (``/mcp``) in a process of its own, killed on exit."""
    proc = subprocess.Popen([sys.executable, script, "http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        yield proc
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        mcp.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        mcp.run()
