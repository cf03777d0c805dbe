"""The ``flowlift init`` starter on the real default model (SmolLM2-135M-Instruct on the
embedded vLLM engine; issue 38, item 1): it runs to the end without a traceback, its
bounded ``key_terms`` fit ``max_tokens``, and it prints a row per text."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flowlift.cli.init import write_starter

pytestmark = pytest.mark.engine


def test_the_starter_runs_on_the_default_model(real_proxy, tmp_path):
    write_starter(tmp_path)
    env = {**os.environ, "FLOWLIFT_PROGRESS": "0"}
    out = subprocess.run([sys.executable, "-m", "flowlift.cli", "run", "--base-url",
                          real_proxy["base_url"], "workflow.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    assert out.returncode == 0, (out.stdout, out.stderr[-4000:])
    rows = out.stdout.splitlines()[:2]
    assert all(r.split()[0] in ("question", "statement") for r in rows), out.stdout
    assert all("FAILED" not in r for r in rows), out.stdout
    trace = [json.loads(line) for line in
             (tmp_path / "runs" / "starter.jsonl").read_text().splitlines()]
    extracts = [r for r in trace if r.get("type") == "step" and r["name"] == "extract"]
    assert len(extracts) == 2
    assert all(a["finish_reason"] != "length" for r in extracts for a in r["attempts"])
