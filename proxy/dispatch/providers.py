"""Every backend the proxy can send a model request to: the embedded engine(s) and the
upstream providers of the config file, with each model's :class:`Route`.

Models served only by the embedded engine need no config; a config file adds upstream
providers, replicas, fallbacks and aliases of the embedded model.
"""

from __future__ import annotations

import time

import httpx

from flowlift.errors import ConfigError, ModelNotFound, Overloaded
from flowlift.proxy.config import EmbeddedSpec, FileConfig
from flowlift.proxy.dispatch.backends import Backend, Backends
from flowlift.proxy.dispatch.routing import Route, has_untried, pick
from flowlift.proxy.dispatch.upstream import Upstream


class Providers:
    """Model name -> :class:`Route`; backend name -> embedded backend or upstream.

    Args:
        embedded: the in-process engines (may serve no model when every model is upstream).
        config: the parsed config file, or None (embedded models only).
        transport: httpx transport for every upstream (tests); None: the network.
        max_queue: requests waiting per embedded backend before the proxy answers 429
            (the merged setting, :attr:`ProxyConfig.max_queue`; the file's is not read here).
    """

    def __init__(self, embedded: Backends | None, config: FileConfig | None = None, *,
                 transport: httpx.AsyncBaseTransport | None = None,
                 max_queue: int = 256) -> None:
        self.embedded = embedded
        self.config = config
        self.max_queue = max_queue
        self.upstreams: dict[str, Upstream] = {}
        self._embedded_names: dict[str, Backend] = {}
        self.routes: dict[str, Route] = {}
        if embedded is not None:
            for model in embedded.models:
                _, backend = embedded.resolve(model)
                self._embedded_names[f"embedded:{model}"] = backend
                self.routes[model] = Route(model, (f"embedded:{model}",))
        if config is not None:
            self._configure(config, transport)

    def _configure(self, config: FileConfig, transport: httpx.AsyncBaseTransport | None) -> None:
        for name, spec in config.backends.items():
            if isinstance(spec, EmbeddedSpec):
                continue
            self.upstreams[name] = Upstream(name, spec, config.upstream_key(name),
                                            transport=transport)
        for model, spec in config.models.items():
            self.routes[model] = Route(model, self._names(config, spec.backends, model),
                                       self._names(config, spec.fallbacks, model),
                                       spec.total_timeout_s, spec.max_attempts)

    def _names(self, config: FileConfig, names: list[str], model: str) -> tuple[str, ...]:
        out = []
        for n in names:
            if not isinstance(config.backends[n], EmbeddedSpec):
                out.append(n)
            elif self.embedded is None:
                raise ConfigError(f"models.{model}: backend {n!r} is the embedded engine, "
                                  "but this proxy runs without one (--engine none)",
                                  param=f"models.{model}")
            else:
                out.append(f"embedded:{self.embedded.default_model}")
        return tuple(out)

    @property
    def models(self) -> list[str]:
        return list(self.routes)

    def route(self, model: object) -> Route:
        """The route of ``model`` (``"default"`` and embedded aliases resolved).

        Raises:
            ModelNotFound: a name that nothing serves.
        """
        if isinstance(model, str) and model in self.routes:
            return self.routes[model]
        if self.embedded is not None:
            name = self.embedded.canonical(model if isinstance(model, str) else None)
            if name in self.routes:
                return self.routes[name]
        raise ModelNotFound(str(model), self.models)

    def embedded_backend(self, name: str) -> tuple[str, Backend] | None:
        """(served model, backend) when ``name`` is an embedded backend."""
        backend = self._embedded_names.get(name)
        return None if backend is None else (name.removeprefix("embedded:"), backend)

    def available(self, name: str, now: float | None = None) -> bool:
        up = self.upstreams.get(name)
        if up is not None:
            return up.health.available(time.monotonic() if now is None else now)
        backend = self._embedded_names[name]
        return (backend.slots.queued < self.max_queue
                and backend.admitted < backend.max_concurrency + self.max_queue)

    def load(self, name: str) -> int:
        up = self.upstreams.get(name)
        if up is not None:
            return up.health.in_flight
        slots = self._embedded_names[name].slots
        return slots.in_use + slots.queued

    def choose(self, route: Route, affinity: str | None, tried: set[str]) -> str:
        """The backend for the next attempt.

        Raises:
            Overloaded: nothing can take it now: 503 with ``Retry-After`` until the
                first cool-down ends, or 429 when the proxy's own queues are full.
        """
        now = time.monotonic()
        name = pick(route, available=lambda n: self.available(n, now), load=self.load,
                    affinity=affinity, tried=tried)
        if name is not None:
            return name
        cooling = [self.upstreams[n].health.cooled_until - now for n in route.backends
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
        for up in self.upstreams.values():
            await up.aclose()

