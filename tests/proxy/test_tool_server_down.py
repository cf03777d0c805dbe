"""A ``[tools.*]`` MCP server that cannot start (issue 38, item 7): ``/readyz`` says so
(503, naming the server and why), and a graph that names it is refused once per server
with the cause, not "ExceptionGroup ... TaskGroup" once per tool; the proxy's other
routes work on. When the server can start again, ``/readyz`` recovers."""

from __future__ import annotations

import asyncio
import sys

from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine

BROKEN = [sys.executable, "-c", "import sys; sys.exit('docs_mcp: no such module')"]


async def _ready(client, want: int, timeout_s: float = 20.0) -> dict:
    async with asyncio.timeout(timeout_s):
        while True:
            resp = await client.get("/readyz")
            if resp.status == want:
                return await resp.json()
            await asyncio.sleep(0.1)


async def test_readyz_and_the_refusal_name_the_server_and_why(aiohttp_client):
    app = create_app({"fake-model": FakeEngine(["fake-model"])}, file_config=parse_config(
        {"tools": {"docs": {"command": BROKEN, "connect_timeout_s": 5}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    body = await _ready(client, 503)
    assert "tool server 'docs' cannot be used" in body["reason"], body
    assert "TaskGroup" not in body["reason"]
    tools = [{"name": name, "server": "docs"} for name in ("search", "read")]
    graph = {"nodes": [{"kind": "llm", "id": node, "model": "fake-model", "tools": tools,
                        "messages": [{"role": "user", "content": [{"text": "q"}]}]}
                       for node in ("a", "b")]}
    resp = await client.post("/v1/workflows", json=graph)
    assert resp.status == 400
    problems = (await resp.json())["error"]["problems"]
    assert len(problems) == 1, problems  # once for the server, not per tool and node
    assert "tool server 'docs' cannot be reached" in problems[0]
    assert "TaskGroup" not in problems[0] and "ExceptionGroup" not in problems[0]
    chat = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status == 200  # the rest of the proxy works on


async def test_readyz_recovers_once_the_server_starts(aiohttp_client, tmp_path):
    flag = tmp_path / "fixed"
    script = tmp_path / "server.py"
    script.write_text(
        "import pathlib, sys\n"
        f"if not pathlib.Path({str(flag)!r}).exists(): sys.exit('not yet')\n"
        "from mcp.server.mcpserver import MCPServer\n"
        "server = MCPServer('docs')\n"
        "@server.tool()\n"
        "def search(q: str) -> str:\n"
        "    return q\n"
        "server.run()\n")
    app = create_app({"fake-model": FakeEngine(["fake-model"])}, file_config=parse_config(
        {"tools": {"docs": {"command": [sys.executable, str(script)],
                            "connect_timeout_s": 10}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    await _ready(client, 503)
    flag.write_text("ok")
    assert await app[STATE].tools.check(["docs"]) == {}
    assert (await _ready(client, 200))["ready"] is True
