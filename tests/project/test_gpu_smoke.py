"""The GPU smoke (scripts/gpu_smoke.sh) and its torch-only stand-in
(scripts/gpu_standin.py) in their ``--cpu-dry`` modes: the same checks on the fake
engine / a simulated device, so the scripts stay runnable. Their real runs need a GPU:
tests/integration/test_gpu_real.py (marked ``gpu``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

from flowlift.local_engine import lifetime

ROOT = Path(__file__).resolve().parents[2]


def _lines(out: str) -> dict[str, str]:
    return {m.group(2): m.group(1)
            for m in re.finditer(r"^\[(PASS|FAIL|INFO)\] ([^:]+):", out, re.MULTILINE)}


def test_gpu_smoke_cpu_dry_prints_every_check_and_passes():
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--cpu-dry"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    checks = _lines(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for name in ("driver", "versions", "platform", "engine", "two models at once",
                 "swaps M2 -> M -> M2", "kill -9", "64 streams at --max-concurrency 16",
                 "64 streams at --max-concurrency 64"):
        assert name in checks, (name, proc.stdout)
    assert "FAIL" not in checks.values()
    assert "nothing ran on a GPU" in proc.stdout


def test_gpu_standin_cpu_dry_prints_every_check_and_passes():
    proc = subprocess.run([sys.executable, "scripts/gpu_standin.py", "--cpu-dry"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    checks = _lines(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert {"spawn from a threaded parent", "two engines' fractions fit", "unload/reload",
            "no orphan after kill -9"} <= {k for k, v in checks.items() if v == "PASS"}


def test_a_package_main_is_replaced_for_spawned_children(monkeypatch):
    # `python -m flowlift serve`: spawned children skip a `*.__main__` main module, so
    # marked_proxy names lifetime as the main module (its children then adopt)
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="flowlift.__main__")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", main)
    with lifetime.marked_proxy():
        assert main.__spec__ is not None
        assert main.__spec__.name == "flowlift.local_engine.lifetime"
    assert main.__spec__.name == "flowlift.__main__"
