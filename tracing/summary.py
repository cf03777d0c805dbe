"""Where the time went: per-stage totals over a run's step records."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

STAGES = ("queue", "prefill", "decode", "validate", "retry", "tool_wait", "tool_run")
SHOWN_WHEN_USED = frozenset({"tool_run"})
"""Stages :func:`format_stage_table` lists only when a step had them (proxy tools)."""


def stage_summary(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum each stage over all steps of a run.

    Args:
        records: trace records as produced by ``RunTrace.records()`` (or read back
            from the JSON-lines file).

    Returns:
        ``{"wall_ms", "steps", "failed", "skipped" (not taken: a ``when`` condition),
        "stages": {stage: {"total_ms", "mean_ms", "count"}},
        "tokens": {"prompt", "completion", "cached"}}``. Stage totals add up
        step-time, which exceeds wall time when steps overlap.
    """
    stages = {s: {"total_ms": 0.0, "count": 0} for s in STAGES}
    tokens = {"prompt": 0, "completion": 0, "cached": 0}
    wall_ms, n_steps, failed, skipped = None, 0, 0, 0
    for rec in records:
        if rec.get("type") == "run":
            wall_ms = rec.get("wall_ms")
            continue
        n_steps += 1
        failed += rec.get("status") == "failed"
        skipped += rec.get("status") == "skipped"
        for stage, ms in (rec.get("stages_ms") or {}).items():
            stages[stage]["total_ms"] += ms
            stages[stage]["count"] += 1
        tokens["prompt"] += rec.get("prompt_tokens", 0)
        tokens["completion"] += rec.get("completion_tokens", 0)
        tokens["cached"] += rec.get("cached_tokens", 0)
    for agg in stages.values():
        agg["mean_ms"] = agg["total_ms"] / agg["count"] if agg["count"] else 0.0
    return {"wall_ms": wall_ms, "steps": n_steps, "failed": failed, "skipped": skipped,
            "stages": stages, "tokens": tokens}


def format_stage_table(summary: Mapping[str, Any]) -> str:
    """A plain-text table of :func:`stage_summary`'s result."""
    total = sum(s["total_ms"] for s in summary["stages"].values()) or 1.0
    lines = [f"{'stage':<10} {'steps':>6} {'total s':>9} {'mean ms':>9} {'share':>6}"]
    for stage, agg in summary["stages"].items():
        if stage in SHOWN_WHEN_USED and not agg["count"]:
            continue
        lines.append(f"{stage:<10} {agg['count']:>6} {agg['total_ms'] / 1000:>9.2f} "
                     f"{agg['mean_ms']:>9.1f} {agg['total_ms'] / total:>6.1%}")
    tok = summary["tokens"]
    wall = summary["wall_ms"]
    lines.append(f"wall time {wall / 1000:.2f} s for {summary['steps']} steps "
                 f"({summary['failed']} failed"
                 + (f", {summary['skipped']} skipped" if summary.get("skipped") else "")
                 + f"); tokens: {tok['prompt']} prompt "
                 f"({tok['cached']} from prefix cache), {tok['completion']} generated"
                 if wall is not None else f"{summary['steps']} steps")
    return "\n".join(lines)
