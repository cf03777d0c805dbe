"""The embedded engines ``flowlift serve`` builds: each model's :class:`VLLMConfig` for
the platform it runs on (:func:`flowlift.local_engine.engine_settings.engine_settings`)
and what a residency budget counts for it. On a GPU each engine also gets its share of
the GPU (``gpu_memory_utilization``) from :mod:`flowlift.local_engine.gpu_memory`:
estimated from the model's ``config.json``, split so the engines fit together.

Preparing a model (a conversion, a download) is I/O; the decisions are the pure
functions this module calls.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from flowlift.local_engine import gpu_memory
from flowlift.local_engine.engine_settings import (
    GPU_DTYPE,
    PlatformInfo,
    checkpoint_dtype,
    detect_platform,
    engine_settings,
    gpu_batch_defaults,
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
                 budget_mb: float | None = None,
                 tool_formats: Mapping[str, tuple[str | None, str | None]] | None = None,
                 **common: Any) -> list[PlannedEngine]:
    """Prepare ``models`` and set each one's engine for the platform.

    Args:
        models: names, folders or hub ids (None: the default model).
        max_concurrency: the proxy's ``--max-concurrency``.
        dtype: ``--dtype`` (None: by platform).
        enforce_eager: ``--enforce-eager``.
        platform: where the engines run (default: :func:`detect_platform`).
        on_prepare: called with each model before it is prepared (progress lines).
        budget_mb: ``--memory-budget-mb`` (on a GPU: bytes of GPU memory the loaded
            engines share; see :func:`flowlift.local_engine.gpu_memory.split`).
        tool_formats: model -> ``(tool_format, tool_parser)`` a config file set for it
            (None in either: the model's default; docs/agents.md).
        common: other :class:`VLLMConfig` fields, the same for every model.

    Raises:
        EngineError: a model cannot be prepared (see :func:`VLLMConfig.for_model`).
        ConfigError: on a GPU, the models do not fit (:func:`gpu_memory.split`) or a
            model's ``config.json`` lacks a size.
    """
    where = platform or detect_platform()
    step = common.get("max_num_batched_tokens")
    out = []
    for model in models:
        if on_prepare is not None:
            on_prepare(model)
        fmt, parser = (tool_formats or {}).get(model or "", (None, None))
        tools = {"tool_format": fmt, "tool_parser": parser}
        if not where.is_cuda:  # the CPU: today's values
            config = VLLMConfig.for_model(model, dtype=dtype, max_num_seqs=max_concurrency,
                                          **tools, **common)
            out.append(PlannedEngine(config, config.estimated_memory_mb()))
            continue
        config = VLLMConfig.for_model(model, dtype=dtype or GPU_DTYPE, **tools, **common)
        chosen = engine_settings(where, max_concurrency=max_concurrency,
                                 checkpoint_dtype=checkpoint_dtype(config.model),
                                 dtype=dtype, cpu_dtype=default_dtype(model),
                                 enforce_eager=enforce_eager, max_num_batched_tokens=step)
        config = dataclasses.replace(
            config, dtype=cast(DType, chosen.dtype), enforce_eager=chosen.enforce_eager,
            max_num_seqs=chosen.max_num_seqs, enable_sleep_mode=chosen.enable_sleep_mode,
            multiproc_method=chosen.multiproc_method)
        out.append(PlannedEngine(config, config.estimated_memory_mb()))
    return share_gpu(out, where, max_concurrency, budget_mb) if where.is_cuda else out


def share_gpu(plans: Sequence[PlannedEngine], platform: PlatformInfo, concurrency: int,
              budget_mb: float | None) -> list[PlannedEngine]:
    """``plans`` with each engine's ``gpu_memory_utilization`` and planned KV tokens
    set, and what a residency budget counts for it: its estimate with a budget, else
    its whole share.

    Raises:
        ConfigError: see :func:`gpu_memory.split`.
    """
    estimates = {}
    for plan in plans:
        c = plan.config
        shape = gpu_memory.ModelShape.from_config(
            json.loads((Path(c.model) / "config.json").read_text()))
        step = c.max_num_batched_tokens or gpu_batch_defaults(platform)[0]
        estimates[c.served_model_name] = gpu_memory.estimate(
            shape, c.dtype, max_model_len=c.max_model_len, concurrency=concurrency,
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=step,
            cuda_graphs=not c.enforce_eager)
    budget = None if budget_mb is None else int(budget_mb * gpu_memory.MiB)
    shares = gpu_memory.split(platform.total_memory_bytes,
                              {m: e.total for m, e in estimates.items()},
                              budget_bytes=budget)
    out = []
    for plan in plans:
        name = plan.config.served_model_name
        share, need = shares[name], estimates[name]
        counted = need.total if budget is not None else share * platform.total_memory_bytes
        out.append(PlannedEngine(
            dataclasses.replace(plan.config, gpu_memory_utilization=share,
                                planned_kv_tokens=need.kv_tokens,
                                weights_mb=need.weights / gpu_memory.MiB),
            counted / gpu_memory.MiB))
    return out
