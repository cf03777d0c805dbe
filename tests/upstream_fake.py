"""A scripted OpenAI-compatible upstream on a real socket, for the proxy's regression
cases: each request takes the next scripted answer (plain JSON, an SSE stream written
as given raw byte pieces with pauses, a stall) and is recorded for inspection."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Script = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    peer: tuple[str, int] | None = None  # the client's address: one per TCP connection

    def json(self) -> Any:
        return json.loads(self.body)


def chat_json(content: str = "hello", model: str = "up-model", **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            **extra}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1,
            "model": "up-model",
            "choices": [{"index": 0, "delta": delta or {}, "logprobs": None,
                         "finish_reason": finish}], **extra}


def sse_bytes(*docs: Any, done: bool = True) -> list[bytes]:
    """Each JSON doc as one ``data:`` event (then ``[DONE]``), one write each."""
    out = [b"data: " + json.dumps(d, ensure_ascii=False).encode() + b"\n\n" for d in docs]
    return out + ([b"data: [DONE]\n\n"] if done else [])


def chat_answer(content: str, cookie: tuple[str, str] | None = None) -> Script:
    """A chat completion of ``content``, streamed when the request asks (workflow steps
    stream), ``{}`` on any other path (a router's health checks); ``cookie``: a
    ``Set-Cookie`` (name, value) on every answer, as llm-d's gateway pins a session."""
    async def answer(request: web.Request) -> web.StreamResponse:
        if not request.path.endswith("/chat/completions"):
            return web.json_response({})
        body = json.loads(await request.read())
        resp: web.StreamResponse
        if body.get("stream") is not True:
            resp = web.json_response(chat_json(content))
        else:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if cookie is not None:
            resp.set_cookie(*cookie, path="/", httponly=True)
        if body.get("stream") is not True:
            return resp
        await resp.prepare(request)
        for piece in sse_bytes(chunk({"role": "assistant", "content": content}),
                               chunk(finish="stop"),
                               {**chunk(), "choices": [], "usage": {
                                   "prompt_tokens": 3, "completion_tokens": 1,
                                   "total_tokens": 4}}):
            await resp.write(piece)
        await resp.write_eof()
        return resp
    return answer


@dataclass
class FakeUpstream:
    """Answers with ``scripts`` in order (the last one repeats)."""

    scripts: list[Script] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.received.append(Received(request.path, dict(request.headers),
                                      await request.read(), time.monotonic(),
                                      tuple(peer[:2]) if peer else None))
        script = self.scripts[min(len(self.received), len(self.scripts)) - 1]
        return await script(request)

    # -- answers -------------------------------------------------------------------
    @staticmethod
    def json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Script:
        async def answer(request: web.Request) -> web.StreamResponse:
            return web.Response(body=json.dumps(body).encode() if not isinstance(body, bytes)
                                else body, status=status, headers=headers,
                                content_type="application/json")
        return answer

    @staticmethod
    def stream(pieces: list[bytes], *, gap_s: float = 0.0, first_delay_s: float = 0.0,
               then_stall_s: float = 0.0) -> Script:
        """Write each piece as its own TCP write (after ``gap_s``), then end."""
        async def answer(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(first_delay_s)
            for i, piece in enumerate(pieces):
                if i and gap_s:
                    await asyncio.sleep(gap_s)
                await resp.write(piece)
            await asyncio.sleep(then_stall_s)
            return resp
        return answer

    @staticmethod
    def headers_then_stall(stall_s: float) -> Script:
        async def answer(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(stall_s)
            return resp
        return answer


async def upstream_only_proxy(aiohttp_client: Any, aiohttp_server: Any,
                              *fakes: FakeUpstream, model: str = "up") -> Any:
    """A test client of a proxy with no embedded engine whose ``model`` is served by the
    ``fakes`` as replicas ``r0``, ``r1``..."""
    from flowlift.proxy import create_app
    from flowlift.proxy.config import parse_config
    from flowlift.proxy.state import STATE

    urls = [str((await aiohttp_server(f.app())).make_url("/v1")) for f in fakes]
    app = create_app({}, file_config=parse_config({
        "backends": {f"r{i}": {"kind": "openai", "base_url": u} for i, u in enumerate(urls)},
        "models": {model: {"backends": [f"r{i}" for i in range(len(urls))]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client
