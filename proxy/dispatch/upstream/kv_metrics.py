"""An upstream vLLM server's KV cache, read from its Prometheus ``/metrics``.

Working-set admission (:mod:`flowlift.proxy.dispatch.slots.working_set`) fits agent
sessions into a KV cache of known size. For the embedded engine the size comes from
the engine's own cache config; for an upstream ``vllm serve`` it is read from the page
every vLLM OpenAI server exports (vLLM v1 metrics, ``vllm/v1/metrics/loggers.py``):

* ``vllm:cache_config_info`` — an info gauge whose labels carry the cache config,
  among them ``num_gpu_blocks`` (blocks the cache holds, per engine) and ``block_size``
  (tokens per block);
* ``vllm:kv_cache_usage_perc`` — the share of the cache (0 to 1) in use.

A data-parallel server exports one sample per engine (label ``engine``); the capacity
is their sum. The page is parsed with ``prometheus_client``'s text parser, not by hand.

:func:`parse` is pure; :class:`KvMetrics` fetches the page (httpx; tests inject a
transport) at most every ``refresh_s`` seconds, in the background, so the scheduler's
synchronous reads never wait on the network: until the first answer, and while the
server cannot be read, the capacity is unknown (``None``) and every call is admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

log = structlog.get_logger(__name__)

CACHE_INFO = "vllm:cache_config_info"
USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True, slots=True)
class KvCache:
    """One server's KV cache: ``blocks`` blocks of ``block_tokens`` tokens, ``usage``
    (0 to 1, None: not exported)."""

    blocks: int
    block_tokens: int
    usage: float | None = None

    @property
    def tokens(self) -> int:
        """Tokens the cache holds in all."""
        return self.blocks * self.block_tokens


def _int(value: str | None) -> int | None:
    if value is None or value in ("", "None"):
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


def parse(text: str) -> KvCache | None:
    """The KV cache a vLLM ``/metrics`` page describes, or None when the page has no
    ``vllm:cache_config_info`` with a positive ``num_gpu_blocks`` and ``block_size``
    (not a vLLM server, or one that has not finished starting).

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    blocks: dict[str, int] = {}
    block_tokens: set[int] = set()
    usages: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CACHE_INFO:
                n = _int(sample.labels.get("num_gpu_blocks"))
                size = _int(sample.labels.get("block_size"))
                if n is not None and size is not None:
                    blocks[sample.labels.get("engine", "")] = n
                    block_tokens.add(size)
            elif sample.name == USAGE and math.isfinite(sample.value):
                usages.append(min(max(float(sample.value), 0.0), 1.0))
    if not blocks or len(block_tokens) != 1:
        return None
    usage = sum(usages) / len(usages) if usages else None
    return KvCache(sum(blocks.values()), block_tokens.pop(), usage)


def metrics_url(base_url: str) -> str:
    """The ``/metrics`` page of the server behind an OpenAI ``base_url``
    (``http://host:8000/v1`` -> ``http://host:8000/metrics``: vLLM serves it at the
    root, beside ``/v1``)."""
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


class KvMetrics:
    """The latest KV cache read from one server's ``/metrics``, refreshed in the
    background at most every ``refresh_s`` seconds.

    Args:
        url: the page (:func:`metrics_url`).
        refresh_s: seconds between reads (the capacity changes only with a restart).
        timeout_s: seconds one read may take.
        transport: an httpx transport (tests: ``httpx.MockTransport``); None: network.
        timer: monotonic seconds (tests inject one).
    """

    def __init__(self, url: str, *, refresh_s: float = 10.0, timeout_s: float = 2.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 headers: dict[str, str] | None = None,
                 timer: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.refresh_s = refresh_s
        self._client = httpx.AsyncClient(transport=transport, timeout=timeout_s,
                                         headers=headers)
        self._timer = timer
        self._read_at: float | None = None
        self._task: asyncio.Task[KvCache | None] | None = None
        self.latest: KvCache | None = None
        self.error: str | None = None
        """Why the last read failed (None: it did not)."""

    def current(self) -> KvCache | None:
        """The latest cache read (None: none yet); starts a background read when the
        last is older than ``refresh_s`` (needs a running event loop; without one it
        only answers)."""
        now = self._timer()
        stale = self._read_at is None or now - self._read_at >= self.refresh_s
        if stale and (self._task is None or self._task.done()):
            try:
                self._task = asyncio.get_running_loop().create_task(self.refresh())
            except RuntimeError:
                return self.latest
            self._read_at = now
        return self.latest

    async def refresh(self) -> KvCache | None:
        """Read the page now; on failure keep the last good reading and note why."""
        try:
            resp = await self._client.get(self.url)
            resp.raise_for_status()
            cache = parse(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("kv_metrics_unreadable", url=self.url, error=self.error)
            return self.latest
        self._read_at = self._timer()
        if cache is None:
            self.error = f"{self.url} has no {CACHE_INFO} with num_gpu_blocks and block_size"
        else:
            self.latest, self.error = cache, None
        return self.latest

    def snapshot(self) -> dict[str, object]:
        """What ``/readyz`` shows."""
        c = self.latest
        return {"url": self.url, "blocks": None if c is None else c.blocks,
                "block_tokens": None if c is None else c.block_tokens,
                "usage": None if c is None or c.usage is None else round(c.usage, 3),
                "error": self.error}

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.aclose()
