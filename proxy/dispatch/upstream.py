"""Upstream OpenAI-compatible providers: pooled httpx clients (their health and cool-down
are :mod:`flowlift.proxy.dispatch.health`'s), ``Retry-After`` parsing, and which client
headers may travel upstream.

httpx is the only place upstream errors come from; :func:`translate` turns them into
:class:`~flowlift.errors.UpstreamError` in this one place.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx
from httpx_aiohttp import AiohttpTransport

from flowlift.errors import (
    ContentRefused,
    ContextLengthExceeded,
    FlowliftError,
    RequestError,
    UpstreamError,
)
from flowlift.proxy.config import UpstreamSpec
from flowlift.proxy.dispatch.health import Call as Call
from flowlift.proxy.dispatch.health import Health as Health

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})
"""Upstream answers another attempt may fix (OpenAI's client retries the same set)."""

PASSED_HEADERS = ("traceparent", "tracestate", "baggage", "x-request-id", "openai-beta",
                  "idempotency-key", "accept-language")
"""The only client headers forwarded upstream: W3C trace context and request metadata.
Everything else -- the client's ``Authorization`` (the proxy's own key), cookies and
any ``x-*`` header that may hold a secret -- stays in the proxy (case B2)."""


def forwarded_headers(client: Mapping[str, str]) -> dict[str, str]:
    """The client headers to send upstream (see :data:`PASSED_HEADERS`).

    Raises:
        RequestError: a passed header holds non-ASCII or control characters (case B3:
            a 400 naming the header, never a 500).
    """
    out = {}
    for name in PASSED_HEADERS:
        value = client.get(name)
        if value is None:
            continue
        if not value.isascii() or not value.isprintable():
            raise RequestError(f"header {name!r} holds non-ASCII or control characters; "
                               "send printable ASCII (percent-encode other text)",
                               param=f"header:{name}")
        out[name] = value
    return out


def retry_after_s(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait from ``Retry-After`` (delta-seconds or an HTTP-date, RFC 9110
    §10.2.3) or OpenAI's ``retry-after-ms``; None when absent or unreadable."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000
            if math.isfinite(value):
                return max(value, 0.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
        return max(value, 0.0) if math.isfinite(value) else None
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    now_dt = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC)
    return max((when - now_dt).total_seconds(), 0.0)


class Upstream:
    """One OpenAI-compatible upstream with its connection pool.

    Args:
        name: the backend's name in the config.
        spec: its settings.
        api_key: sent as ``Authorization: Bearer``; the client's key never is.
        transport: an httpx transport (tests use ``httpx.MockTransport``); None: the
            network through aiohttp's connection pool (``httpx-aiohttp``, the transport
            openai-python offers for high concurrency) behind httpx's API.
    """

    def __init__(self, name: str, spec: UpstreamSpec, api_key: str | None = None, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.name = name
        self.spec = spec
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._headers = httpx.Headers({
            **headers, "host": httpx.URL(spec.base_url).netloc.decode("ascii"),
            "content-type": "application/json", "accept": "application/json, text/event-stream"})
        self._urls: dict[str, httpx.URL] = {}
        limits = httpx.Limits(max_connections=spec.max_connections,
                              max_keepalive_connections=spec.max_connections)
        timeout = httpx.Timeout(connect=spec.connect_timeout_s, read=None, write=60.0,
                                pool=spec.connect_timeout_s)
        if transport is None:  # aiohttp's connector: httpcore's pool scans every pooled
            transport = AiohttpTransport(limits=limits)  # connection on each request
        self.transport = transport  # no httpx.AsyncClient around it: see send()
        self._extensions = {"timeout": timeout.as_dict()}
        self.health = Health(spec.failures_to_cool, spec.cooldown_s,
                             max_in_flight=spec.max_connections)

    def request(self, path: str, body: bytes, headers: Mapping[str, str]) -> httpx.Request:
        """A POST of ``body`` (JSON) to ``path`` under ``base_url``, with the upstream's key.

        Built directly (URLs and fixed headers prepared once per path): the client's
        ``build_request`` re-merges URLs, cookies and headers on every call, a measurable
        part of the proxy's per-request cost.
        """
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.spec.base_url.rstrip("/") + path)
        return self.request_at(url, body, headers)

    def request_at(self, url: httpx.URL | str, body: bytes,
                   headers: Mapping[str, str] | None = None) -> httpx.Request:
        """A POST of ``body`` (JSON) to ``url`` (anywhere on the upstream's server, e.g.
        SGLang's ``/open_session`` beside ``/v1``), with the upstream's key."""
        all_headers = self._headers.copy()
        all_headers["content-length"] = str(len(body))
        for name, value in (headers or {}).items():
            all_headers[name] = value
        # stream= rather than content=: the body is already bytes, and content= re-derives
        # every header (4x the cost of this whole function, measured)
        request = httpx.Request("POST", url, headers=all_headers,
                                stream=httpx.ByteStream(body), extensions=self._extensions)
        # read: its content is the bytes, which the aiohttp transport then sends as bytes
        # (an unread request goes as an async stream, and its transfer-encoding header is
        # popped through MutableMapping's slow path: ~10% of the transport's cost)
        request.read()
        return request

    async def send(self, request: httpx.Request) -> httpx.Response:
        """Send through the transport itself: the client's redirect, auth, cookie and
        event-hook machinery has nothing to do for a proxied POST."""
        return await self.transport.handle_async_request(request)

    def upstream_model(self, model: str) -> str:
        return self.spec.rename.get(model, model)

    async def aclose(self) -> None:
        await self.transport.aclose()


def translate(exc: Exception, backend: str, *, stage: str) -> UpstreamError:
    """An httpx or timeout failure as a retryable :class:`UpstreamError`."""
    cause = exc.__cause__
    if isinstance(exc, TimeoutError) or (isinstance(exc, httpx.TimeoutException) and (
            cause is None or isinstance(cause, TimeoutError))):  # httpx-aiohttp maps every
        # aiohttp connection error to ConnectTimeout; the cause says what it really was
        return UpstreamError(f"backend {backend!r} timed out {stage}", status=504,
                             backend=backend)
    real = cause if cause is not None else exc
    return UpstreamError(f"backend {backend!r} failed {stage}: {type(real).__name__}: {real}",
                         status=502, backend=backend)


async def error_from(resp: httpx.Response, backend: str) -> UpstreamError:
    """The error for an upstream's 4xx/5xx answer (its body is kept for the client)."""
    try:
        body = await resp.aread()
    finally:
        await resp.aclose()
    if resp.status_code in (401, 403):  # flowlift's upstream key, not the client's: a 502
        return UpstreamError(f"backend {backend!r} rejected flowlift's upstream credentials "
                             f"(HTTP {resp.status_code}); check its api_key_env in the "
                             "proxy's config", status=502, retryable=False, backend=backend)
    said = error_message(body)
    return UpstreamError(f"backend {backend!r} answered HTTP {resp.status_code}"
                         + (f": {said[:500]}" if said else ""),
                         status=resp.status_code, body=body,
                         retryable=resp.status_code in RETRYABLE_STATUS,
                         retry_after_s=retry_after_s(resp.headers), backend=backend)


def error_message(body: bytes | None) -> str | None:
    """The message of an upstream's JSON error body: OpenAI's ``error.message``, or
    another shape's ``message`` (vLLM, SGLang), ``detail`` (FastAPI; a list of problems
    is joined) or ``error`` (a string); None when the body holds none (HTML, empty)."""
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    err = doc.get("error")
    if isinstance(err, dict):
        message = err.get("message")
        return message if isinstance(message, str) and message else None
    for key in ("message", "detail", "error"):
        value = doc.get(key)
        if isinstance(value, str) and value:
            return value
        if key == "detail" and isinstance(value, list) and value:
            return "; ".join(str(v.get("msg", v)) if isinstance(v, dict) else str(v)
                             for v in value)
    return None


_CONTEXT_CODES = frozenset({"context_length_exceeded", "string_above_max_length"})
_POLICY_CODES = frozenset({"content_filter", "content_policy_violation"})


def unretryable(exc: UpstreamError, model: str) -> FlowliftError | None:
    """The typed error of an upstream answer no retry on the same model can change: a
    prompt past the model's context (:class:`ContextLengthExceeded`) or a content-policy
    refusal (:class:`ContentRefused`), read from the OpenAI error body's ``code``
    (``context_length_exceeded``, ``content_filter``, ``content_policy_violation``).
    ``None`` for anything else."""
    if exc.body is None or exc.status >= 500:
        return None
    try:
        err = json.loads(exc.body).get("error") or {}
        code = str(err.get("code") or err.get("type") or "")
        message = str(err.get("message") or "")
    except (ValueError, AttributeError):
        return None
    if code in _CONTEXT_CODES:
        return ContextLengthExceeded(f"model {model!r}: {message or code}", param="messages")
    if code in _POLICY_CODES:
        return ContentRefused(f"model {model!r} refused the content: {message or code}")
    return None
