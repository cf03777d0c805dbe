"""The proxy's shared state (``app[STATE]``; no module globals). Its settings,
:class:`~flowlift.proxy.config.ProxyConfig`, are importable from here too."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from flowlift.costs import CostTracker
from flowlift.proxy.config import ProxyConfig
from flowlift.proxy.tenants import Tenants
from flowlift.proxy.tools import ToolServers
from flowlift.proxy.workflows.inferred import InferredWorkflows

if TYPE_CHECKING:
    from flowlift.local_engine.residency import ResidencyManager
    from flowlift.proxy.dispatch.backends import Backends
    from flowlift.proxy.workflows.registry import RunRegistry


@dataclass(slots=True)
class ProxyState:
    backends: Backends
    """Every backend (embedded and upstream), each model's route, aliases."""
    runs: RunRegistry
    config: ProxyConfig
    costs: CostTracker = field(default_factory=CostTracker)
    inferred: InferredWorkflows = field(default_factory=InferredWorkflows)
    started_at: float = field(default_factory=time.time)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    load_error: str | None = None
    load_time_s: float | None = None
    residency: ResidencyManager | None = None
    prices: dict[str, float] = field(default_factory=dict)
    """Model name -> price per 1,000 tokens (config ``[models."x"] price_per_1k_tokens``)."""
    tenants: Tenants = field(default_factory=Tenants)
    """Who each proxy key belongs to, and the tenants' rate limits (none: no auth)."""
    tools: ToolServers = field(default_factory=lambda: ToolServers({}))
    """The ``[tools.*]`` servers agent steps may call on the proxy (:mod:`flowlift.proxy.tools`)."""


STATE: web.AppKey[ProxyState] = web.AppKey("flowlift", ProxyState)
