"""The HTTP client under every upstream call, and the one place its errors are translated.

**aiohttp's client, used directly** (:class:`AiohttpClient`): one ``aiohttp.ClientSession``
per upstream over a ``TCPConnector`` sized by the backend's ``max_connections``.
The guide names httpx as the upstream client; the forwarding path left it because of
what it cost there, measured with ``bench/proxy_overhead.py`` (bench/RESULTS.md,
issues 4, 18 item 6 and 28 item 5): httpx's request and response objects around
aiohttp's connector (``httpx-aiohttp``, the transport openai-python offers for high
concurrency) were about a third of flowlift's CPU per forwarded request, and flowlift
served 0.41-0.44x a bare aiohttp forwarder's requests/s at 32 clients. httpx's own
pool was worse (httpcore checks every pooled connection on every request,
encode/httpcore#1035). The proxy's server is aiohttp already, so this adds no library.

**httpx where it still serves**: an injected ``httpx.AsyncBaseTransport``
(:class:`HttpxClient`, e.g. tests' ``httpx.MockTransport``: no sockets where a test
does not test sockets), the Batch API backend (:mod:`.batch`), the CLI. The network
path -- what production runs -- is always :class:`AiohttpClient`, and the reliability
suite's fake upstreams reach it over real sockets.

Both clients answer with an :class:`Answer` and raise their library's own exceptions
(:data:`TRANSPORT_ERRORS`); :func:`translate` turns those into
:class:`~flowlift.errors.UpstreamError`. Redirects are never followed (an upstream's
3xx is an answer, which the attempt rejects as no answer to a POST).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Protocol, cast

import aiohttp
import httpx
from yarl import URL

from flowlift.errors import UpstreamError

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError, aiohttp.ClientError, httpx.HTTPError)
"""What an upstream call may raise that :func:`translate` turns into an
:class:`~flowlift.errors.UpstreamError`: a timeout, or a failure of either client."""

KEEPALIVE_S = 5.0
"""Seconds an idle upstream connection stays pooled (httpx's default, which flowlift
used before: most servers close idle connections later, e.g. uvicorn at 5 s)."""


class Answer(Protocol):
    """An upstream's answer to a POST: status and headers read, the body not yet.

    Whoever holds one must :meth:`aclose` it (the connection goes back to the pool when
    the body was read whole, else it is closed)."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive."""
        ...

    async def read(self) -> bytes:
        """The whole body (``Content-Encoding`` decoded)."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (``Content-Encoding`` decoded)."""
        ...

    async def aclose(self) -> None: ...


class UpstreamClient(Protocol):
    """POSTs to one upstream server (see :class:`AiohttpClient`, :class:`HttpxClient`)."""

    def post(self, url: str, body: bytes,
             headers: Mapping[str, str] | None = None) -> Awaitable[Answer]:
        """POST ``body`` (JSON) to ``url`` with the client's fixed headers and
        ``headers``; awaited: the answer as soon as its headers are in.

        Raises:
            one of :data:`TRANSPORT_ERRORS` (for :func:`translate`).
        """
        ...

    async def aclose(self) -> None: ...


class AiohttpAnswer(aiohttp.ClientResponse):
    """aiohttp's response as an :class:`Answer` (the session's ``response_class``: no
    object of its own per request)."""

    def chunks(self) -> AsyncIterator[bytes]:
        return self.content.iter_any()

    async def aclose(self) -> None:
        self.release()  # back to the pool if read to its end, else the connection closes


