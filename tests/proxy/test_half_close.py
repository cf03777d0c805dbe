"""A request whose body ends before its Content-Length because the client half-closed
its connection gets a 400 in the OpenAI error shape, not a silently closed connection
(issue 38, item 16; proxy/half_close.py). The proxy is served as ``flowlift serve``
serves it (:class:`~flowlift.proxy.half_close.ProxyRunner`)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from flowlift.proxy import create_app
from flowlift.proxy.half_close import ProxyRunner
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def _post(port: int, body: bytes, announced: int, *, half_close: bool,
                gap_s: float = 0.05) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(announced).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await asyncio.sleep(gap_s)  # the handler is reading the body by now
    if half_close:
        writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(), 10)  # until the proxy closes
    finally:
        writer.close()


async def _serve(runner: web.AppRunner):
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await runner.app[STATE].ready.wait()
    return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_a_half_closed_short_body_gets_a_400_naming_the_bytes():
    runner = ProxyRunner(create_app({"fake-model": FakeEngine(["fake-model"])}))
    port = await _serve(runner)
    try:
        body = json.dumps(CHAT).encode()
        for gap_s in (0.0, 0.05):  # EOF with the bytes, or while the handler reads
            answer = await _post(port, body[:20], len(body), half_close=True, gap_s=gap_s)
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400"), answer
            error = json.loads(payload)["error"]
            assert error["code"] == "incomplete_body" and error["param"] == "body"
            assert f"20 of the {len(body)} bytes" in error["message"]
            assert set(error) == {"message", "type", "param", "code"}
        # a whole body, then a half-close: answered as ever
        answer = await _post(port, body, len(body), half_close=True)
        assert answer.startswith(b"HTTP/1.1 200"), answer
    finally:
        await runner.cleanup()


async def test_without_it_aiohttp_closes_the_connection_unanswered():
    """What the runner fixes: aiohttp's own runner answers nothing."""
    runner = web.AppRunner(create_app({"fake-model": FakeEngine(["fake-model"])}))
    port = await _serve(runner)
    try:
        body = json.dumps(CHAT).encode()
        assert await _post(port, body[:20], len(body), half_close=True) == b""
    finally:
        await runner.cleanup()
