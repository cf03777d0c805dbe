"""The embedded engines ``flowlift serve`` builds: each model's :class:`VLLMConfig` for
the platform it runs on (:func:`flowlift.local_engine.engine_settings.engine_settings`)
and what a residency budget counts for it.

Preparing a model (a conversion, a download) is I/O; the decisions are the pure
functions this module calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from flowlift.local_engine.engine_settings import (
    GPU_DTYPE,
    PlatformInfo,
    checkpoint_dtype,
    detect_platform,
    engine_settings,
)
from flowlift.local_engine.models import default_dtype
from flowlift.local_engine.vllm_engine import DType, VLLMConfig


@dataclass(frozen=True, slots=True)
class PlannedEngine:
    """One embedded engine: its config and the memory (MB) a residency budget counts."""

    config: VLLMConfig
    memory_mb: float


def plan_engines(models: Sequence[str | None], *, max_concurrency: int,
                 dtype: str | None = None, enforce_eager: bool = False,
                 platform: PlatformInfo | None = None,
                 on_prepare: Callable[[str | None], None] | None = None,
                 **common: Any) -> list[PlannedEngine]:
    """Prepare ``models`` and set each one's engine for the platform.

    Args:
        models: names, folders or hub ids (None: the default model).
        max_concurrency: the proxy's ``--max-concurrency``.
        dtype: ``--dtype`` (None: by platform).
        enforce_eager: ``--enforce-eager``.
        platform: where the engines run (default: :func:`detect_platform`).
        on_prepare: called with each model before it is prepared (progress lines).
        common: other :class:`VLLMConfig` fields, the same for every model.

    Raises:
        EngineError: a model cannot be prepared (see :func:`VLLMConfig.for_model`).
    """
    where = platform or detect_platform()
    step = common.get("max_num_batched_tokens")
    out = []
    for model in models:
        if on_prepare is not None:
            on_prepare(model)
        if not where.is_cuda:  # the CPU: today's values
            config = VLLMConfig.for_model(model, dtype=dtype, max_num_seqs=max_concurrency,
                                          **common)
            out.append(PlannedEngine(config, config.estimated_memory_mb()))
            continue
        config = VLLMConfig.for_model(model, dtype=dtype or GPU_DTYPE, **common)
        chosen = engine_settings(where, max_concurrency=max_concurrency,
                                 checkpoint_dtype=checkpoint_dtype(config.model),
                                 dtype=dtype, cpu_dtype=default_dtype(model),
                                 enforce_eager=enforce_eager, max_num_batched_tokens=step)
        config = dataclasses.replace(
            config, dtype=cast(DType, chosen.dtype), enforce_eager=chosen.enforce_eager,
            max_num_seqs=chosen.max_num_seqs, enable_sleep_mode=chosen.enable_sleep_mode,
            multiproc_method=chosen.multiproc_method)
        out.append(PlannedEngine(config, config.estimated_memory_mb()))
    return out
