"""The one registry of backends: every embedded engine and upstream provider the proxy
can send a model request to, each model's :class:`~flowlift.proxy.dispatch.routing.routing.Route`,
aliases and the default model.

Each embedded engine has one pool of priority slots (however many names it serves); the
upstream backends of a route share one pool sized to their connection limits. A pool
keeps the backend's batch full without letting requests pile up inside it where
flowlift can no longer order them; waiting happens in flowlift's queue, where it is
measured (queue time in the trace).

Models served only by the embedded engine need no config; a config file adds upstream
providers, replicas, fallbacks and aliases of the embedded model.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from flowlift.errors import ConfigError, ModelNotFound, Overloaded
from flowlift.local_engine.base import Engine
from flowlift.local_engine.models import served_name
from flowlift.prefix_cache import PrefixIndex
from flowlift.proxy.config import BatchSpec, EmbeddedSpec, FileConfig, UpstreamSpec
from flowlift.proxy.dispatch.batch.api import BatchClient
from flowlift.proxy.dispatch.batch.pool import BatchPool, JournalRouter
from flowlift.proxy.dispatch.batch.tier_profiles import default_book
from flowlift.proxy.dispatch.routing.fleet_hints import ProgramSteps
from flowlift.proxy.dispatch.routing.hints import SessionBook
from flowlift.proxy.dispatch.routing.latency import Demand, Features, LatencyBook
from flowlift.proxy.dispatch.routing.routing import Route, has_untried, pick
from flowlift.proxy.dispatch.settings import DispatchSettings
from flowlift.proxy.dispatch.slots.batch_cap import BatchPlan, DynamicCap, LingerModel
from flowlift.proxy.dispatch.slots.policy import SlotPolicy
from flowlift.proxy.dispatch.slots.prefill_ahead import PrefillAhead
from flowlift.proxy.dispatch.slots.programs import ProgramConfig
from flowlift.proxy.dispatch.slots.scheduler import PrioritySlots
from flowlift.proxy.dispatch.upstream.engine import UpstreamEngine
from flowlift.proxy.dispatch.upstream.provider import Upstream

EMBEDDED = "embedded:"
"""Prefix of an embedded backend's name in routes (``embedded:<served model>``)."""


@dataclass(slots=True)
class Backend:
    """An engine with its pool of slots: an embedded engine, or a route's upstreams."""

    name: str
    engine: Engine
    slots: PrioritySlots
    max_concurrency: int
    admitted: int = 0
    """OpenAI requests inside the embedded handler (counted from admission, before they
    reach the slot queue, so a simultaneous burst cannot slip past ``max_queue``)."""
    prefixes: PrefixIndex | None = None
    """The prompts its engine was sent, in KV blocks (what its prefix cache probably
    holds, for the next plans: :func:`flowlift.proxy.workflows.planning.sent`)."""


@dataclass(frozen=True, slots=True)
class Local:
    """A route's choice of an embedded backend: run ``model`` on ``backend``, through
    its slots."""

    model: str
    backend: Backend


