"""Per-model cost model for planning: TTFT, TPOT and prefill throughput.

The compiler turns a step into an estimated duration with::

    cost_ms = ttft_overhead_ms + uncached_prompt_tokens / prefill_tps * 1000
              + (output_tokens - 1) * tpot_ms

(the first output token comes with the time to first token; TPOT is measured the same
way, as decode time over the tokens after the first).

The figures come from measurements of the configured backends: the proxy feeds every
finished step into a :class:`CostTracker` (exponentially weighted means of observed
prefill throughput, time per output token and TTFT overhead). Before a model has been
measured, :data:`UNMEASURED` stands in and the report says so (``source="default"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class CostModel(BaseModel):
    """Figures of one model on its backend.

    Attributes:
        ttft_overhead_ms: fixed time to first token besides prefill (queue in engine,
            scheduling, sampling of the first token).
        tpot_ms: time per output token while decoding.
        prefill_tps: prompt tokens prefilled per second (uncached tokens only).
        source: ``"measured"`` (from ``samples`` finished steps) or ``"default"``.
    """

    model_config = ConfigDict(frozen=True)

    ttft_overhead_ms: float
    tpot_ms: float
    prefill_tps: float
    source: str = "default"
    samples: int = 0

    def step_ms(self, uncached_prompt_tokens: float, output_tokens: float) -> float:
        """Estimated ms of one generation (formula in the module docstring)."""
        return (self.ttft_overhead_ms + uncached_prompt_tokens / self.prefill_tps * 1000.0
                + max(output_tokens - 1.0, 0.0) * self.tpot_ms)


# Order-of-magnitude figures of a small model on a CPU; used only until measured.
UNMEASURED = CostModel(ttft_overhead_ms=50.0, tpot_ms=100.0, prefill_tps=500.0)


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

    def observe(self, model: str, *, prompt_tokens: int, cached_tokens: int,
                completion_tokens: int, prefill_ms: float, decode_ms: float) -> None:
        """Record one finished step (``prefill_ms`` = TTFT, ``decode_ms`` = the rest)."""
        st = self._stats.setdefault(model, _ModelStats(_Ewma(), _Ewma(), _Ewma()))
        uncached = max(prompt_tokens - cached_tokens, 0)
        if uncached >= 32 and prefill_ms > 0:
            st.prefill_tps.add(uncached / (prefill_ms / 1000.0), self.alpha)
        if completion_tokens > 1 and decode_ms > 0:
            st.tpot_ms.add(decode_ms / (completion_tokens - 1), self.alpha)
        if uncached < 32:
            st.overhead_ms.add(prefill_ms, self.alpha)

    def model(self, name: str) -> CostModel:
        """The current cost model of ``name`` (measured figures where there are some)."""
        st = self._stats.get(name)
        if st is None:
            return self.default
        d = self.default
        samples = max(st.prefill_tps.n, st.tpot_ms.n, st.overhead_ms.n)
        return CostModel(
            ttft_overhead_ms=st.overhead_ms.value if st.overhead_ms.value is not None
            else d.ttft_overhead_ms,
            tpot_ms=st.tpot_ms.value if st.tpot_ms.value is not None else d.tpot_ms,
            prefill_tps=st.prefill_tps.value if st.prefill_tps.value is not None
            else d.prefill_tps,
            source="measured", samples=samples)

    def snapshot(self) -> dict[str, CostModel]:
        return {name: self.model(name) for name in self._stats}


__all__ = ["UNMEASURED", "CostModel", "CostTracker"]
