"""The dispatch settings: one frozen object, built once from the proxy's settings
(:meth:`DispatchSettings.from_config`), in place of the keyword arguments
:class:`~flowlift.proxy.dispatch.backends.Backends` once took one by one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from flowlift.proxy.dispatch.slots.prefill_ahead import AheadConfig
from flowlift.proxy.dispatch.slots.programs import ProgramConfig
from flowlift.proxy.dispatch.slots.working_set import WorkingSetConfig

if TYPE_CHECKING:
    from flowlift.proxy.config import ProxyConfig


@dataclass(frozen=True, slots=True)
class DispatchSettings:
    """How :class:`~flowlift.proxy.dispatch.backends.Backends` builds and runs its pools.

    Attributes:
        max_concurrency: requests in flight per embedded engine.
        max_queue: requests waiting per embedded backend before the proxy answers 429.
        aliases: extra names (e.g. ``"default"``) -> served model name.
        fcfs: first come, first served everywhere (no priorities, no reserved slots, no
            prefix-grouped dispatch): the baseline of the scheduling benchmarks.
        preempt: running batch requests on embedded engines are preempted for
            interactive work and resumed later (:mod:`.slots.preemption`).
        batch_prefill_budget, batch_cap_when_interactive: see
            :class:`~flowlift.proxy.dispatch.slots.scheduler.PrioritySlots`;
            ``batch_cap_when_interactive="auto"``: each engine that times its steps
            (:meth:`Engine.step_log`) gets a
            :class:`~flowlift.proxy.dispatch.slots.batch_cap.DynamicCap` at
            ``interactive_slowdown`` (the others half their slots), and every pool a
            learned linger (:class:`~flowlift.proxy.dispatch.slots.batch_cap.LingerModel`).
        interactive_slowdown: the most an interactive step may slow down (a ratio) under
            the ``"auto"`` caps.
        batch_cap: the steady batch cap of each embedded engine's slots (``steady`` of
            :class:`~flowlift.proxy.dispatch.slots.scheduler.PrioritySlots`; ``"auto"``:
            from the same dynamic plan, on engines that time their steps; None: none).
        prefill_ahead: when the embedded engines prefill a step's known prompt start
            while a tool it waits for is out (:mod:`.slots.prefill_ahead`).
        programs: program-level scheduling on every pool (:mod:`.slots.programs`; None:
            on, with the defaults of :class:`~.slots.programs.ProgramConfig`; off with
            ``fcfs``).
        working_set: working-set admission on every embedded engine
            (:mod:`.slots.working_set`; None: off; off with ``fcfs``).
    """

    max_concurrency: int = 16
    max_queue: int = 256
    aliases: Mapping[str, str] = field(default_factory=dict)
    fcfs: bool = False
    preempt: bool = False
    batch_prefill_budget: int = 1024
    batch_cap_when_interactive: int | Literal["auto"] | None = None
    interactive_slowdown: float = 1.3
    batch_cap: int | Literal["auto"] | None = None
    prefill_ahead: AheadConfig = field(default_factory=AheadConfig)
    programs: ProgramConfig | None = None
    working_set: WorkingSetConfig | None = None

    @classmethod
    def from_config(cls, config: ProxyConfig) -> DispatchSettings:
        """The dispatch part of the proxy's merged settings (flags > file > defaults)."""
        return cls(max_concurrency=config.max_concurrency, max_queue=config.max_queue,
                   fcfs=config.scheduling == "fcfs",
                   preempt=config.scheduling == "preempt",
                   batch_prefill_budget=config.batch_prefill_budget,
                   batch_cap_when_interactive=config.batch_cap_when_interactive,
                   interactive_slowdown=config.interactive_slowdown,
                   batch_cap=config.batch_cap,
                   prefill_ahead=AheadConfig(enabled=config.prefill_ahead,
                                             max_kv_usage=config.prefill_ahead_max_kv_usage),
                   programs=ProgramConfig(enabled=config.program_scheduling,
                                          max_wait_s=config.program_max_wait_s),
                   working_set=WorkingSetConfig(enabled=config.working_set))