class AiohttpClient:
    """One upstream server through aiohttp's client.

    Args:
        max_connections: the connector's limit (the backend's ``max_connections``).
        connect_timeout_s: seconds to wait for a pooled connection and to connect.
        headers: sent on every request (the upstream's key, content type, accept).

    The session opens on the first request (it belongs to the running event loop).
    Answers are decoded of ``Content-Encoding`` (aiohttp's ``auto_decompress``).
    It keeps no cookies (``aiohttp.DummyCookieJar``): the session is shared by every
    request of every client to this upstream, so a cookie one answer sets (llm-d's
    ``llm-d-session``, a load balancer's stickiness cookie) would go out on every later
    request of every session and tenant (issue 37). Session affinity travels in the
    per-request hints (:mod:`.hints`) instead.
    """

    def __init__(self, *, max_connections: int, connect_timeout_s: float,
                 headers: Mapping[str, str]) -> None:
        self.max_connections, self.connect_timeout_s = max_connections, connect_timeout_s
        self.headers = dict(headers)
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self.max_connections,
                                         keepalive_timeout=KEEPALIVE_S,
                                         ssl=httpx.create_ssl_context())  # certifi's CAs
        self._session = aiohttp.ClientSession(
            connector=connector, headers=self.headers, response_class=AiohttpAnswer,
            cookie_jar=aiohttp.DummyCookieJar(),  # no cookie crosses sessions or tenants
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s,
                                          sock_connect=self.connect_timeout_s))
        return self._session

    def post(self, url: str, body: bytes,
             headers: Mapping[str, str] | None = None) -> Awaitable[Answer]:
        session = self._session or self._open()
        target = self._urls.get(url)
        if target is None:  # parsed once per URL
            target = self._urls[url] = URL(url)
        # aiohttp's own awaitable (its response is an AiohttpAnswer: response_class),
        # not awaited here: no coroutine of this method's own per request
        return cast(Awaitable[Answer], session.post(target, data=body, headers=headers,
                                                    allow_redirects=False))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class HttpxClient:
    """One upstream server through an injected httpx transport (tests'
    ``httpx.MockTransport``; any ``httpx.AsyncBaseTransport``), without an
    ``httpx.AsyncClient``: its redirect, auth and cookie machinery has nothing to do."""

    def __init__(self, transport: httpx.AsyncBaseTransport, *, connect_timeout_s: float,
                 headers: Mapping[str, str]) -> None:
        self.transport, self.headers = transport, dict(headers)
        timeout = httpx.Timeout(connect=connect_timeout_s, read=None, write=60.0,
                                pool=connect_timeout_s)
        self._extensions = {"timeout": timeout.as_dict()}

    async def post(self, url: str, body: bytes,
                   headers: Mapping[str, str] | None = None) -> Answer:
        request = httpx.Request("POST", url, content=body, extensions=self._extensions,
                                headers={**self.headers, **(headers or {})})
        return _HttpxAnswer(await self.transport.handle_async_request(request))

    async def aclose(self) -> None:
        await self.transport.aclose()


class _HttpxAnswer:
    """An ``httpx.Response`` as an :class:`Answer`."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    @property
    def status(self) -> int:
        return self.response.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self.response.headers

    async def read(self) -> bytes:
        return await self.response.aread()

    def chunks(self) -> AsyncIterator[bytes]:
        return self.response.aiter_bytes()

    async def aclose(self) -> None:
        await self.response.aclose()


def translate(exc: BaseException, backend: str, *, stage: str) -> UpstreamError:
    """One of :data:`TRANSPORT_ERRORS` as a retryable :class:`UpstreamError`: a 504 for
    a timeout (aiohttp's connect and pool timeouts are ``TimeoutError`` s), else a 502
    naming what failed (refused, reset, a malformed or oversized answer).

    Args:
        stage: when it failed, for the message (``"before answering"``, ``"mid-stream"``).
    """
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return UpstreamError(f"backend {backend!r} timed out {stage}", status=504,
                             backend=backend)
    real = exc.__cause__ if isinstance(exc, httpx.HTTPError) and exc.__cause__ else exc
    return UpstreamError(f"backend {backend!r} failed {stage}: {type(real).__name__}: {real}",
                         status=502, backend=backend)


class ChunkStream(httpx.AsyncByteStream):
    """An :class:`Answer`'s body as an httpx byte stream, so that httpx-sse parses its
    events (``httpx_sse.EventSource`` reads an ``httpx.Response``)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.answer.chunks():
            yield chunk

    async def aclose(self) -> None:
        await self.answer.aclose()


def as_httpx(answer: Answer) -> httpx.Response:
    """``answer`` as an ``httpx.Response`` streaming its (already decoded) body."""
    content_type = answer.headers.get("content-type")
    return httpx.Response(answer.status, stream=ChunkStream(answer),
                          headers={"content-type": content_type} if content_type else {})
