"""The upstream HTTP client production uses (aiohttp's: ``proxy.dispatch.upstream_http``)
over real sockets, and the one translation of its failures into ``UpstreamError``: refused,
reset before the headers, reset mid-body, a stall past the caller's timeout, a full pool,
redirects (never followed), oversized headers and large bodies, compressed answers; and an
injected httpx transport's failures through the same translation."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import struct
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from flowlift.proxy.config import UpstreamSpec
from flowlift.proxy.dispatch.upstream.http import TRANSPORT_ERRORS, translate
from flowlift.proxy.dispatch.upstream.provider import Upstream
from tests.reliability.faults import BlackHole, redirect, refused_url, reset_mid_body
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes


def upstream(url: str, **spec: Any) -> Upstream:
    return Upstream("b", UpstreamSpec(kind="openai", base_url=url, **spec), "sk-up")


async def served(aiohttp_server: Any, fake: FakeUpstream) -> str:
    return str((await aiohttp_server(fake.app())).make_url("/v1"))


async def failure(call: Any) -> Any:
    """The exception ``call`` raised, which must be one the translation takes."""
    with pytest.raises(TRANSPORT_ERRORS) as caught:
        await call
    return caught.value


async def test_a_json_answer_with_the_upstream_key_and_only_the_headers_given(aiohttp_server):
    fake = FakeUpstream([FakeUpstream.json(chat_json("hi"))])
    url = await served(aiohttp_server, fake)
    up = upstream(url)
    try:
        answer = await up.post("/chat/completions", b'{"model":"m"}', {"traceparent": "00-a-b-01"})
        assert answer.status == 200 and answer.headers["content-type"] == "application/json"
        assert json.loads(await answer.read())["choices"][0]["message"]["content"] == "hi"
        await answer.aclose()
    finally:
        await up.aclose()
    got = fake.received[0]
    assert got.path == "/v1/chat/completions" and got.body == b'{"model":"m"}'
    headers = {k.lower(): v for k, v in got.headers.items()}
    assert headers["authorization"] == "Bearer sk-up"
    assert headers["traceparent"] == "00-a-b-01"
    assert headers["host"] == url.split("//")[1].split("/")[0]
    assert headers["content-length"] == "13"


async def test_sequential_requests_share_one_pooled_connection(aiohttp_server):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    up = upstream(await served(aiohttp_server, fake))
    try:
        for _ in range(3):
            answer = await up.post("/chat/completions", b"{}")
            await answer.read()
            await answer.aclose()
    finally:
        await up.aclose()
    assert len({r.peer for r in fake.received}) == 1


async def test_refused_is_a_502_naming_the_connection_error():
    up = upstream(refused_url())
    try:
        exc = await failure(up.post("/chat/completions", b"{}"))
    finally:
        await up.aclose()
    err = translate(exc, "b", stage="before answering")
    assert err.status == 502 and err.retryable and err.backend == "b"
    assert "failed before answering: ClientConnectorError" in err.message


async def test_a_reset_before_the_headers_is_a_502():
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)  # the request, then a TCP reset instead of an answer
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    up = upstream(f"http://127.0.0.1:{port}/v1")
    try:
        exc = await failure(up.post("/chat/completions", b"{}"))
    finally:
        await up.aclose()
        server.close()
    err = translate(exc, "b", stage="before answering")
    assert err.status == 502 and "failed before answering" in err.message


async def test_a_reset_mid_body_fails_the_read_with_a_502(aiohttp_server):
    fake = FakeUpstream([reset_mid_body(b'{"choices": [')])
    up = upstream(await served(aiohttp_server, fake))
    try:
        answer = await up.post("/chat/completions", b"{}")
        assert answer.status == 200  # the headers came whole
        exc = await failure(answer.read())
        await answer.aclose()
    finally:
        await up.aclose()
    err = translate(exc, "b", stage="while sending its answer")
    assert err.status == 502 and "ClientPayloadError" in err.message


async def test_a_stream_cut_mid_way_fails_its_chunks_with_a_502(aiohttp_server):
    first = sse_bytes(chunk({"content": "half"}), done=False)[0]
    fake = FakeUpstream([reset_mid_body(first, content_type="text/event-stream")])
    up = upstream(await served(aiohttp_server, fake))
    got = b""
    try:
        answer = await up.post("/chat/completions", b"{}")

        async def read_all() -> None:
            nonlocal got
            async for piece in answer.chunks():
                got += piece
        exc = await failure(read_all())
        await answer.aclose()
    finally:
        await up.aclose()
    assert got == first
    assert translate(exc, "b", stage="mid-stream").status == 502


async def test_a_stall_past_the_callers_timeout_is_a_504():
    async with BlackHole() as hole:
        up = upstream(hole.url)
        try:
            exc = await failure(asyncio.wait_for(up.post("/chat/completions", b"{}"), 0.2))
        finally:
            await up.aclose()
    err = translate(exc, "b", stage="before answering")
    assert err.status == 504 and err.code == "upstream_timeout"


async def test_waiting_past_connect_timeout_for_a_pooled_connection_is_a_504():
    async with BlackHole() as hole:
        up = upstream(hole.url, max_connections=1, connect_timeout_s=0.2)
        stuck = asyncio.ensure_future(up.post("/chat/completions", b"{}"))  # holds the one
        try:
            await asyncio.sleep(0.05)
            exc = await failure(asyncio.wait_for(up.post("/chat/completions", b"{}"), 5))
        finally:
            stuck.cancel()
            await up.aclose()
    assert isinstance(exc, aiohttp.ClientError)  # the client's own pool timeout, not ours
    assert translate(exc, "b", stage="before answering").status == 504


@pytest.mark.parametrize("status", [301, 302, 307, 308])
async def test_a_redirect_is_an_answer_never_followed(aiohttp_server, status):
    trap = FakeUpstream([FakeUpstream.json(chat_json())])
    trap_url = await served(aiohttp_server, trap)
    fake = FakeUpstream([redirect(f"{trap_url}/chat/completions", status)])
    up = upstream(await served(aiohttp_server, fake))
    try:
        answer = await up.post("/chat/completions", b"{}")
        assert answer.status == status
        await answer.read()
        await answer.aclose()
    finally:
        await up.aclose()
    assert trap.received == []


async def test_an_oversized_header_is_a_502_not_a_crash(aiohttp_server):
    fake = FakeUpstream([FakeUpstream.json(chat_json(), headers={"X-Big": "x" * 20_000})])
    up = upstream(await served(aiohttp_server, fake))
    try:
        exc = await failure(up.post("/chat/completions", b"{}"))
    finally:
        await up.aclose()
    assert translate(exc, "b", stage="before answering").status == 502


async def test_large_bodies_go_and_come_back_whole(aiohttp_server):
    big_answer = json.dumps(chat_json("é" * 3_000_000)).encode()
    fake = FakeUpstream([FakeUpstream.json(big_answer)])
    up = upstream(await served(aiohttp_server, fake))
    big_request = b'{"prompt": "' + b"y" * 5_000_000 + b'"}'
    try:
        answer = await up.post("/completions", big_request)
        assert await answer.read() == big_answer
        await answer.aclose()
    finally:
        await up.aclose()
    assert fake.received[0].body == big_request


async def test_compressed_answers_are_decoded_whole_and_streamed(aiohttp_server):
    plain = json.dumps(chat_json("zipped")).encode()
    events = b"".join(sse_bytes(chunk({"content": "zipped"}), chunk({}, "stop")))

    async def gzipped(request: web.Request) -> web.StreamResponse:
        stream = b'"stream": true' in await request.read()
        return web.Response(body=gzip.compress(events if stream else plain),
                            headers={"Content-Encoding": "gzip", "Content-Type":
                                     "text/event-stream" if stream else "application/json"})
    fake = FakeUpstream([gzipped])
    up = upstream(await served(aiohttp_server, fake))
    try:
        answer = await up.post("/chat/completions", b'{"stream": false}')
        assert await answer.read() == plain
        await answer.aclose()
        answer = await up.post("/chat/completions", b'{"stream": true}')
        assert b"".join([piece async for piece in answer.chunks()]) == events
        await answer.aclose()
    finally:
        await up.aclose()


@pytest.mark.parametrize("raised,status", [
    (httpx.ConnectError("refused"), 502), (httpx.ReadError("reset"), 502),
    (httpx.ReadTimeout("slow"), 504), (TimeoutError(), 504)])
async def test_an_injected_transports_failures_take_the_same_translation(raised, status):
    def handler(request: httpx.Request) -> httpx.Response:
        raise raised

    up = Upstream("b", UpstreamSpec(kind="openai", base_url="http://up.example/v1"),
                  transport=httpx.MockTransport(handler))
    exc = await failure(up.post("/chat/completions", b"{}"))
    await up.aclose()
    assert translate(exc, "b", stage="before answering").status == status
