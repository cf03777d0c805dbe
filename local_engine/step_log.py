"""The engine's own per-step timings: what each iteration held and how long it took.

vLLM's engine core times every iteration of its busy loop when
``ObservabilityConfig.enable_logging_iteration_details`` is on (``EngineCore.
capture_iteration_details``: the scheduled requests in prefill and in decode, their
tokens, and the model's execution time in ms) and hands the figures to the stat loggers
of ``AsyncLLM`` (``SchedulerStats.iteration_details``). :func:`vllm_stat_logger` is such a
logger: it appends one :class:`EngineStep` per iteration to a :class:`StepLog`, a bounded
ring the proxy reads (the dynamic batch cap of
:mod:`flowlift.proxy.dispatch.slots.batch_cap` fits its model of step time to it).

Pure bookkeeping apart from the logger class, which imports vLLM lazily.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineStep:
    """One engine iteration.

    Attributes:
        at: when it was recorded (``time.monotonic()`` seconds, the proxy's clock).
        prefill_requests: requests with prompt tokens in the step (prefill chunks).
        prefill_tokens: prompt tokens computed in the step.
        decode_requests: requests decoding one token (or a few, speculating) in it.
        elapsed_ms: the model's execution time of the step, ms (the engine's timer).
    """

    at: float
    prefill_requests: int
    prefill_tokens: int
    decode_requests: int
    elapsed_ms: float

    @property
    def decode_only(self) -> bool:
        """A step with no prefill: its time is the decode batch's alone."""
        return self.prefill_tokens == 0 and self.decode_requests > 0


class StepLog:
    """The last ``maxlen`` engine steps, oldest first.

    Args:
        maxlen: steps kept (at least 1).
        clock: the ``at`` of a recorded step (seconds); tests inject one.

    Attributes:
        recorded: steps recorded since the start (kept or not).
        listeners: called with each step as it is recorded (a benchmark's recorder).
    """

    def __init__(self, maxlen: int = 512,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be at least 1")
        self._steps: deque[EngineStep] = deque(maxlen=maxlen)
        self._clock = clock
        self.recorded = 0
        self.listeners: list[Callable[[EngineStep], None]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[EngineStep]:
        return iter(tuple(self._steps))

    def record(self, prefill_requests: int, prefill_tokens: int, decode_requests: int,
               elapsed_ms: float) -> EngineStep:
        """Keep one step, stamped now."""
        step = EngineStep(self._clock(), prefill_requests, prefill_tokens,
                          decode_requests, elapsed_ms)
        self._steps.append(step)
        self.recorded += 1
        for listener in self.listeners:
            listener(step)
        return step


def vllm_stat_logger(log: StepLog) -> Callable[..., Any]:
    """A stat-logger factory for ``AsyncLLM(stat_loggers=[...])`` that records each
    iteration's ``SchedulerStats.iteration_details`` into ``log`` (dummy iterations and
    stats without details are skipped). Imports vLLM.

    Returns:
        A ``StatLoggerBase`` subclass (vLLM builds it with ``(vllm_config, engine_index)``).
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            details = getattr(scheduler_stats, "iteration_details", None)
            if details is None or details.is_dummy:
                return
            log.record(details.num_ctx_requests, details.num_ctx_tokens,
                       details.num_generation_requests, details.elapsed_ms)

        def log_engine_initialized(self) -> None:
            return None

    return StepLogger
