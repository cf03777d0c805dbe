"""Upstream OpenAI-compatible providers: each with its pooled HTTP client
(:mod:`flowlift.proxy.dispatch.upstream.http`: aiohttp's, or an injected httpx
transport), its health and cool-down (:mod:`flowlift.proxy.dispatch.upstream.health`'s),
``Retry-After`` parsing, and which client headers may travel upstream.

Upstream errors come from the clients only; :func:`~.upstream_http.translate` turns
them into :class:`~flowlift.errors.UpstreamError` in that one place (re-exported here),
and :func:`error_from` does the same for an upstream's 4xx/5xx answer.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Iterable, Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

from flowlift.errors import (
    ContentRefused,
    ContextLengthExceeded,
    FlowliftError,
    RequestError,
    UpstreamError,
)
from flowlift.proxy.config import UpstreamSpec
from flowlift.proxy.dispatch.upstream.health import Call as Call
from flowlift.proxy.dispatch.upstream.health import Health as Health
from flowlift.proxy.dispatch.upstream.http import (
    AiohttpClient,
    Answer,
    HttpxClient,
    UpstreamClient,
)
from flowlift.proxy.dispatch.upstream.http import translate as translate
from flowlift.proxy.dispatch.upstream.kv_metrics import KvMetrics, metrics_url

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})
"""Upstream answers another attempt may fix (OpenAI's client retries the same set)."""

PASSED_HEADERS = ("traceparent", "tracestate", "baggage", "x-request-id", "openai-beta",
                  "idempotency-key", "accept-language")
"""The client headers forwarded to every upstream: W3C trace context and request
metadata. Everything else -- the client's ``Authorization`` (the proxy's own key),
cookies and any ``x-*`` header that may hold a secret -- stays in the proxy (case B2),
unless a backend's ``pass_headers`` lists it (:func:`client_headers`; secrets are
refused there too)."""


def forwarded_headers(client: Mapping[str, str]) -> dict[str, str]:
    """The client headers to send upstream (see :data:`PASSED_HEADERS`).

    Raises:
        RequestError: a passed header holds non-ASCII or control characters (case B3:
            a 400 naming the header, never a 500).
    """
    return _picked(PASSED_HEADERS, client)


def client_headers(spec: UpstreamSpec, client: Mapping[str, str]) -> dict[str, str]:
    """The client headers ``spec`` allows beside :data:`PASSED_HEADERS` (its
    ``pass_headers``, lower-case names; secrets were refused when the config loaded).

    Raises:
        RequestError: such a header holds non-ASCII or control characters (a 400 naming
            it).
    """
    return _picked(spec.pass_headers, client) if spec.pass_headers else {}


def _picked(names: Iterable[str], client: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for name in names:
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
            network, through aiohttp's client (:mod:`.upstream_http` says why not httpx).
    """

    def __init__(self, name: str, spec: UpstreamSpec, api_key: str | None = None, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.name = name
        self.spec = spec
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        headers |= {"content-type": "application/json",
                    "accept": "application/json, text/event-stream"}
        self.client: UpstreamClient = (
            AiohttpClient(max_connections=spec.max_connections,
                          connect_timeout_s=spec.connect_timeout_s, headers=headers)
            if transport is None else
            HttpxClient(transport, connect_timeout_s=spec.connect_timeout_s, headers=headers))
        self._urls: dict[str, str] = {}
        self.health = Health(spec.failures_to_cool, spec.cooldown_s,
                             max_in_flight=spec.max_connections)
        self.kv: KvMetrics | None = (
            KvMetrics(metrics_url(spec.base_url), transport=transport,
                      headers={"authorization": f"Bearer {api_key}"} if api_key else None)
            if spec.kv_metrics else None)
        """The server's KV cache from its ``/metrics`` (``kv_metrics: true``)."""

    def post(self, path: str, body: bytes,
             headers: Mapping[str, str] | None = None) -> Awaitable[Answer]:
        """POST ``body`` (JSON) to ``path`` under ``base_url`` with the upstream's key and
        ``headers``; awaited: the answer once its headers are in (the caller closes it).
        (The client's awaitable itself: no coroutine of this method's own per request.)

        Raises:
            one of :data:`~.upstream_http.TRANSPORT_ERRORS` (see :func:`translate`).
        """
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self.spec.base_url.rstrip("/") + path
        return self.client.post(url, body, headers)

    async def post_at(self, url: str, body: bytes) -> Answer:
        """POST ``body`` (JSON) to ``url`` anywhere on the upstream's server (e.g.
        SGLang's ``/open_session`` beside ``/v1``), with the upstream's key."""
        return await self.client.post(url, body)

    def upstream_model(self, model: str) -> str:
        return self.spec.rename.get(model, model)

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.kv is not None:
            await self.kv.aclose()


async def error_from(resp: Answer, backend: str) -> UpstreamError:
    """The error for an upstream's 4xx/5xx answer (its body is kept for the client).

    Raises:
        one of :data:`~.upstream_http.TRANSPORT_ERRORS` when the body cannot be read.
    """
    try:
        body = await resp.read()
    finally:
        await resp.aclose()
    status = resp.status
    if status in (401, 403):  # flowlift's upstream key, not the client's: a 502
        return UpstreamError(f"backend {backend!r} rejected flowlift's upstream credentials "
                             f"(HTTP {status}); check its api_key_env in the "
                             "proxy's config", status=502, retryable=False, backend=backend)
    said = error_message(body)
    return UpstreamError(f"backend {backend!r} answered HTTP {status}"
                         + (f": {said[:500]}" if said else ""),
                         status=status, body=body, retryable=status in RETRYABLE_STATUS,
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