class Backends:
    """Model name -> route and backend; backend name -> embedded backend or upstream.
    The first embedded model is the default.

    Args:
        engines: model name -> embedded engine serving it (one engine may serve several
            names; may be empty when every model is upstream).
        settings: how the pools are built and run (:class:`.settings.DispatchSettings`,
            built once from the proxy's settings).
        config: the parsed config file (upstreams, routes, aliases), or None.
        transport: httpx transport for every upstream (tests); None: the network.

    Raises:
        ConfigError: a route names the embedded engine and ``engines`` is empty.
    """

    def __init__(self, engines: Mapping[str, Engine],
                 settings: DispatchSettings | None = None, *,
                 config: FileConfig | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        settings = settings or DispatchSettings()
        self.settings = settings
        auto = settings.batch_cap_when_interactive == "auto"
        self._auto_slowdown = (settings.interactive_slowdown
                               if auto or settings.batch_cap == "auto" else None)
        self._auto_when_interactive = auto
        self._batch_cap = settings.batch_cap
        self._new_slots = functools.partial(PrioritySlots, policy=SlotPolicy(
            fcfs=settings.fcfs, batch_prefill_budget=settings.batch_prefill_budget,
            batch_cap_when_interactive=(None if settings.batch_cap_when_interactive == "auto"
                                        else settings.batch_cap_when_interactive),
            preempt=settings.preempt, programs=settings.programs,
            working_set=settings.working_set))
        self._max_concurrency = settings.max_concurrency
        self._prefill_budget = settings.batch_prefill_budget
        self._per_engine: dict[int, Backend] = {}
        self._by_model: dict[str, Backend] = {}
        self._embedded: dict[str, Backend] = {}  # "embedded:<model>" -> backend
        self._pools: dict[str, Backend] = {}  # model -> the pool of its route's upstreams
        self.fcfs = settings.fcfs
        self.default_model: str | None = None
        self._aliases: dict[str, str] = dict(settings.aliases)
        self.backends: list[Backend] = []
        self.engines: list[Engine] = []
        self.config = config
        self.max_queue = settings.max_queue  # merged by config.settings (flag > file)
        self.upstreams: dict[str, Upstream] = {}
        self.sessions = SessionBook()  # SGLang sessions opened for runs (dispatch.hints)
        self.steps = ProgramSteps()  # each program's requests, counted (vllm-router hints)
        # how long a program whose tool is out keeps its KV (the routers' retention hint)
        self.keep_ttl_s = (settings.programs or ProgramConfig()).keep_ttl_s
        self.batch_pools: dict[str, BatchPool] = {}  # openai-batch backend -> its pool
        self.batch_journal = JournalRouter()  # their lines' records, routed to the runs
        self.turnarounds = default_book()  # per tier, learned from finished batches
        self.routes: dict[str, Route] = {}
        self.latency = LatencyBook()  # every upstream replica's predicted latency
        self._turn = 0  # round-robin's counter
        self.ahead = PrefillAhead(self, settings.prefill_ahead)
        for model, engine in engines.items():
            self.add(model, engine)
        if config is not None:
            self._configure(config, transport)

    # -- construction ----------------------------------------------------------------
    def add(self, model: str, engine: Engine) -> None:
        """Serve ``model`` with the embedded ``engine`` (one slot pool per engine)."""
        backend = self._backend(engine, self._max_concurrency)
        self._embedded[EMBEDDED + model] = backend
        self.routes[model] = Route(model, (EMBEDDED + model,))
        self._serve(model, backend)

    def _serve(self, model: str, backend: Backend) -> None:
        self._by_model[model] = backend
        if self.default_model is None:
            self.default_model = model
            self._aliases.setdefault("default", model)

    def _backend(self, engine: Engine, capacity: int) -> Backend:
        backend = self._per_engine.get(id(engine))
        if backend is None:
            backend = Backend(f"engine-{len(self._per_engine)}", engine,
                              self._new_slots(capacity, kv_usage=engine.kv_cache_usage,
                                              kv_capacity=engine.kv_capacity_tokens,
                                              kv_block=engine.kv_block_tokens,
                                              **self._dynamic(engine, capacity)),
                              capacity)
            self._per_engine[id(engine)] = backend
            self.backends.append(backend)
            self.engines.append(engine)
        return backend

    def _dynamic(self, engine: Engine, capacity: int) -> dict[str, Any]:
        """The dynamic plan, steady cap and learned linger of ``engine``'s slots (none:
        neither cap is auto, and no steady cap)."""
        steady = None if self._batch_cap == "auto" else self._batch_cap
        if self._auto_slowdown is None:
            return {"steady": steady}
        log = engine.step_log()
        fallback = BatchPlan(max(1, capacity // 2), self._prefill_budget)
        dynamic = None if log is None else DynamicCap(log, self._auto_slowdown, fallback)
        return {"linger": LingerModel(1.0, time.monotonic),
                "dynamic": dynamic if self._auto_when_interactive else None,
                "steady": dynamic if self._batch_cap == "auto" else steady}

    def _configure(self, config: FileConfig, transport: httpx.AsyncBaseTransport | None) -> None:
        for name, spec in config.backends.items():
            if isinstance(spec, UpstreamSpec):
                self.upstreams[name] = Upstream(name, spec, config.upstream_key(name),
                                                transport=transport)
            elif isinstance(spec, BatchSpec):
                client = BatchClient(spec, config.upstream_key(name), transport=transport)
                self.batch_pools[name] = BatchPool(
                    client, journal=self.batch_journal,
                    on_finished=lambda done: self.turnarounds.observe("batch",
                                                                      done.turnaround_s))
        for model, model_spec in config.models.items():
            route = Route(model, self._names(config, model_spec.backends, model),
                          self._names(config, model_spec.fallbacks, model),
                          model_spec.total_timeout_s, model_spec.max_attempts,
                          model_spec.routing, model_spec.affinity_max_slowdown)
            self.routes[model] = route
            upstreams = [self.upstreams[n] for n in route.backends if n in self.upstreams]
            if upstreams:
                capacity = sum(up.spec.max_connections for up in upstreams)
                self._pools[model] = self._backend(UpstreamEngine(self, route), capacity)
                if model not in self._by_model:
                    self._serve(model, self._pools[model])
            elif model not in self._by_model:
                self.alias(model, route.backends[0].removeprefix(EMBEDDED))

    def _names(self, config: FileConfig, names: list[str], model: str) -> tuple[str, ...]:
        out = []
        for n in names:
            spec = config.backends[n]
            if not isinstance(spec, EmbeddedSpec):
                out.append(n)
                continue
            if not self._embedded:
                raise ConfigError(f"models.{model}: backend {n!r} is the embedded engine, "
                                  "but this proxy runs without one (--engine none)",
                                  param=f"models.{model}")
            key = EMBEDDED + (served_name(spec.model) if spec.model
                              else str(self.default_model))
            if key not in self._embedded:
                served = ", ".join(k.removeprefix(EMBEDDED) for k in self._embedded)
                raise ConfigError(f"backends.{n}.model: {spec.model!r} is not an embedded "
                                  f"model of this proxy (it serves {served}); start it with "
                                  "`flowlift serve --config` (which loads every backend's "
                                  "model) or `--extra-model`", param=f"backends.{n}.model")
            out.append(key)
        return tuple(out)

    def alias(self, name: str, model: str) -> None:
        """Let ``name`` stand for the served ``model``."""
        self._aliases[name] = model

    # -- names -----------------------------------------------------------------------
    @property
    def models(self) -> list[str]:
        """Models served by a backend (embedded or upstream), aliases excluded."""
        return list(self._by_model)

    def known(self) -> set[str]:
        """Every name a request may use: served models and aliases."""
        return set(self._by_model) | set(self._aliases)

    def canonical(self, model: str | None) -> str:
        """The served name behind ``model`` (aliases resolved); unknown names unchanged."""
        return self._aliases.get(model or "default", model or self.default_model or "")

    def resolve(self, model: str | None) -> tuple[str, Backend]:
        """The served model name and its backend (a route with upstreams: their pool).

        Raises:
            ModelNotFound: for a name that is neither served nor an alias.
        """
        name = self.canonical(model)
        if name not in self._by_model:
            raise ModelNotFound(str(model), self.models)
        return name, self._by_model[name]

    def route(self, model: object) -> Route:
        """The route of ``model`` (``"default"`` and embedded aliases resolved).

        Raises:
            ModelNotFound: a name that nothing serves.
        """
        if isinstance(model, str) and model in self.routes:
            return self.routes[model]
        name = self.canonical(model if isinstance(model, str) else None)
        if name in self.routes:
            return self.routes[name]
        raise ModelNotFound(str(model), list(self.routes))

    def pool(self, route: Route) -> Backend | None:
        """The slot pool of ``route``'s upstream backends (None: it has none)."""
        return self._pools.get(route.model)

    def batch_pool(self, model: str) -> BatchPool | None:
        """The batch pool of ``model``'s ``batch`` backend (None: it has none)."""
        spec = self.config.models.get(model) if self.config is not None else None
        return None if spec is None or spec.batch is None else self.batch_pools[spec.batch]

    def local(self, name: str) -> Local | None:
        """The embedded backend behind backend ``name``, or None for an upstream."""
        backend = self._embedded.get(name)
        return None if backend is None else Local(name.removeprefix(EMBEDDED), backend)

    def local_of(self, model: str | None) -> Local | None:
        """The embedded backend of a model whose route has nothing else (None: a route
        with upstreams, or a name nothing serves)."""
        try:
            route = self.route(model)
        except ModelNotFound:
            return None
        found = [self.local(name) for name in route.backends]
        return found[0] if len(found) == 1 and found[0] is not None else None

    # -- routing ---------------------------------------------------------------------
    def available(self, name: str, now: float | None = None) -> bool:
        up = self.upstreams.get(name)
        if up is not None:
            return up.health.available(time.monotonic() if now is None else now)
        backend = self._embedded[name]
        return (backend.slots.queued < self.max_queue
                and backend.admitted < backend.max_concurrency + self.max_queue)

    def load(self, name: str) -> int:
        up = self.upstreams.get(name)
        if up is not None:
            return up.health.in_flight
        slots = self._embedded[name].slots
        return slots.in_use + slots.queued

    def features(self, name: str, demand: Demand) -> Features:
        """``demand`` on backend ``name`` as it stands now (its requests in flight, the
        prefix it is expected to hold)."""
        return self.latency.features(name, demand, self.load(name))

    def predict(self, route: Route, demand: Demand, now: float) -> Callable[[str], float | None]:
        """Predicted seconds until ``demand`` is answered, per backend of ``route``
        (None: an embedded backend, or an upstream with too few recent answers)."""
        output = self.latency.expected_output(route.model, demand.max_output_tokens)

        def predicted(name: str) -> float | None:
            if name not in self.upstreams:
                return None
            return self.latency.predict(name, self.features(name, demand), output, now)
        return predicted

    def choose(self, route: Route, affinity: str | None, tried: set[str],
               demand: Demand | None = None) -> str:
        """The backend for the next attempt (by the route's strategy; ``demand``: what
        is known of the request, for ``"predicted-latency"``).

        Raises:
            Overloaded: nothing can take it now: 503 with ``Retry-After`` until the
                first cool-down ends, or 429 when the proxy's own queues are full.
        """
        now = time.monotonic()
        self._turn += 1
        predict = None
        if route.predicts:
            predict = self.predict(route, demand or Demand(affinity=affinity), now)
        name = pick(route, available=lambda n: self.available(n, now), load=self.load,
                    affinity=affinity, tried=tried, predict=predict, turn=self._turn,
                    noise=self.latency.spread)
        if name is not None:
            return name
        cooling = [self.upstreams[n].health.wait_s(now) for n in route.backends
                   if n in self.upstreams and self.upstreams[n].health.cooling(now)]
        if cooling and len(cooling) == len(route.backends):
            raise Overloaded(f"every backend of model {route.model!r} is cooling down after "
                             "failures", retry_after_s=min(cooling), status=503)
        raise Overloaded(f"model {route.model!r} is at capacity (queue or connection limit "
                         "reached); retry shortly", retry_after_s=1.0, status=429)

    def untried(self, route: Route, tried: set[str]) -> bool:
        now = time.monotonic()
        return has_untried(route, available=lambda n: self.available(n, now), tried=tried)

    async def aclose(self) -> None:
        """Close every upstream's connection pool and stop waiting for batches (they run
        on; a restarted proxy resumes them), close the engines' sessions and abort the
        prefill-aheads still running. The engines close on their own."""
        await self.sessions.aclose()
        await self.ahead.aclose()
        for up in self.upstreams.values():
            await up.aclose()
        for pool in self.batch_pools.values():
            await pool.aclose()
            await pool.client.aclose()
