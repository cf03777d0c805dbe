"""The research agent's tools as an MCP server (the ``mcp`` package's ``MCPServer``):
``python examples/agents/docs_mcp.py`` serves stdio (what ``[tools.docs] command``
starts), ``... http PORT`` Streamable HTTP on 127.0.0.1:PORT/mcp (``[tools.docs] url``)."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mcp.server.mcpserver import MCPServer

from examples.agents import docs_tools

server = MCPServer("stdlib-docs")
server.tool()(docs_tools.search)
server.tool()(docs_tools.read)

if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
