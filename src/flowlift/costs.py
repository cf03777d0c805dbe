"""Per-model cost model for planning: TTFT, TPOT and prefill throughput.

The compiler turns a step into an estimated duration with::

    cost_ms = ttft_overhead_ms + uncached_prompt_tokens / prefill_tps * 1000
              + (output_tokens - 1) * tpot_ms

(the first output token comes with the time to first token; TPOT is measured the same
way, as decode time over the tokens after the first). That is a step with the engine to
itself. Requests that run at once share the machine: :mod:`flowlift.simulate` plays the
plan on each engine as continuous batching does, a step of ``n`` decoding requests
taking ``tpot_ms + per_request_ms * (n - 1)`` plus the prompt tokens prefilled in it.

The figures come from measurements of the configured backends: the proxy feeds every
finished step into a :class:`CostTracker` (exponentially weighted means of observed
prefill throughput and TTFT overhead; TPOT as a line in how many requests were decoding
at once, fitted through the median TPOT at each count, as
:func:`flowlift.proxy.dispatch.slots.batch_cap.fit_steps` fits the engine's own step
times). Before a model has been measured, :data:`UNMEASURED` stands in and the report
says so (``source="default"``).

Those per-request figures are for an upstream, which has its machine to itself. For the
engines embedded on the proxy's machine the proxy plans with :data:`UNMEASURED` sized to
each model's parameter count (:func:`sized_default`) times one factor for the machine
(:meth:`CostTracker.calibrate`, :meth:`CostTracker.calibrated`), learned by replaying
finished runs (:mod:`flowlift.calibration`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict


class CostModel(BaseModel):
    """Figures of one model on its backend.

    Attributes:
        ttft_overhead_ms: fixed time to first token besides prefill (queue in engine,
            scheduling, sampling of the first token).
        tpot_ms: time per output token while decoding.
        prefill_tps: prompt tokens prefilled per second (uncached tokens only).
        per_request_ms: what each further request decoding at once adds to a decode
            step (ms): the engine's TPOT with ``n`` requests decoding together is
            ``tpot_ms + per_request_ms * (n - 1)``.
        source: ``"measured"`` (from ``samples`` finished steps), ``"calibrated"``
            (the default figures times the machine's factor learned from ``samples``
            finished steps: :meth:`CostTracker.calibrate`) or ``"default"``.
        calibration: that factor (1: none applied).
    """

    model_config = ConfigDict(frozen=True)

    ttft_overhead_ms: float
    tpot_ms: float
    prefill_tps: float
    per_request_ms: float = 0.0
    source: str = "default"
    samples: int = 0
    calibration: float = 1.0

    def step_ms(self, uncached_prompt_tokens: float, output_tokens: float) -> float:
        """Estimated ms of one generation (formula in the module docstring)."""
        return (self.ttft_overhead_ms + uncached_prompt_tokens / self.prefill_tps * 1000.0
                + max(output_tokens - 1.0, 0.0) * self.tpot_ms)


    def tpot_at(self, decoding: float) -> float:
        """TPOT (ms) while ``decoding`` requests (this one included) decode together."""
        return self.tpot_ms + self.per_request_ms * max(decoding - 1.0, 0.0)

    def scaled(self, factor: float, samples: int = 0) -> CostModel:
        """These figures on a machine ``factor`` times as slow (every time times
        ``factor``, the prefill rate over it), marked ``source="calibrated"``."""
        return self.model_copy(update={
            "ttft_overhead_ms": self.ttft_overhead_ms * factor,
            "tpot_ms": self.tpot_ms * factor, "per_request_ms": self.per_request_ms * factor,
            "prefill_tps": self.prefill_tps / factor, "calibration": self.calibration * factor,
            "source": "calibrated", "samples": samples})


UNMEASURED = CostModel(ttft_overhead_ms=60.0, tpot_ms=45.0, prefill_tps=900.0,
                       per_request_ms=4.0)
"""Figures of a small model (0.1-0.5 B parameters) on a 2-core CPU, used until the
model is measured: measured on the embedded engine (bench/RESULTS.md, "Honest plans
(issue 38 item 8)"). A GPU is faster: its first measured steps replace them."""
REFERENCE_PARAMETERS = 0.63e9
"""The size :data:`UNMEASURED` stands for: the largest of the small models it was
measured on: Qwen2.5-Coder-0.5B-Instruct, 0.63 B as
:func:`flowlift.local_engine.gpu_memory.model_parameters` counts its converted checkpoint
(embeddings untied)."""


def sized_default(parameters: float | None, default: CostModel = UNMEASURED) -> CostModel:
    """``default``'s figures for a model of ``parameters`` (None: unknown: ``default``).

    Decoding a token and prefilling one both read or multiply every weight once, so on
    the same machine their time grows with the parameter count (Kaplan et al. 2020: a
    forward pass is about ``2 x parameters`` FLOPs per token; decoding at small batch is
    bound by reading the weights): a larger model's TPOT, per-request cost and prefill
    time per token are ``default``'s times ``parameters / REFERENCE_PARAMETERS``. Smaller
    models are not made faster: on a CPU their steps are mostly fixed cost
    (SmolLM2-135M decoded at 35-50 ms a token alone, as the 0.5B's 45 ms default says).
    The time to first token besides prefill (scheduling, sampling) does not scale.
    """
    if not parameters or parameters <= REFERENCE_PARAMETERS:
        return default
    k = parameters / REFERENCE_PARAMETERS
    return default.model_copy(update={"tpot_ms": default.tpot_ms * k,
                                      "per_request_ms": default.per_request_ms * k,
                                      "prefill_tps": default.prefill_tps / k})
TPOT_KEEP = 64  # TPOT samples kept per count of requests decoding at once
CALIBRATION_KEEP = 64  # finished steps a machine's factor is the median of
LOCAL = "local"
"""The calibration key of the engines embedded on this machine (they share its cores)."""


@dataclass(slots=True)
class _Ewma:
    value: float | None = None
    n: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.value is None else (1 - alpha) * self.value + alpha * x
        self.n += 1


@dataclass(slots=True)
class _ModelStats:
    prefill_tps: _Ewma
    tpot_ms: _Ewma
    overhead_ms: _Ewma
    by_decoding: dict[int, deque[float]] = field(default_factory=dict)
    decoding: _Ewma = field(default_factory=_Ewma)


def tpot_line(points: dict[int, deque[float]], min_samples: int = 2
              ) -> tuple[float, float] | None:
    """``(tpot at 1, ms per further request)``: least squares through the median TPOT at
    each count of requests decoding at once (weighted by its samples; the slope never
    negative); None with fewer than two counts of ``min_samples`` samples, or when the
    line would put one request's TPOT under a quarter of the fastest median seen (points
    that follow no line: the caller falls back to the mean)."""
    pts = [(n, statistics.median(v), len(v)) for n, v in points.items()
           if len(v) >= min_samples]
    if len(pts) < 2:
        return None
    w = sum(k for _, _, k in pts)
    mx = sum(x * k for x, _, k in pts) / w
    my = sum(y * k for _, y, k in pts) / w
    sxx = sum(k * (x - mx) ** 2 for x, _, k in pts)
    slope = max(sum(k * (x - mx) * (y - my) for x, y, k in pts) / sxx, 0.0) if sxx else 0.0
    solo = my - slope * (mx - 1.0)
    if solo < 0.25 * min(y for _, y, _ in pts):  # no line through these: noise
        return None
    return solo, slope


class CostTracker:
    """Learns a :class:`CostModel` per model from finished steps.

    Args:
        alpha: weight of the newest observation in the moving averages.
        default: the model used before any measurement.
    """

    def __init__(self, alpha: float = 0.2, default: CostModel = UNMEASURED) -> None:
        self.alpha = alpha
        self.default = default
        self._stats: dict[str, _ModelStats] = {}
        self._factors: dict[str, deque[float]] = {}

    def observe(self, model: str, *, prompt_tokens: int, cached_tokens: int,
                completion_tokens: int, prefill_ms: float, decode_ms: float,
                decoding: float = 1.0) -> None:
        """Record one finished step (``prefill_ms`` = TTFT, ``decode_ms`` = the rest;
        ``decoding``: requests on its engine while it decoded, itself included, on
        average)."""
        st = self._stats.setdefault(model, _ModelStats(_Ewma(), _Ewma(), _Ewma()))
        uncached = max(prompt_tokens - cached_tokens, 0)
        # a prefill among others took longer: brought back to one request as TPOT is
        crowded = 1.0 + self.default.per_request_ms / self.default.tpot_ms * max(
            decoding - 1.0, 0.0)
        if uncached >= 32 and prefill_ms > 0:
            st.prefill_tps.add(uncached / (prefill_ms / 1000.0) * crowded, self.alpha)
        if completion_tokens > 1 and decode_ms > 0:
            tpot = decode_ms / (completion_tokens - 1)
            st.tpot_ms.add(tpot, self.alpha)
            st.decoding.add(max(decoding, 1.0), self.alpha)
            count = max(round(decoding), 1)
            st.by_decoding.setdefault(count, deque(maxlen=TPOT_KEEP)).append(tpot)
        if uncached < 32:
            st.overhead_ms.add(prefill_ms / crowded, self.alpha)

    def _tpot(self, st: _ModelStats) -> tuple[float, float]:
        """``(tpot_ms, per_request_ms)``: the fitted line; with one count of requests
        seen, the mean TPOT brought back to one request with the default's slope per
        ms of TPOT."""
        d = self.default
        line = tpot_line(st.by_decoding)
        if line is not None:
            return line
        if st.tpot_ms.value is None:
            return d.tpot_ms, d.per_request_ms
        ratio = d.per_request_ms / d.tpot_ms
        solo = st.tpot_ms.value / (1.0 + ratio * max((st.decoding.value or 1.0) - 1.0, 0.0))
        return solo, ratio * solo

    def model(self, name: str) -> CostModel:
        """The current cost model of ``name`` (measured figures where there are some)."""
        st = self._stats.get(name)
        if st is None:
            return self.default
        d = self.default
        samples = max(st.prefill_tps.n, st.tpot_ms.n, st.overhead_ms.n)
        tpot, per_request = self._tpot(st)
        return CostModel(
            ttft_overhead_ms=st.overhead_ms.value if st.overhead_ms.value is not None
            else d.ttft_overhead_ms,
            tpot_ms=tpot, per_request_ms=per_request,
            prefill_tps=st.prefill_tps.value if st.prefill_tps.value is not None
            else d.prefill_tps,
            source="measured", samples=samples)

    def calibrate(self, key: str, factor: float) -> None:
        """A finished step on ``key``'s engines (:data:`LOCAL`: this machine's) took
        ``factor`` times what its figures would take with the factor at 1: its plan's
        time for it (from the planned schedule, where steps share the engines) against
        the time it took, times the factor that plan used.

        Why not per-request figures there: a request's TTFT and TPOT on an engine that
        shares its batches and the machine's cores include the other requests' prefill
        chunks and the other engines' turns, which the planned schedule
        (:mod:`flowlift.simulate`) adds again: on the example pipeline the plans made
        from them were 0.4x and 3.2x the measured critical path, and 4-6x once the
        cascade's share was planned on its own engine (bench/RESULTS.md, "Honest plans
        (issue 38 item 8)"). One factor over the whole machine keeps the planned
        schedule's shape and learns its speed."""
        if factor > 0 and math.isfinite(factor):
            self._factors.setdefault(key, deque(maxlen=CALIBRATION_KEEP)).append(factor)

    def calibrated(self, key: str, figures: CostModel) -> CostModel:
        """``figures`` on ``key``'s engines: times the median factor of the last
        :data:`CALIBRATION_KEEP` steps :meth:`calibrate` saw there (unchanged before
        any)."""
        seen = self._factors.get(key)
        if not seen:
            return figures
        return figures.scaled(statistics.median(seen), samples=len(seen))

    def snapshot(self) -> dict[str, CostModel]:
        return {name: self.model(name) for name in self._stats}


__all__ = ["LOCAL", "REFERENCE_PARAMETERS", "UNMEASURED", "CostModel", "CostTracker",
           "sized_default", "tpot_line"]
