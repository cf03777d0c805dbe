"""How much batch work may run beside interactive work: a plan from the engine's own
step timings (pure code; ``flowlift serve --batch-cap-when-interactive auto``).

Measured on the embedded engine (bench/RESULTS.md, "P4 again"): a decode step's time
grows little with the batch (SmolLM2-135M on 2 CPU cores: ~40 ms at 1 request, ~63 ms
at 16), while prompt tokens in a step cost ~1 ms each, more in large steps (a
450-token batch prompt: a ~0.45 s step; 1,300 tokens: 1.2-3 s). Interactive latency
under batch load is lost to those batch prefills, and then to the decode batch's size.
So, while interactive work runs:

* **decode cap**: the batch requests that may keep decoding beside it are as many as
  keep the predicted step time within ``slowdown`` times the step time of the
  interactive requests alone (:func:`plan_beside_interactive`); the rest are preempted
  (``--scheduling preempt``) or at least not admitted;
* **prefill allowance**: batch prompt tokens may be prefilled beside it only within the
  step time left under that bound (on the CPU above: none; on an engine whose prefill is
  cheap next to a decode step, some). Batch requests still in prefill beyond it are
  preempted too: their computed full KV blocks stay in the prefix cache.

The model (:func:`fit_steps`) is the engine's step time as a line in the number of
decoding requests, fitted through the median step time at each batch size (robust to
the odd slow step of a shared machine), plus a per-prompt-token cost: the median of
what a step with prefill took beyond the line, per prompt token. It is refitted from
:class:`~flowlift.local_engine.step_log.StepLog` as steps come (:class:`DynamicCap`), so
it follows the machine: on a busier CPU the fixed cost per step grows, the per-request
cost weighs less, and more batch requests fit under the same bound. The approach is
SLO-aware batch sizing from a measured latency model (as in Sarathi-Serve, Agrawal et
al., OSDI 2024, which bounds each iteration's tokens so decodes keep a TPOT target
beside chunked prefills; here the bound is applied by the proxy, per class).

The linger (:class:`LingerModel`): interactive work counts as active a while after its
last step ends so that a chain's next step finds the room; the wait is learned from how
long a program's next interactive call actually took to come (a server-side chain: ms;
an app's loop: its round trip), instead of a fixed second.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flowlift.local_engine.step_log import EngineStep, StepLog

UNBOUNDED_TOKENS = 1 << 30
"""A prefill allowance that bounds nothing (prefill priced at nothing)."""


@dataclass(frozen=True, slots=True)
class StepModel:
    """An engine step's time: ``base_ms + per_decode_ms * decoding + per_prefill_token_ms
    * prompt_tokens`` (``per_prefill_token_ms`` None: no step with prefill seen yet).

    Attributes:
        samples: decode-only steps the line was fitted to.
    """

    base_ms: float
    per_decode_ms: float
    per_prefill_token_ms: float | None = None
    samples: int = 0

    def step_ms(self, decoding: int, prefill_tokens: int = 0) -> float:
        """Predicted time (ms) of a step with ``decoding`` requests decoding and
        ``prefill_tokens`` prompt tokens (unknown prefill cost: infinite when any)."""
        prefill = 0.0
        if prefill_tokens > 0:
            if self.per_prefill_token_ms is None:
                return math.inf
            prefill = self.per_prefill_token_ms * prefill_tokens
        return self.base_ms + self.per_decode_ms * decoding + prefill


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """What batch work may do beside interactive work.

    Attributes:
        decode_cap: batch requests that may run (decode) beside it.
        prefill_tokens: batch prompt tokens that may be in prefill beside it.
    """

    decode_cap: int
    prefill_tokens: int


def fit_steps(steps: Iterable[EngineStep], min_per_size: int = 3,
              min_prefill_tokens: int = 16) -> StepModel | None:
    """The step-time model of ``steps`` (see the module).

    Args:
        steps: engine steps, any order.
        min_per_size: decode-only steps a batch size needs to count.
        min_prefill_tokens: steps with fewer prompt tokens do not price prefill (their
            time is mostly the step's fixed cost).

    Returns:
        The model, or None with fewer than two batch sizes of enough decode-only steps.
        The line's slope and intercept are never negative (a noisy fit that says
        otherwise is clamped: a flat line through the mean, or through the origin).
    """
    by_size: dict[int, list[float]] = defaultdict(list)
    prefill_steps: list[EngineStep] = []
    for s in steps:
        if s.decode_only:
            by_size[s.decode_requests].append(s.elapsed_ms)
        elif s.prefill_tokens >= min_prefill_tokens:
            prefill_steps.append(s)
    points = [(b, statistics.median(ts), len(ts)) for b, ts in by_size.items()
              if len(ts) >= min_per_size]
    if len(points) < 2:
        return None
    base, slope = _weighted_line(points)
    costs = [(s.elapsed_ms - base - slope * s.decode_requests) / s.prefill_tokens
             for s in prefill_steps]
    per_token = max(statistics.median(costs), 0.0) if costs else None
    return StepModel(base, slope, per_token, sum(n for _, _, n in points))


def _weighted_line(points: Sequence[tuple[int, float, int]]) -> tuple[float, float]:
    """Least squares of y = a + b x over (x, y, weight) points, a >= 0 and b >= 0."""
    w = sum(n for _, _, n in points)
    mx = sum(x * n for x, _, n in points) / w
    my = sum(y * n for _, y, n in points) / w
    sxx = sum(n * (x - mx) ** 2 for x, _, n in points)
    sxy = sum(n * (x - mx) * (y - my) for x, y, n in points)
    slope = max(sxy / sxx, 0.0) if sxx > 0 else 0.0
    base = my - slope * mx
    if base < 0:  # through the origin instead
        slope = (sum(n * x * y for x, y, n in points)
                 / sum(n * x * x for x, _, n in points))
        base = 0.0
    return base, slope


def plan_beside_interactive(model: StepModel, interactive: int, batch_slots: int,
                            slowdown: float) -> BatchPlan:
    """The batch work that keeps interactive steps within ``slowdown`` times their time
    without it.

    Args:
        model: the engine's step-time model.
        interactive: interactive requests running (at least 1 is assumed: the plan is
            for the next one too).
        batch_slots: the most batch requests the engine may hold.
        slowdown: the bound, >= 1 (1.3: interactive steps at most 30 % slower).

    Returns:
        ``decode_cap``: the largest k <= ``batch_slots`` with ``step_ms(interactive + k)
        <= slowdown * step_ms(interactive)`` (every batch slot when decoding costs
        nothing extra); ``prefill_tokens``: the prompt tokens that fit in the step time
        left with ``decode_cap`` batch requests decoding (0 when prefill is unpriced).

    Raises:
        ValueError: ``slowdown`` below 1 or ``batch_slots`` negative.
    """
    if slowdown < 1 or batch_slots < 0:
        raise ValueError("slowdown must be >= 1 and batch_slots >= 0")
    i = max(interactive, 1)
    bound = slowdown * model.step_ms(i)
    room = (math.inf if model.per_decode_ms <= 0
            else (bound - model.step_ms(i)) / model.per_decode_ms)
    cap = batch_slots if room >= batch_slots else max(0, math.floor(room + 1e-9))
    left = bound - model.step_ms(i + cap)
    per_token = model.per_prefill_token_ms
    if per_token is None or left <= 0:
        return BatchPlan(cap, 0)
    fits = math.inf if per_token <= 0 else left / per_token
    return BatchPlan(cap, UNBOUNDED_TOKENS if fits >= UNBOUNDED_TOKENS else math.floor(fits))


class DynamicCap:
    """The plan of an engine, refitted from its step log as steps come.

    Args:
        log: the engine's steps.
        slowdown: see :func:`plan_beside_interactive`.
        fallback: the plan while no model can be fitted yet.
        refit_every: new steps between fits.
    """

    def __init__(self, log: StepLog, slowdown: float, fallback: BatchPlan,
                 refit_every: int = 16) -> None:
        if slowdown < 1:
            raise ValueError("slowdown must be >= 1")
        self.log, self.slowdown, self.fallback = log, slowdown, fallback
        self.refit_every = max(refit_every, 1)
        self.model: StepModel | None = None
        self._fitted_at = -refit_every

    def plan(self, interactive: int, batch_slots: int) -> BatchPlan:
        """The plan now (refitting first when enough new steps came)."""
        if self.log.recorded - self._fitted_at >= self.refit_every:
            self._fitted_at = self.log.recorded
            self.model = fit_steps(self.log) or self.model
        if self.model is None:
            return BatchPlan(min(self.fallback.decode_cap, batch_slots),
                             self.fallback.prefill_tokens)
        return plan_beside_interactive(self.model, interactive, batch_slots,
                                       self.slowdown)

    def snapshot(self, batch_slots: int) -> dict[str, Any]:
        """What ``/readyz`` shows: the fitted model (None: none yet) and the plan beside
        one interactive request."""
        plan = self.plan(1, batch_slots)
        m = self.model
        return {"slowdown": self.slowdown, "steps_recorded": self.log.recorded,
                "model": None if m is None else {
                    "base_ms": round(m.base_ms, 2), "per_decode_ms": round(m.per_decode_ms, 3),
                    "per_prefill_token_ms": (None if m.per_prefill_token_ms is None
                                             else round(m.per_prefill_token_ms, 3)),
                    "samples": m.samples},
                "plan_beside_one": {"decode_cap": plan.decode_cap,
                                    "prefill_tokens": plan.prefill_tokens}}


class LingerModel:
    """How long interactive work stays active after its last release: the ``quantile``
    of how long programs took to send their next interactive call, over the last
    ``window`` releases that had one within ``max_s`` (a program's release followed by
    nothing for ``max_s`` is a miss). 0 when fewer than ``min_hit_share`` of the
    releases had a next call; ``max_s`` until ``min_samples`` releases were seen.

    Args:
        max_s: the longest linger (and the window in which a next call counts).
        clock: seconds, monotonic.
    """

    def __init__(self, max_s: float, clock: Callable[[], float], window: int = 64,
                 quantile: float = 0.9, min_samples: int = 8,
                 min_hit_share: float = 0.1, margin_s: float = 0.02) -> None:
        if max_s < 0 or not 0 < quantile <= 1:
            raise ValueError("max_s must be >= 0 and quantile in (0, 1]")
        self.max_s, self._clock, self.quantile = max_s, clock, quantile
        self.min_samples, self.min_hit_share, self.margin_s = (min_samples, min_hit_share,
                                                               margin_s)
        self._open: dict[Hashable, float] = {}
        self._seen: deque[float | None] = deque(maxlen=window)  # a gap, or None: a miss

    def released(self, program: Hashable | None) -> None:
        """An interactive request of ``program`` gave its slot back."""
        if program is not None:
            self._expire()
            self._open[program] = self._clock()

    def acquired(self, program: Hashable | None) -> None:
        """An interactive request of ``program`` started waiting for a slot."""
        if program is None:
            return
        self._expire()
        at = self._open.pop(program, None)
        if at is not None:
            self._seen.append(self._clock() - at)

    def linger_s(self) -> float:
        """The linger now (seconds)."""
        self._expire()
        return linger_from(list(self._seen), self.max_s, self.quantile, self.min_samples,
                           self.min_hit_share, self.margin_s)

    def _expire(self) -> None:
        bound = self._clock() - self.max_s
        for program in [p for p, t in self._open.items() if t < bound]:
            del self._open[program]
            self._seen.append(None)


def linger_from(seen: Sequence[float | None], max_s: float, quantile: float = 0.9,
                min_samples: int = 8, min_hit_share: float = 0.1,
                margin_s: float = 0.02) -> float:
    """The linger (seconds) from the gaps ``seen`` (None: a release with no next call
    within ``max_s``); see :class:`LingerModel`. Always within [0, ``max_s``]."""
    if len(seen) < min_samples:
        return max_s
    gaps = sorted(g for g in seen if g is not None)
    if len(gaps) < min_hit_share * len(seen) or not gaps:
        return 0.0
    k = min(len(gaps) - 1, max(0, math.ceil(quantile * len(gaps)) - 1))
    return min(max_s, gaps[k] + margin_s)
