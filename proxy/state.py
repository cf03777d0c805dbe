"""The proxy's settings and shared state (``app[STATE]``; no module globals)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from flowlift.costs import CostTracker
from flowlift.proxy.workflows.inferred import InferredWorkflows

if TYPE_CHECKING:
    from flowlift.local_engine.residency import ResidencyManager
    from flowlift.proxy.dispatch.backends import Backends
    from flowlift.proxy.workflows.registry import RunRegistry


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Settings of one proxy.

    Attributes:
        max_concurrency: engine requests in flight per backend.
        max_body_bytes: request bodies above this get HTTP 413.
        trace_dir: where each finished run's trace is written (JSON lines), or None.
        state_path: SQLite file of durable runs; None keeps runs in memory only.
        detached_timeout_s: a run nobody listens to for this long is cancelled.
        scheduling: ``"priority"`` (class, critical path, slack; prefix-grouped
            dispatch) or ``"fcfs"`` (the baseline).
        batch_prefill_budget: prompt tokens of batch work in prefill at once.
        batch_cap_when_interactive: batch slots while interactive work runs (None: half).
        api_keys: keys clients must send as ``Authorization: Bearer``; empty: no auth.
        max_queue: OpenAI requests waiting per engine before the proxy answers 429.
        max_sessions, session_ttl_s: bounds of the ``X-Flowlift-Session`` table (sessions
            kept; seconds a session lives after its last turn).
        max_runs: workflow runs active at once before ``POST /v1/workflows`` answers 429.
    """

    max_concurrency: int = 16
    max_body_bytes: int = 32 * 1024 * 1024
    trace_dir: Path | None = None
    state_path: Path | None = None
    detached_timeout_s: float = 300.0
    scheduling: str = "priority"
    batch_prefill_budget: int = 1024
    batch_cap_when_interactive: int | None = None
    api_keys: frozenset[str] = frozenset()
    max_queue: int = 256
    max_sessions: int = 10_000
    session_ttl_s: float = 1800.0
    max_runs: int = 4096


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


STATE: web.AppKey[ProxyState] = web.AppKey("flowlift", ProxyState)
