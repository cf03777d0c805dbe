"""Tenants: who a proxy API key belongs to, what that tenant may see, and its limits.

A config file maps keys to tenants (:mod:`flowlift.proxy.config`)::

    [tenants.acme]
    api_key_env = "ACME_KEY"        # comma-separated keys of this tenant
    max_active_runs = 8             # workflow runs running at once, then 429
    requests_per_s = 5              # sustained request rate, then 429 + Retry-After
    burst = 10                      # requests above the rate taken at once (default:
                                    # requests_per_s, at least 1)
    tools = ["research"]            # the [tools.*] servers its agent steps may call
                                    # (default: none)

The old ``[server] api_keys_env`` still works: its keys are the tenant
:data:`DEFAULT_TENANT` (no limits but the proxy's own). With no key configured at all
there is one anonymous tenant (``None``): it sees everything, as before tenants.

:func:`flowlift.proxy.middleware.require_key` sets ``request["tenant"]`` (read it with
:func:`tenant_of`) and applies the rate limit. A tenant sees only its own runs, sessions
and inferred workflows: another tenant's id answers exactly what an unknown id answers
(404), never a 403 that would confirm it exists. Runs recorded before tenants existed
(no tenant in the store) belong to :data:`DEFAULT_TENANT`.

Run ids are per tenant: the same client-chosen id in two tenants names two runs. The
store keys a run by :func:`run_key` (``<tenant>/<id>``; the id alone for the anonymous
and the default tenant, so stores written before tenants read as they were), while every
answer, event and trace shows the client's own id (:func:`client_run_id`).

Tenant names come only from the config, so a ``tenant`` metrics label is bounded.
"""

from __future__ import annotations

import hmac
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NewType

from aiohttp import web

DEFAULT_TENANT = "default"
"""The tenant of ``[server] api_keys_env``'s keys, and of runs stored without a tenant."""
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A tenant's name: a config table key, a metrics label value and a namespace prefix."""
TENANT_KEY: web.RequestKey[str] = web.RequestKey("tenant", str)
"""``request[TENANT_KEY]`` (``"tenant"``): the request's tenant name (absent: anonymous)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of the proxy.

    Attributes:
        name: matches :data:`TENANT_NAME`.
        keys: its proxy API keys (``Authorization: Bearer <key>``).
        max_active_runs: workflow runs it may have running at once (None: no own limit).
        requests_per_s: sustained requests per second (None: no rate limit).
        burst: requests it may send at once above the rate (None: ``requests_per_s``
            rounded up, at least 1).
        tools: the ``[tools.*]`` servers its graphs may name (None: every server; the
            :data:`DEFAULT_TENANT` of ``[server] api_keys_env`` and the anonymous tenant).
    """

    name: str
    keys: frozenset[str]
    max_active_runs: int | None = None
    requests_per_s: float | None = None
    burst: int | None = None
    tools: frozenset[str] | None = None

    def reaches(self, server: str) -> bool:
        """May this tenant's agent steps call the tool server ``server``?"""
        return self.tools is None or server in self.tools


class TokenBucket:
    """A token bucket: ``rate_per_s`` tokens a second, at most ``capacity`` saved.

    The clock is injected (``clock() -> seconds``, monotonic) so tests need not sleep.
    """

    def __init__(self, rate_per_s: float, capacity: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or capacity < 1:
            raise ValueError("a token bucket needs rate_per_s > 0 and capacity >= 1")
        self.rate_per_s, self.capacity, self._clock = rate_per_s, capacity, clock
        self._tokens = float(capacity)
        self._at = clock()

    def take(self) -> float | None:
        """Take one token.

        Returns:
            None when one was taken; else the seconds until one will be there.
        """
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return None
        return (1 - self._tokens) / self.rate_per_s


@dataclass(slots=True)
class Tenants:
    """The configured tenants, by key and by name, with their rate limiters.

    Empty (no tenant): no key is asked and the one tenant is anonymous.
    """

    tenants: tuple[Tenant, ...] = ()
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, TokenBucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for t in self.tenants:
            if t.requests_per_s is not None:
                burst = t.burst if t.burst is not None else max(1, math.ceil(t.requests_per_s))
                self._buckets[t.name] = TokenBucket(t.requests_per_s, burst, self.clock)

    @classmethod
    def build(cls, api_keys: Iterable[str], tenants: Iterable[Tenant] = (),
              clock: Callable[[], float] = time.monotonic) -> Tenants:
        """The tenants of a proxy: ``tenants`` plus, when ``api_keys`` holds any, the
        :data:`DEFAULT_TENANT` with those keys and no limits."""
        keys = frozenset(api_keys)
        default = (Tenant(DEFAULT_TENANT, keys),) if keys else ()
        return cls((*default, *tenants), clock)

    def __bool__(self) -> bool:
        return bool(self.tenants)

    def names(self) -> frozenset[str]:
        """The configured tenants' names (empty: anonymous only)."""
        return frozenset(t.name for t in self.tenants)

    def by_name(self, name: str | None) -> Tenant | None:
        """The tenant called ``name``, or None (unknown, or None: anonymous)."""
        return next((t for t in self.tenants if t.name == name), None)

    def by_key(self, token: str) -> Tenant | None:
        """The tenant holding ``token`` as a key (compared in constant time), or None."""
        found = None
        for t in self.tenants:
            for key in t.keys:
                if hmac.compare_digest(token.encode(), key.encode()):
                    found = t
        return found

    def admit(self, tenant: Tenant) -> float | None:
        """Count one request of ``tenant`` against its rate.

        Returns:
            None when admitted; else the seconds to wait (the 429's ``Retry-After``).
        """
        bucket = self._buckets.get(tenant.name)
        return None if bucket is None else bucket.take()


def tenant_of(request: web.Request) -> str | None:
    """The request's tenant name (None: anonymous, the proxy asks no key)."""
    return request.get(TENANT_KEY)


def visible(owner: str | None, tenant: str | None) -> bool:
    """May ``tenant`` see what ``owner`` owns? The anonymous tenant (``None``: no keys
    configured) sees everything; a tenant sees its own, and :data:`DEFAULT_TENANT` also
    what has no owner (recorded before tenants)."""
    return tenant is None or (owner or DEFAULT_TENANT) == tenant


RunKey = NewType("RunKey", str)
"""A run's key in the store, the engines and the sessions (:func:`run_key`), as distinct
from the id its client knows it by (:func:`client_run_id`)."""


def run_key(tenant: str | None, run_id: str) -> RunKey:
    """The store's key of ``tenant``'s run ``run_id``: ``<tenant>/<run_id>``, or ``run_id``
    itself for the anonymous tenant (None) and :data:`DEFAULT_TENANT` (the runs of stores
    written before tenants). A client's id never holds ``/``, so keys never collide."""
    return RunKey(run_id if tenant is None or tenant == DEFAULT_TENANT
                  else f"{tenant}/{run_id}")


def client_run_id(key: str, tenant: str | None) -> str:
    """The id ``tenant``'s client knows its run ``key`` by (the inverse of :func:`run_key`;
    the anonymous tenant, which sees every run, knows each by its whole key)."""
    prefix = "" if tenant is None or tenant == DEFAULT_TENANT else f"{tenant}/"
    return key[len(prefix):] if prefix and key.startswith(prefix) else key
