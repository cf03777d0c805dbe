"""How a pool of slots grants them: one frozen object
(:class:`~flowlift.proxy.dispatch.slots.scheduler.PrioritySlots`' policy), built once
(:class:`~flowlift.proxy.dispatch.backends.Backends` from
:class:`~flowlift.proxy.dispatch.settings.DispatchSettings`) in place of the keyword
arguments the slots once took one by one."""

from __future__ import annotations

from dataclasses import dataclass

from flowlift.proxy.dispatch.slots.programs import ProgramConfig
from flowlift.proxy.dispatch.slots.working_set import WorkingSetConfig


@dataclass(frozen=True, slots=True)
class SlotPolicy:
    """A slot pool's policy.

    Attributes:
        reserved_interactive: slots batch work may never take (at most capacity - 1).
        batch_cap_when_interactive: batch slots while interactive work is active
            (None: half the capacity).
        linger_s: how long interactive work counts as active after its last release
            (seconds).
        batch_prefill_budget: prompt tokens of batch work that may be in prefill at once
            (a single larger prompt still goes alone).
        fcfs: ignore priorities and reserve nothing: first come, first served (the
            baseline the benchmarks compare against).
        preempt: when interactive work is granted a slot, preempt running batch requests
            (those registered with ``PrioritySlots.register``) down to the batch cap (not
            with ``fcfs``).
        programs: program-level scheduling (least attained service per program,
            starvation bound, keeping a waiting session's KV; :mod:`.programs`); None:
            the defaults (on); off with ``fcfs``.
        working_set: working-set admission (:mod:`.working_set`): a request of a
            session outside the working set waits while the working set would not fit
            the engine's KV capacity; None: off; off with ``fcfs``.
    """

    reserved_interactive: int = 1
    batch_cap_when_interactive: int | None = None
    linger_s: float = 1.0
    batch_prefill_budget: int = 1024
    fcfs: bool = False
    preempt: bool = False
    programs: ProgramConfig | None = None
    working_set: WorkingSetConfig | None = None
