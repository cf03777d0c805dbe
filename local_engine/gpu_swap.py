"""Swapping embedded models on a GPU: sleep or unload, and waiting for memory to come
back after an unload.

* :func:`swap_mode` (pure): a model leaving the GPU *sleeps* (vLLM's
  ``AsyncLLM.sleep(level=1)``: the weights are copied to pinned host memory and the KV
  cache dropped; ``wake_up()`` copies them back, seconds instead of a reload) when the
  engine has sleep mode on and the host has room for its weights plus a reserve; else it
  is *unloaded* (the engine shut down, its process gone).
* :func:`wait_for_memory`: an engine core that has just exited hands its GPU memory back
  to the driver a moment later, while a new engine refuses to start when less than its
  share is free (vLLM: "Free memory on device ... is less than desired GPU memory
  utilization", raised in the engine core, which the proxy sees only as "Engine core
  initialization failed"). A load therefore polls the free memory (bounded) before it
  starts, and :func:`short_of_memory` tells a failed start that may be retried.
* :func:`host_available_mb` and :func:`nvml_memory` are the I/O edges (``/proc/meminfo``;
  NVML, which creates no CUDA context in the proxy's process).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

HOST_RESERVE_MB = 4096.0  # host memory kept free beyond a sleeping model's weights
MEMORY_WAIT_S = 30.0
MEMORY_POLL_S = 0.5
START_RETRIES = 2

GpuMemory = Callable[[], tuple[int, int]]
"""Returns ``(free_bytes, total_bytes)`` of the engine's GPU."""


def swap_mode(can_sleep: bool, weights_mb: float, host_available_mb: float,
              reserve_mb: float = HOST_RESERVE_MB) -> Literal["sleep", "unload"]:
    """How a model leaves the GPU.

    Args:
        can_sleep: the engine runs with sleep mode (vLLM's ``enable_sleep_mode``).
        weights_mb: its weights, copied to host memory while it sleeps (0: unknown).
        host_available_mb: the host's available memory now (``MemAvailable``).
        reserve_mb: host memory that must stay free besides.
    """
    if can_sleep and weights_mb > 0 and weights_mb + reserve_mb <= host_available_mb:
        return "sleep"
    return "unload"


def host_available_mb(meminfo: Path = Path("/proc/meminfo")) -> float:
    """The host's available memory in MB (Linux ``MemAvailable``); 0 when unknown, so
    nothing sleeps on a host whose memory cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def nvml_memory(index: int = 0, nvml: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes of GPU ``index`` from NVML (``pynvml``).

    Raises:
        ImportError / pynvml's NVMLError: no NVML or no driver.
    """
    if nvml is None:
        import pynvml

        nvml = pynvml
    nvml.nvmlInit()
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
        return int(info.free), int(info.total)
    finally:
        nvml.nvmlShutdown()


def short_of_memory(utilization: float, probe: GpuMemory) -> bool:
    """True when less than ``utilization`` of the GPU is free now (False when the probe
    fails: then nothing is known and a failed start is not retried)."""
    try:
        free, total = probe()
    except Exception:
        return False
    return free < utilization * total


async def wait_for_memory(utilization: float, probe: GpuMemory, *,
                          timeout_s: float = MEMORY_WAIT_S,
                          poll_s: float = MEMORY_POLL_S) -> float:
    """Wait until ``utilization`` of the GPU is free (an unloaded engine's memory comes
    back), polling ``probe`` off the event loop every ``poll_s``, at most ``timeout_s``.

    Returns:
        Seconds waited. After ``timeout_s`` it returns anyway: the engine's start then
        fails with vLLM's own message, naming the memory it wanted.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            free, total = await asyncio.to_thread(probe)
        except Exception:  # no NVML: nothing to wait for
            break
        if free >= utilization * total:
            break
        await asyncio.sleep(poll_s)
    return time.monotonic() - started
