"""MCP in depth (issue 34 item 5), against the real test server over Streamable HTTP
(tests/tools_mcp_server.py): a result with only ``structuredContent``; a JSON-RPC error
and a result failing its output schema leave the shared connection open; a session the
restarted server no longer knows is opened again and the call runs once; ``headers``
(auth) for URL servers, in the config and in a hosted MCP tool; non-text content."""

from __future__ import annotations

import asyncio
import json

import pytest

from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.config import ToolServerSpec, parse_config
from flowlift.proxy.state import STATE
from flowlift.proxy.tools.mcp_server import McpServer, ServerUnreachable
from flowlift.proxy.tools.registry import ToolServers
from flowlift.testing import FakeEngine, free_port, tool_calls_text
from tests.tools_mcp_server import serving_http


@pytest.fixture(scope="module")
def http_url():
    port = free_port()
    with serving_http(port):
        yield f"http://127.0.0.1:{port}/mcp"


async def test_structured_content_only_reaches_the_model_as_json(aiohttp_client, http_url):
    def respond(request: GenerationRequest) -> str:
        last = request.messages[-1]
        if last.role == "user" and "where" in last.content:
            return tool_calls_text(("point", {}))
        return json.dumps({"content": "got it"}) if request.constraint else "got it"

    engine = FakeEngine(["fake-model"], responder=respond)
    app = create_app({"fake-model": engine},
                     file_config=parse_config({"tools": {"calc": {"url": http_url}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    resp = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "where is the point?",
        "tools": [{"type": "mcp", "server_label": "calc", "require_approval": "never"}]})
    out = await resp.json()
    call = next(o for o in out["output"] if o["type"] == "mcp_call")
    assert json.loads(call["output"]) == {"x": 1, "y": 2}
    prompt = "\n".join(m.content for m in engine.requests[-1].messages)
    assert '"x": 1' in prompt and '"y": 2' in prompt  # the model read the JSON


async def test_a_call_s_error_does_not_close_the_connection_others_share(http_url):
    server = McpServer("calc", ToolServerSpec(url=http_url))
    try:
        assert (await server.call("add", {"a": 1, "b": 1})).value == "2"
        conn = server._conn
        hanging = asyncio.ensure_future(server.call("hang", {"seconds": 1.5}))
        await asyncio.sleep(0.3)
        rpc = await server.call("rpc_error", {})
        assert rpc.error is not None and "-32602" in rpc.error and "always refuses" in rpc.error
        shaped = await server.call("shaped", {})
        assert shaped.error is not None and "structured content" in shaped.error
        assert (await hanging).value == "woke up"  # the call in flight was not cut
        assert server._conn is conn and not conn.dead  # one connection all along
        assert (await server.call("add", {"a": 2, "b": 2})).value == "4"
    finally:
        await server.aclose()


async def test_a_restarted_server_s_lost_session_is_opened_again_and_the_call_runs_once(
        tmp_path):
    port, count = free_port(), tmp_path / "count.txt"
    url, env = f"http://127.0.0.1:{port}/mcp", {"COUNT_FILE": str(count)}
    server = McpServer("calc", ToolServerSpec(url=url, mode="legacy"))  # with sessions
    try:
        with serving_http(port, env=env):
            assert (await server.call("add", {"a": 1, "b": 2})).value == "3"
        with serving_http(port, env=env):  # a new process: the session is unknown (404)
            outcome = await server.call("add", {"a": 2, "b": 3})
        assert outcome.value == "5", outcome
        assert count.read_text().splitlines() == ["1+2", "2+3"]  # each call ran once
    finally:
        await server.aclose()


async def test_headers_reach_a_url_server_from_the_config_and_from_a_hosted_tool(
        aiohttp_client):
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    with serving_http(port, env={"MCP_TOKEN": "s3cret"}):
        bare = McpServer("calc", ToolServerSpec(url=url))
        with pytest.raises(ServerUnreachable):
            await bare.tools()
        await bare.aclose()
        authed = ToolServers({"calc": ToolServerSpec(
            url=url, headers={"Authorization": "Bearer s3cret"})})
        assert (await authed.call("calc", "add", {"a": 1, "b": 2})).value == "3"
        await authed.aclose()
        engine = FakeEngine(["fake-model"], responder=lambda r: tool_calls_text(
            ("add", {"a": 1, "b": 2})) if r.messages[-1].content == "1+2?" else "3")
        app = create_app({"fake-model": engine},
                         file_config=parse_config({"tools": {"calc": {"url": url}}}))
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        tool = {"type": "mcp", "server_label": "calc", "server_url": url,
                "require_approval": "never"}
        refused = await client.post("/v1/responses", json={
            "model": "fake-model", "input": "1+2?", "tools": [tool]})
        assert refused.status == 424  # the config has no token: the server says 401
        assert (await refused.json())["error"]["param"] == "tools[0]"
        for auth in ({"headers": {"Authorization": "Bearer s3cret"}},
                     {"authorization": "s3cret"}):
            ok = await client.post("/v1/responses", json={
                "model": "fake-model", "input": "1+2?", "tools": [{**tool, **auth}]})
            out = await ok.json()
            assert ok.status == 200, out
            assert [o.get("output") for o in out["output"] if o["type"] == "mcp_call"] == ["3"]
            assert "headers" not in out["tools"][0] and "authorization" not in out["tools"][0]


async def test_non_text_content_is_passed_on_as_text_can_carry_it(http_url):
    server = McpServer("calc", ToolServerSpec(url=http_url))
    try:
        outcome = await server.call("picture", {})
    finally:
        await server.aclose()
    assert outcome.value == ("a red dot:\n[image content: image/png, 8 bytes]\n"
                             "[resource link: file:///dot.png (dot.png, image/png)]")
