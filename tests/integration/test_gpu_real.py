"""On a real NVIDIA GPU (marked ``gpu``; skipped where ``nvidia-smi -L`` lists none, as
on the development machines: none of this has run yet, see docs/gpu.md): the GPU smoke
with vLLM's CUDA build, or the torch-only stand-in where vLLM is not installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def test_gpu_smoke_passes_on_the_gpu():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: test_gpu_standin_passes_on_the_gpu checks instead")
    proc = subprocess.run(["bash", "scripts/gpu_smoke.sh"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_gpu_standin_passes_on_the_gpu():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "scripts/gpu_standin.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
