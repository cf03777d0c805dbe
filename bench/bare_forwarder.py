"""The floor a Python proxy can reach: an aiohttp server and one pooled ClientSession that
forwards ``POST /v1/chat/completions`` (and ``GET /v1/models``) to one upstream and
streams the response bytes back. No parsing, no auth, no logging. Same event loop as
``flowlift serve`` (stdlib asyncio; ``--uvloop`` to try uvloop).

    .venv/bin/python bench/bare_forwarder.py --upstream http://127.0.0.1:8001 --port 8002
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

_HOP = ("Content-Type", "Cache-Control")


async def forward(request: web.Request) -> web.StreamResponse:
    session: aiohttp.ClientSession = request.app["session"]
    body = await request.read()
    async with session.request(request.method, request.app["upstream"] + request.path,
                               data=body or None,
                               headers={"Content-Type": "application/json"}) as up:
        headers = {h: up.headers[h] for h in _HOP if h in up.headers}
        if up.content_length is not None:  # plain JSON: one body with Content-Length
            return web.Response(status=up.status, body=await up.read(), headers=headers)
        resp = web.StreamResponse(status=up.status, headers=headers)
        await resp.prepare(request)
        async for data in up.content.iter_any():  # SSE: relay bytes as they arrive
            await resp.write(data)
        await resp.write_eof()
        return resp


async def make_app(upstream: str) -> web.Application:
    app = web.Application()
    app["upstream"] = upstream.rstrip("/")

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        yield
        await app["session"].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/v1/models", forward)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:8001")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8002)
    p.add_argument("--uvloop", action="store_true")
    a = p.parse_args()
    loop = None
    if a.uvloop:
        import uvloop
        loop = uvloop.new_event_loop()
    web.run_app(make_app(a.upstream), host=a.host, port=a.port, access_log=None,
                print=None, loop=loop)


if __name__ == "__main__":
    main()
