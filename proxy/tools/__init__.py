"""Tools the proxy runs itself, so an agent step's turn never leaves the proxy.

A config file names tool servers (:class:`~flowlift.proxy.config.ToolServerSpec`)::

    [tools.research]
    command = ["python", "-m", "research_mcp"]   # MCP over stdio (the proxy starts it)
    # url = "http://127.0.0.1:9000/mcp"          # MCP over Streamable HTTP
    # callables = ["mypkg.tools:search"]         # Python functions, for sidecars
    allow = ["search", "read"]
    timeout_s = 30
    max_result_bytes = 1000000

An agent step names them with ``flowlift.proxy_tool("research.search")`` (wire:
``ToolSpec.server``). At submission the proxy describes them from the server
(:meth:`~flowlift.proxy.tools.registry.ToolServers.resolve`); each call the model makes
is checked against that schema, run on the proxy under the server's timeout, its result
bounded, and logged as the step's ``tool.result`` event as an app tool's would be (a
resumed run replays it: :mod:`flowlift.proxy.workflows.agent`).

Modules: :mod:`.outcome` (results, the server shape), :mod:`.mcp_server` (the ``mcp``
client), :mod:`.callables` (``module:function``), :mod:`.registry` (the servers of one
proxy), :mod:`.early` (calls whose arguments are complete while the turn streams).
"""

from flowlift.proxy.tools.outcome import ServerTool, ToolOutcome, ToolServer
from flowlift.proxy.tools.registry import ToolServers

__all__ = ["ServerTool", "ToolOutcome", "ToolServer", "ToolServers"]
