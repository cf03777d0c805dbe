"""Benchmarks' ``--smoke`` modes run end to end on the fake engine (plumbing only: no
figure is checked), so a benchmark that stops running fails the suite. bench/*.sh need
the real engine and have no smoke."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SMOKED = ["agent_session.py", "append_cost.py", "batch_pipeline.py", "cascade.py",
          "chain_rtt.py", "residency.py", "make_batch_graph.py", "mixed_load.py",
          "prefill_ahead.py", "proxy_overhead.py", "proxy_tools.py", "routing.py",
          "speculative.py", "tiers.py", "tracing_overhead.py", "ui_render.py",
          "browser_compiler.py", "label_probe.py", "agent_load_model.py", "adaptive.py",
          "fleet_router.py", "delta_turns.py", "peers/run.py", "proxy_replicas.py",
          "peers/pipeline.py", "agents_format.py"]


def _results() -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_mtime_ns) for p in (ROOT / "bench" / "results").glob("*"))


SLOW = {"peers/run.py": 240}
"""Smokes that start many servers (peers: five fake ``flowlift serve`` processes, ~80 s
on a loaded 2-core machine): their timeout (s), 120 for the rest."""


def _smoke(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, f"bench/{script}", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=SLOW.get(script, 120))


def test_agent_loop_smoke_exits_0():
    done = _smoke("agent_loop.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for variant in ("a_agent_step", "b_open_run", "c_chat_completions", "d_stateless",
                    "e_responses"):
        assert variant in done.stdout
    # the Responses variant ran its turns (no error) and reported the bytes it sent
    line = next(ln for ln in done.stdout.splitlines() if "e_responses" in ln and "e2e" in ln
                and "turns" in ln and "rep" in ln)
    assert "error" not in line, line
    assert "bytes sent per turn" in done.stdout


def test_agent_load_smoke_exits_0():
    before = _results()
    done = _smoke("agent_load.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for variant in ("las", "no_las", "chat_fcfs"):
        assert f"| {variant} |" in done.stdout
    assert "errors 0" in done.stdout and "errors 1" not in done.stdout
    assert _results() == before


@pytest.mark.parametrize("script", SMOKED)
def test_bench_smoke_exits_0(script):
    before = _results()
    done = _smoke(script)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert _results() == before  # a smoke run writes nothing into bench/results
