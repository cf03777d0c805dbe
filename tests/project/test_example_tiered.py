"""The one-command detached demo (examples/stdlib_docs/tiered.py, issue 17): the example
pipeline submitted detached under a deadline of hours to a proxy whose backends are a fake
OpenAI provider's standard and Batch API tiers, then attached, its @tool steps run by the
attach; no model, no real provider."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from examples.stdlib_docs import tiered


def test_the_detached_demo_runs_the_pipeline_on_the_batch_tier_once_per_line(
        tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "tiers"
    assert tiered.main(["--limit", "3", "--out", str(out), "--timeout-s", "240"]) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    handle = json.loads((out / "run.json").read_text())
    assert summary["status"] == "succeeded" and summary["failures"] == {}
    stages = ("facts", "label", "related", "summary")
    steps = {d[stage]: stage for d in handle["documents"] for stage in stages}
    assert set(summary["outputs"]) == set(steps)  # every step of the 3 documents
    related = [summary["outputs"][s] for s, stage in steps.items() if stage == "related"]
    assert all(len(r["modules"]) == 3 for r in related)  # run by the attach, here
    served = {s: d["served"] for s, d in summary["spend"]["by_step"].items()}
    assert {steps[s] for s in served} == {"facts", "label", "summary"}  # tools unpriced
    assert all(served[s] == "batch" for s in served if steps[s] in ("facts", "label"))
    # every line the provider got was answered once: no line submitted twice
    sent = summary["submissions"]
    assert sent["twice"] == [] and sent["statuses"] == ["completed"]
    assert sent["lines"] == sum(t == "batch" for t in served.values())
    assert summary["spend"]["cost"] < 0.55 * summary["spend"]["standard_cost"]
    # what the user reads: the listing while it ran and after, the tiers, the cost
    assert text.count("PROGRESS") == 2 and "6.0 h left" in text and "12/12" in text
    assert "tier per step (served):" in text and "with every step on standard (0.50x)" in text
    assert "submitted twice: 0" in text
