"""Prefix warm-up within a run: of the sibling steps that share a prompt prefix (the
plan's ``prefix_group``), the first ready one goes; the rest wait until its prefill is
done (or :data:`WARM_WAIT_S` passed), so they hit the engine's prefix cache instead of
prefilling the same tokens side by side (Parrot, OSDI'24; SGLang's RadixAttention).
"""

from __future__ import annotations

import asyncio

from flowlift.compiler import Plan
from flowlift.tracing import get_logger

log = get_logger("flowlift.runs")
WARM_WAIT_S = 30.0  # longest a step waits for its prefix group's first prefill


class PrefixWarmup:
    """Which step warms each prefix group of one run, and who waits for it.

    Args:
        fcfs: the proxy schedules first come first served (a benchmark baseline): no
            step waits.
    """

    def __init__(self, *, fcfs: bool = False) -> None:
        self.fcfs = fcfs
        self._warmer: dict[int, str] = {}  # prefix group -> the step that prefills it
        self._warm: dict[int, asyncio.Event] = {}  # prefix group -> set once prefilled

    def warmer(self, plan: Plan | None, step_id: str) -> str | None:
        """The step that warms ``step_id``'s prefix group (None: no group, or none yet)."""
        group = plan.prefix_group.get(step_id) if plan else None
        return None if group is None else self._warmer.get(group)

    async def wait(self, plan: Plan | None, step_id: str) -> None:
        """Before ``step_id``'s first try: become its group's warmer, or wait (at most
        :data:`WARM_WAIT_S` seconds) until the warmer's prefill is done."""
        group = plan.prefix_group.get(step_id) if plan else None
        if group is None or self.fcfs:
            return
        if self._warmer.setdefault(group, step_id) == step_id:
            return
        event = self._warm.setdefault(group, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=WARM_WAIT_S)
        except TimeoutError:
            log.info("prefix_warm_timeout", group=group)

    def warmed(self, plan: Plan | None, step_id: str) -> None:
        """``step_id`` has its first token (or ended): its group's waiters go when it is
        the group's warmer."""
        group = plan.prefix_group.get(step_id) if plan else None
        if group is not None and self._warmer.get(group) == step_id:
            self._warm.setdefault(group, asyncio.Event()).set()
