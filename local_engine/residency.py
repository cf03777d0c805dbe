"""Which models stay loaded: a residency manager for several models in one memory budget.

Two layers, as everywhere in flowlift:

* pure decisions over data -- :func:`lookahead` turns the compiler's residency plan
  (:class:`flowlift.report.ResidencyReport`: per model, when a run first needs it and
  until when) and the steps already queued into each model's *next use*;
  :func:`choose_evictions` picks what to unload so a model fits: never a model a queued
  step of a running workflow needs next (or one with requests in flight), otherwise
  the resident model whose next use is furthest away first (Belady's rule, with the plan
  standing in for the future);
* I/O at the edge -- :class:`ResidencyManager` loads and unloads through each model's
  :class:`~flowlift.local_engine.base.Engine` (``start()`` loads, ``close()`` unloads),
  one change at a time; on a GPU a model leaving *sleeps* instead (``sleep()`` /
  ``wake_up()``: vLLM's sleep mode, weights parked in host memory) when the host has
  room for its weights (:func:`flowlift.local_engine.gpu_swap.swap_mode`); a request
  holds a lease on its model while it runs, so nothing unloads a model under a
  generation. :class:`ResidentEngine` (:mod:`flowlift.local_engine.resident`) puts one
  managed model behind the ordinary engine interface, so the proxy's dispatch (workflow
  steps and OpenAI requests alike) loads what it needs on the way to the engine.

Errors: :class:`flowlift.errors.EngineError` when a model cannot fit without evicting a
model that is needed now, or is bigger than the whole budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flowlift.errors import EngineError
from flowlift.local_engine import gpu_swap
from flowlift.local_engine.base import Engine
from flowlift.report import ResidencyReport

NEVER = math.inf


@dataclass(frozen=True, slots=True)
class Lookahead:
    """What the queued and planned work says about each model.

    Attributes:
        next_use_ms: model -> milliseconds until it is next needed (``0`` now; a model
            missing here is not needed again: :data:`NEVER`).
        pinned: models a queued step of a running workflow needs next: never evicted.
    """

    next_use_ms: Mapping[str, float] = field(default_factory=dict)
    pinned: frozenset[str] = frozenset()

    def next_use(self, model: str) -> float:
        return 0.0 if model in self.pinned else self.next_use_ms.get(model, NEVER)

    def merge(self, other: Lookahead) -> Lookahead:
        """Both lookaheads at once (several running workflows): the sooner use wins."""
        uses = dict(self.next_use_ms)
        for model, ms in other.next_use_ms.items():
            uses[model] = min(ms, uses.get(model, NEVER))
        return Lookahead(uses, self.pinned | other.pinned)


def lookahead(plan: Sequence[ResidencyReport], elapsed_ms: float,
              queued_models: Iterable[str] = ()) -> Lookahead:
    """One running workflow's lookahead.

    Args:
        plan: the compiler's residency plan for the run (``CompileReport.residency``;
            times are from the run's start).
        elapsed_ms: how long the run has been going.
        queued_models: models of its steps that are ready and waiting to dispatch.

    Returns:
        Next use per model (``0`` while its window is open, the time to ``load_by_ms``
        before it; windows that ended are dropped) with the queued models pinned.
    """
    uses: dict[str, float] = {}
    for window in plan:
        if window.keep_until_ms >= elapsed_ms:
            uses[window.model] = max(window.load_by_ms - elapsed_ms, 0.0)
    queued = frozenset(queued_models)
    for model in queued:
        uses[model] = 0.0
    return Lookahead(uses, queued)


def choose_evictions(load: str, sizes_mb: Mapping[str, float], resident: Iterable[str],
                     budget_mb: float, ahead: Lookahead,
                     busy: Iterable[str] = ()) -> list[str]:
    """Models to unload, in order, so ``load`` fits in ``budget_mb``.

    Args:
        load: the model to load.
        sizes_mb: memory of every model.
        resident: models loaded now.
        budget_mb: memory for all loaded models together.
        ahead: next uses and pinned models.
        busy: models with requests in flight (never evicted either).

    Raises:
        EngineError: ``load`` is bigger than the budget, or it fits only by evicting a
            pinned or busy model.
    """
    loaded = [m for m in resident if m != load]
    need = sizes_mb[load]
    if need > budget_mb:
        raise EngineError(f"model {load} needs {need:.0f} MB; the budget is {budget_mb:.0f} MB")
    free = budget_mb - sum(sizes_mb[m] for m in loaded)
    keep = ahead.pinned | frozenset(busy)
    # furthest next use first; ties: the bigger model (fewer unloads)
    candidates = sorted((m for m in loaded if m not in keep),
                        key=lambda m: (-ahead.next_use(m), -sizes_mb[m], m))
    out: list[str] = []
    for model in candidates:
        if free >= need:
            break
        out.append(model)
        free += sizes_mb[model]
    if free < need:
        held = sorted(m for m in loaded if m in keep)
        raise EngineError(f"model {load} ({need:.0f} MB) does not fit in {budget_mb:.0f} MB "
                          f"without unloading {', '.join(held)}, needed by queued steps")
    return out


@dataclass(slots=True)
class ManagedModel:
    """A model the manager may load: its engine and its memory when loaded."""

    engine: Engine
    memory_mb: float


class ResidencyManager:
    """Loads and unloads models within a memory budget (see the module docstring).

    A model that does not fit until a busy or pinned model is done *waits* (re-checking
    whenever a lease ends, and every ``recheck_s``) instead of failing; only a model
    bigger than the whole budget, or a wait past ``max_wait_s``, is an error.

    Args:
        models: model name -> :class:`ManagedModel`.
        budget_mb: memory all loaded models may use together.
        lookahead: called for the current :class:`Lookahead` when :meth:`ensure` is not
            given one (the proxy passes its running workflows' plans and queues).
        max_wait_s: longest :meth:`ensure` waits for room.
        recheck_s: how often a waiting :meth:`ensure` looks again without a lease ending.
        host_available_mb: the host's available memory now (default: ``/proc/meminfo``):
            whether an evicted model that can sleep sleeps or is unloaded.

    Attributes:
        resident: loaded models, in load order.
        asleep: models evicted by a sleep (their process kept; not in ``resident``).
        events: ``("load" | "unload" | "sleep" | "wake", model)`` in the order they
            happened.
        loads: model -> how many times it was loaded (boot, preloads and wakes included).
        unloads: model -> how many times it was unloaded (sleeps included).
        sleeps: model -> how many of its unloads were sleeps.
    """

    def __init__(self, models: Mapping[str, ManagedModel], budget_mb: float, *,
                 lookahead: Callable[[], Lookahead] | None = None,
                 max_wait_s: float = 300.0, recheck_s: float = 0.5,
                 host_available_mb: Callable[[], float] = gpu_swap.host_available_mb) -> None:
        self.models = dict(models)
        self.host_available_mb = host_available_mb
        self.asleep: set[str] = set()
        self.sleeps: Counter[str] = Counter()
        self.budget_mb = budget_mb
        self.lookahead = lookahead
        self.max_wait_s = max_wait_s
        self.recheck_s = recheck_s
        self.resident: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        self._leases: Counter[str] = Counter()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()

    def _busy(self) -> list[str]:
        return [m for m in self.resident
                if self._leases[m] or self.models[m].engine.running()]

    def _record(self, kind: str, model: str) -> None:
        self.events.append((kind, model))
        (self.loads if kind in ("load", "wake") else self.unloads)[model] += 1
        if kind == "sleep":
            self.sleeps[model] += 1

    async def _evict(self, model: str) -> None:
        """Take ``model`` off the GPU: a sleep where it can and the host has room for
        its weights, else an unload (the engine closed)."""
        engine = self.models[model].engine
        how = gpu_swap.swap_mode(engine.sleep_host_mb() > 0, engine.sleep_host_mb(),
                                 self.host_available_mb())
        if how == "sleep":
            await engine.sleep()
            self.asleep.add(model)
        else:
            await engine.close()
        self.resident.remove(model)
        self._record(how, model)

    async def _load(self, model: str) -> None:
        """Put ``model`` on the GPU: wake it if it sleeps, else start it."""
        engine = self.models[model].engine
        if model in self.asleep:
            await engine.wake_up()
            self.asleep.discard(model)
            kind = "wake"
        else:
            await engine.start()
            kind = "load"
        self.resident.append(model)
        self._record(kind, model)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def ensure(self, model: str, ahead: Lookahead | None = None) -> Engine:
        """Return ``model``'s engine, loaded, unloading others first when needed.

        Args:
            ahead: what the work ahead needs; ``None``: ask :attr:`lookahead`.

        Raises:
            EngineError: unknown model, a model bigger than the budget, or no room made
                within ``max_wait_s`` (see :func:`choose_evictions`).
        """
        if model not in self.models:
            raise EngineError(f"no managed model {model!r} (have {sorted(self.models)})")
        sizes = {m: spec.memory_mb for m, spec in self.models.items()}
        if sizes[model] > self.budget_mb:
            raise EngineError(f"model {model} needs {sizes[model]:.0f} MB; the budget is "
                              f"{self.budget_mb:.0f} MB")
        give_up = time.monotonic() + self.max_wait_s
        while True:
            async with self._lock:
                if model in self.resident:
                    return self.models[model].engine
                now = ahead if ahead is not None else (
                    self.lookahead() if self.lookahead else Lookahead())
                try:
                    victims = choose_evictions(model, sizes, self.resident, self.budget_mb,
                                               now, self._busy())
                except EngineError:
                    if time.monotonic() >= give_up:
                        raise
                    changed = self._changed  # room is held by work in flight: wait
                else:
                    for victim in victims:
                        await self._evict(victim)
                    await self._load(model)
                    self._notify()
                    return self.models[model].engine
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), self.recheck_s)

    @contextlib.asynccontextmanager
    async def use(self, model: str) -> AsyncIterator[Engine]:
        """``async with manager.use(model) as engine:`` -- loaded, and never evicted until
        the block ends (a lease).

        Raises:
            EngineError: as :meth:`ensure`.
        """
        engine = await self.ensure(model)
        self._leases[model] += 1  # no await since ensure returned: nothing slipped in
        try:
            yield engine
        finally:
            self._leases[model] -= 1
            self._notify()

    async def preload(self, model: str) -> bool:
        """Load ``model`` if it fits without unloading anything; True when resident."""
        async with self._lock:
            if model in self.resident:
                return True
            used = sum(self.models[m].memory_mb for m in self.resident)
            if used + self.models[model].memory_mb > self.budget_mb:
                return False
            await self._load(model)
            return True

    async def unload(self, model: str) -> None:
        """Unload ``model`` now if it is loaded or asleep (shutdown: in-flight work is not
        waited for)."""
        async with self._lock:
            if model in self.resident or model in self.asleep:
                await self.models[model].engine.close()
                if model in self.resident:
                    self.resident.remove(model)
                    self._record("unload", model)
                self.asleep.discard(model)
                self._notify()

    async def close(self) -> None:
        """Unload every model, the sleeping ones' processes included."""
        async with self._lock:
            for model in reversed(self.resident):
                await self.models[model].engine.close()
                self._record("unload", model)
            self.resident.clear()
            for model in sorted(self.asleep):
                await self.models[model].engine.close()
            self.asleep.clear()
