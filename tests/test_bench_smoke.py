"""Benchmarks' ``--smoke`` modes run end to end on the fake engine (plumbing only: no
figure is checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_agent_loop_smoke_exits_0():
    done = subprocess.run([sys.executable, "bench/agent_loop.py", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for variant in ("a_agent_step", "b_open_run", "c_chat_completions", "d_stateless"):
        assert variant in done.stdout
