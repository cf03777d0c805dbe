"""Which engine serves which model, with a per-backend concurrency limit.

The limit keeps the engine's batch full without letting requests pile up inside it
where flowlift can no longer order them; waiting happens in flowlift's queue, where
it is measured (queue time in the trace).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flowlift.errors import ModelNotFound
from flowlift.local_engine.base import Engine
from flowlift.proxy.dispatch.scheduler import PrioritySlots


@dataclass(slots=True)
class Backend:
    name: str
    engine: Engine
    slots: PrioritySlots
    max_concurrency: int
    admitted: int = 0
    """OpenAI requests inside the embedded handler (counted from admission, before they
    reach the slot queue, so a simultaneous burst cannot slip past ``max_queue``)."""


class Backends:
    """Model name -> backend. The first model listed is the default.

    Args:
        engines: model name -> engine serving it (one engine may serve several names).
        max_concurrency: requests in flight per engine.
        fcfs: first come, first served everywhere (no priorities, no reserved slots, no
            prefix-grouped dispatch): the baseline of the scheduling benchmarks.
        batch_prefill_budget, batch_cap_when_interactive: see
            :class:`~flowlift.proxy.dispatch.scheduler.PrioritySlots`.
        aliases: extra names (e.g. ``"default"``) -> served model name.
    """

    def __init__(self, engines: Mapping[str, Engine], *, max_concurrency: int = 16,
                 aliases: Mapping[str, str] | None = None, fcfs: bool = False,
                 batch_prefill_budget: int = 1024,
                 batch_cap_when_interactive: int | None = None) -> None:
        self._slot_args = {"fcfs": fcfs, "batch_prefill_budget": batch_prefill_budget,
                           "batch_cap_when_interactive": batch_cap_when_interactive}
        self._max_concurrency = max_concurrency
        self._per_engine: dict[int, Backend] = {}
        self._by_model: dict[str, Backend] = {}
        self.fcfs = fcfs
        self.default_model: str | None = None
        self._aliases: dict[str, str] = dict(aliases or {})
        self.backends: list[Backend] = []
        self.engines: list[Engine] = []
        for model, engine in engines.items():
            self.add(model, engine)

    def add(self, model: str, engine: Engine, *, max_concurrency: int | None = None) -> None:
        """Serve ``model`` with ``engine`` (one slot pool per engine, however many names)."""
        backend = self._per_engine.get(id(engine))
        if backend is None:
            capacity = max_concurrency or self._max_concurrency
            backend = Backend(f"engine-{len(self._per_engine)}", engine,
                              PrioritySlots(capacity, **self._slot_args), capacity)
            self._per_engine[id(engine)] = backend
            self.backends.append(backend)
            self.engines.append(engine)
        self._by_model[model] = backend
        if self.default_model is None:
            self.default_model = model
            self._aliases.setdefault("default", model)

    def alias(self, name: str, model: str) -> None:
        """Let ``name`` stand for the served ``model``."""
        self._aliases[name] = model

    @property
    def models(self) -> list[str]:
        return list(self._by_model)

    def resolve(self, model: str | None) -> tuple[str, Backend]:
        """The served model name and its backend.

        Raises:
            ModelNotFound: for a name that is neither served nor an alias.
        """
        name = self.canonical(model)
        if name not in self._by_model:
            raise ModelNotFound(str(model), self.models)
        return name, self._by_model[name]

    def canonical(self, model: str | None) -> str:
        """The served name behind ``model`` (aliases resolved); unknown names unchanged."""
        return self._aliases.get(model or "default", model or self.default_model or "")

    def known(self) -> set[str]:
        return set(self._by_model) | set(self._aliases)
