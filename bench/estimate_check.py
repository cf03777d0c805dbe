"""Planned vs measured critical path of runs, read from a running proxy (issue 15 item 6).

    .venv/bin/python bench/estimate_check.py BASE_URL RUN_ID [RUN_ID ...]
"""
import sys

import httpx

from flowlift.tracing.timeline import (
    measured_critical_path,
    path_stage_ms,
    report_deps,
    split_records,
)

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
