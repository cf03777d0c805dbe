"""Planned vs measured critical path of runs, read from a running proxy (issue 15 item 6;
issue 38 item 8: also each model step's planned time against its measured one, and the
cost models the plan used).

    .venv/bin/python bench/estimate_check.py BASE_URL RUN_ID [RUN_ID ...]
"""
import statistics
import sys

import httpx

from flowlift.tracing.timeline import (
    measured_critical_path,
    path_stage_ms,
    report_deps,
    split_records,
)


def step_ratios(report: dict, steps: list[dict]) -> list[float]:
    """Planned / measured time of each model step that ran (from its slot to its end)."""
    planned = {n["step_id"]: n for n in report["nodes"]}
    out = []
    for s in steps:
        row = planned.get(s["step_id"])
        start, end = s.get("started_ms"), s.get("finished_ms")
        if row is None or s.get("kind") != "llm" or start is None or end is None:
            continue
        if end - start > 0 and row["est_ms"] > 0:
            out.append(row["est_ms"] / (end - start))
    return out


def main() -> None:
    base = sys.argv[1]
    for run_id in sys.argv[2:]:
        doc = httpx.get(f"{base}/v1/workflows/{run_id}", timeout=60).json()
        report = doc["report"]
        _, steps = split_records(doc["trace"])
        path = measured_critical_path(steps, report_deps(report))
        measured = sum(path_stage_ms(steps, path).values())
        planned = report["critical_path_ms"]
        print(f"{run_id}: planned {planned / 1000:.1f} s, measured {measured / 1000:.1f} s, "
              f"planned/measured {planned / measured:.2f}")
        ratios = step_ratios(report, steps)
        if ratios:
            q = statistics.quantiles(ratios, n=10)
            print(f"  model steps, planned/measured time: median {statistics.median(ratios):.2f}"
                  f" (p10 {q[0]:.2f}, p90 {q[-1]:.2f}; {len(ratios)} steps)")
        for name, cm in report["cost_models"].items():
            print(f"  cost model {name} ({cm['source']}, {cm['samples']} samples): overhead "
                  f"{cm['ttft_overhead_ms']:.0f} ms, TPOT {cm['tpot_ms']:.1f} ms "
                  f"+ {cm.get('per_request_ms', 0.0):.2f} ms per further request, prefill "
                  f"{cm['prefill_tps']:.0f} tok/s")


if __name__ == "__main__":
    main()
