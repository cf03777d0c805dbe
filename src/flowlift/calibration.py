"""How fast a machine ran a finished run, against the planned schedule's model (pure, no
I/O).

The planned schedule (:mod:`flowlift.simulate`) needs each engine's step time: a fixed
part, a part per request decoding and a part per prompt token. A request's own TTFT and
TPOT do not give them where requests share an engine's batches and engines share a
machine's cores: they hold the other requests' prefill chunks and the other engines'
turns, which the schedule then adds again (on the example pipeline, plans from them
were 0.4x, 3.2x and, with a cascade's share on its own engine, 4-6x the measured critical
path: bench/RESULTS.md, "Honest plans (issue 38 item 8)").

So the machine is calibrated as a whole. Once a run has finished, what it really did
(each step's calls with the tokens the engine reported and the cascade's models that
really ran; each tool's measured wait) is played again on the same schedule model with
the figures its plan used. If the run took ``k`` times what that replay takes, the
figures were ``k`` times too fast for this machine: ``k`` times the factor the plan used
is a sample of the machine's factor (:meth:`flowlift.costs.CostTracker.calibrate`).
Output lengths, escalations and cache hits the plan guessed wrong are not taken for
speed: the replay has the real ones (a trace-driven replay of the run, on the model the
plans are made with).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from flowlift.costs import CostModel
from flowlift.simulate import EngineModel, Work, simulate
from flowlift.timing import call_work


@dataclass(frozen=True, slots=True)
class Ran:
    """What one step did in a finished run.

    Attributes:
        step_id: the step.
        deps: the steps it waited for (an identical call: the one it reused too).
        calls: its model calls in order (retries, a cascade's later models, an agent's
            turns): ``(model, uncached prompt tokens, output tokens)``.
        fixed_ms: its time off any engine (a client-run tool's wait), ms.
    """

    step_id: str
    deps: frozenset[str]
    calls: tuple[tuple[str, float, float], ...] = ()
    fixed_ms: float = 0.0


def replayed_ms(ran: Sequence[Ran], costs: Callable[[str], CostModel],
                engine: Callable[[str], str], engines: Mapping[str, EngineModel],
                priority: Mapping[str, float] | None = None) -> float:
    """When the schedule of ``ran`` (in dependency order) ends on ``engines`` under
    ``costs`` (``model -> CostModel``; ``engine``: ``model -> engine name``), ms.

    Raises:
        KeyError: a step waits for one not in ``ran``.
    """
    work: dict[str, Work] = {}
    for r in ran:
        chain: Work | None = None
        for model, uncached, out in reversed(r.calls):
            one = call_work(costs(model), engine(model), uncached, out, 1.0, 0.0)
            chain = dataclasses.replace(one, then=chain)
        work[r.step_id] = chain if chain is not None else Work(fixed_ms=r.fixed_ms)
    order = [r.step_id for r in ran]
    schedule = simulate(order, {r.step_id: r.deps for r in ran}, work, engines, priority)
    return max(schedule.finish_ms.values(), default=0.0)


def machine_factor(measured_ms: float, replay_ms: float, used: float = 1.0) -> float | None:
    """The machine's factor a run says: ``used`` (the factor its plan's figures had)
    times how much longer it took than its replay; None when either is not positive."""
    if measured_ms <= 0 or replay_ms <= 0:
        return None
    return used * measured_ms / replay_ms


__all__ = ["Ran", "machine_factor", "replayed_ms"]
