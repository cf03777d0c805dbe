"""Fault-making upstreams on 127.0.0.1 for the reliability suite, beside the scripted
:class:`tests.upstream_fake.FakeUpstream`: scripts that reset the connection in the middle
of a body, a *black hole* (accepts connections, reads, never answers), a port nothing
listens on, and helpers to build a proxy over them and read its process's memory."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, free_port
from tests.upstream_fake import Script


def rss_mib() -> float:
    """This process's resident set size in MiB (Linux ``/proc``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _rst(request: web.Request) -> None:
    """Close the request's connection with a TCP reset (SO_LINGER 0), not a FIN."""
    transport = request.transport
    assert transport is not None
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def reset_mid_body(first: bytes, *, content_type: str = "application/json",
                   declared: int = 10_000) -> Script:
    """Headers announcing ``declared`` bytes, the first bytes of the body, then a reset."""
    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": content_type,
                                           "Content-Length": str(declared)})
        await resp.prepare(request)
        await resp.write(first)
        await asyncio.sleep(0.05)
        _rst(request)
        return resp
    return answer


def redirect(to: str, status: int = 307) -> Script:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, headers={"Location": to})
    return answer


class BlackHole:
    """A TCP server that accepts every connection, reads what comes and never answers.

    Use as an async context manager; ``url`` is its ``/v1`` base URL, ``connections``
    counts accepted connections.
    """

    def __init__(self) -> None:
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> BlackHole:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        while await reader.read(65536):
            pass


def refused_url() -> str:
    """A ``/v1`` base URL on a port nothing listens on (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}/v1"


def config_for(models: dict[str, dict[str, Any]], backends: dict[str, str],
               **backend_settings: Any) -> dict[str, Any]:
    """A config mapping: ``backends`` name -> base URL (kind openai, key from UP_KEY),
    ``models`` name -> model spec (``backends``, ``fallbacks``...)."""
    return {"backends": {name: {"kind": "openai", "base_url": url, "api_key_env": "UP_KEY",
                                **backend_settings} for name, url in backends.items()},
            "models": models}


async def serve(aiohttp_server: Any, apps: Iterable[web.Application]) -> list[str]:
    """Serve each app on a real port; their ``/v1`` base URLs."""
    return [str((await aiohttp_server(app)).make_url("/v1")) for app in apps]


async def proxy_client(aiohttp_client: Any, config: dict[str, Any], *,
                       proxy_config: ProxyConfig | None = None,
                       engine: FakeEngine | None = None) -> Any:
    """A test client of a proxy with ``fake-model`` on a FakeEngine and the upstream
    models of ``config``; ready when returned."""
    app = create_app({"fake-model": engine or FakeEngine(["fake-model"])}, proxy_config,
                     file_config=parse_config(config))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client
