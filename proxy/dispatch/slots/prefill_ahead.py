"""Prefill-ahead: the known start of the step that comes next, prefilled while a
client-run ``@tool`` step (or an agent step's tool calls) is out.

The workflow graph says which model step reads a tool's output and what its prompt is
up to that hole (:mod:`flowlift.proxy.workflows.ahead`). While the app runs the tool,
the embedded engine computes that prefix's KV at the lowest priority
(:meth:`~flowlift.local_engine.base.Engine.prefill`: one output token, then the request
ends and its blocks stay in vLLM's prefix cache), so when the result comes back the
step prefills only the rest. KVFlow (2025) and NVIDIA Dynamo do this for a *predicted*
next agent step; here the next step is known, not guessed.

It never changes an output: the step's own request is unchanged (greedy decoding of
the same tokens; cached KV is the KV the step would compute), and a prefill-ahead that
fails only logs. It gives way to real work:

* none is issued while the engine's KV cache is fuller than ``max_kv_usage``
  (:meth:`~flowlift.local_engine.base.Engine.kv_cache_usage`), while the backend's
  slots are all taken or requests wait for one, or while ``max_in_flight`` are already
  running on that engine;
* those in flight are aborted (their memory released) as soon as the KV cache passes
  ``max_kv_usage`` (checked every ``check_every_s`` while any runs);
* the blocks they leave in the cache are ordinary cached blocks: vLLM evicts them
  first-in-line (least recently used) when a request needs the room.

Only embedded backends get prefill-ahead (an upstream's cache is its own business).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowlift.errors import FlowliftError
from flowlift.local_engine.base import GenerationRequest, SamplingOptions
from flowlift.proxy.dispatch.slots.scheduler import CLASS_RANK, Priority, PrioritySlots
from flowlift.proxy.dispatch.tool_turns import ToolTurn
from flowlift.tracing import get_logger

if TYPE_CHECKING:
    from flowlift.local_engine.base import Engine
    from flowlift.proxy.dispatch.backends import Backends

log = get_logger("flowlift.prefill_ahead")

AHEAD_PRIORITY = Priority(CLASS_RANK["idle"] + 1).engine_priority()
"""vLLM priority of a prefill-ahead: after every step, idle-tier work included."""


@dataclass(frozen=True, slots=True)
class AheadConfig:
    """When prefill-ahead runs.

    Attributes:
        enabled: False turns it off (``flowlift serve --no-prefill-ahead``).
        max_kv_usage: KV-cache share (0 to 1) above which none is issued and those in
            flight are aborted.
        max_in_flight: most prefill-aheads running at once per engine.
        check_every_s: how often the KV cache is checked while one runs (seconds).
    """

    enabled: bool = True
    max_kv_usage: float = 0.7
    max_in_flight: int = 2
    check_every_s: float = 0.05


def skip_reason(config: AheadConfig, *, kv_usage: float | None, in_flight: int,
                slots: PrioritySlots) -> str | None:
    """Why a prefill-ahead must not start now, or ``None`` when it may (pure).

    Returns:
        ``"off"``, ``"memory"`` (KV cache above ``max_kv_usage``), ``"in_flight"``
        (``max_in_flight`` running) or ``"busy"`` (every slot taken, or steps waiting
        for one).
    """
    if not config.enabled:
        return "off"
    if kv_usage is not None and kv_usage >= config.max_kv_usage:
        return "memory"
    if in_flight >= config.max_in_flight:
        return "in_flight"
    if slots.in_use >= slots.capacity or slots.queued:
        return "busy"
    return None


class PrefillAhead:
    """Issues prefill-aheads on the embedded engines of ``backends``.

    Args:
        backends: the proxy's backends (the embedded one of a request's model is used).
        config: when to run them.

    Attributes:
        counts: ``issued``, ``done``, ``failed``, ``unsupported`` (the engine keeps no
            prefix cache: :meth:`~flowlift.local_engine.base.Engine.prefill` returned
            None), ``released`` (aborted under memory pressure) and
            ``skipped_<reason>`` (:func:`skip_reason`) so far.
    """

    def __init__(self, backends: Backends, config: AheadConfig = AheadConfig()) -> None:
        self.backends, self.config = backends, config
        self.counts: Counter[str] = Counter()
        self._running: dict[int, set[asyncio.Task[None]]] = {}  # id(engine) -> tasks
        self._watchers: dict[int, asyncio.Task[None]] = {}

    def issue(self, request: GenerationRequest, upto: str) -> bool:
        """Start prefilling ``request``'s prompt up to the marker ``upto`` in the
        background when its model runs on an embedded engine with room to spare.

        Args:
            request: the step's next request as far as known (``tools`` allowed: they
                become plain messages as in the dispatcher); its id and priority are
                replaced.
            upto: the marker where the known prompt ends.

        Returns:
            True when a prefill-ahead started.
        """
        if not self.config.enabled:
            return False
        local = self.backends.local_of(request.model)
        if local is None:
            return False
        engine = local.backend.engine
        tasks = self._running.setdefault(id(engine), set())
        reason = skip_reason(self.config, kv_usage=engine.kv_cache_usage(),
                             in_flight=len(tasks), slots=local.backend.slots)
        if reason is not None:
            self.counts[f"skipped_{reason}"] += 1
            log.debug("prefill_ahead_skipped", request_id=request.request_id, reason=reason)
            return False
        plain = ToolTurn(request).request if request.tools else request
        plain = dataclasses.replace(plain, model=local.model, priority=AHEAD_PRIORITY,
                                    request_id=f"{request.request_id}:ahead",
                                    sampling=SamplingOptions(max_tokens=1))
        task = asyncio.create_task(self._run(engine, plain, upto))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        self.counts["issued"] += 1
        watcher = self._watchers.get(id(engine))
        if watcher is None or watcher.done():
            self._watchers[id(engine)] = asyncio.create_task(self._watch(engine, tasks))
        return True

    async def _run(self, engine: Engine, request: GenerationRequest, upto: str) -> None:
        try:
            usage = await engine.prefill(request, upto)
        except Exception as exc:  # never the step's failure: its own request runs anyway
            self.counts["failed"] += 1
            text = exc.message if isinstance(exc, FlowliftError) else repr(exc)
            log.info("prefill_ahead_failed", request_id=request.request_id, error=text)
            return
        self.counts["done" if usage is not None else "unsupported"] += 1
        if usage is not None:
            log.debug("prefill_ahead_done", request_id=request.request_id,
                      prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens)

    async def _watch(self, engine: Engine, tasks: set[asyncio.Task[None]]) -> None:
        """While prefill-aheads run on ``engine``: abort them all once its KV cache passes
        ``max_kv_usage``."""
        while tasks:
            usage = engine.kv_cache_usage()
            if usage is not None and usage >= self.config.max_kv_usage:
                for task in list(tasks):
                    if task.cancel():
                        self.counts["released"] += 1
                log.info("prefill_ahead_released", kv_usage=round(usage, 3),
                         aborted=len(tasks))
            await asyncio.sleep(self.config.check_every_s)

    def in_flight(self) -> int:
        """Prefill-aheads running now, on all engines."""
        return sum(len(t) for t in self._running.values())

    async def aclose(self) -> None:
        """Abort every prefill-ahead still running (proxy shutdown)."""
        tasks = [t for ts in self._running.values() for t in ts]
        tasks += list(self._watchers.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
