"""Cost of drawing a run: the timeline page body and the ``flowlift trace`` text.

Synthetic traces shaped like the example (per document: extract -> classify and a
@tool -> summarize, with queueing), at several sizes; each is drawn ``--repeat`` times
and the median is reported with the page's size. Pure rendering, no server: what the
proxy adds to ``GET /ui/workflows/{id}`` on top of ``GET /v1/workflows/{id}``.

    .venv/bin/python bench/ui_render.py [--docs 42 250 1000] [--repeat 5]
    .venv/bin/python bench/ui_render.py --smoke   # 10 documents, once: seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowlift.proxy.ui.pages import timeline_body
from flowlift.tracing.recorder import AttemptTrace, RunTrace
from flowlift.tracing.waterfall import waterfall


def synthetic(docs: int) -> tuple[dict[str, Any], dict[str, list[str]]]:
    tr = RunTrace("wf-bench", "bench", "batch")
    deps: dict[str, list[str]] = {}
    for k in range(docs):
        t0 = (k % 16) * 40.0 + (k // 16) * 900.0
        for j, (name, kind, after) in enumerate((("extract", "llm", []),
                                                 ("classify", "llm", ["extract"]),
                                                 ("related", "tool", ["extract"]),
                                                 ("summarize", "llm", ["classify",
                                                                       "related"]))):
            sid = f"{name}_{k}"
            deps[sid] = [f"{a}_{k}" for a in after]
            st = tr.add_step(sid, kind, name=name, model=None if kind == "tool" else "m")
            start = t0 + j * 300.0
            st.ready_ms, st.finished_ms, st.status = start, start + 280.0, "done"
            if kind == "llm":
                st.started_ms, st.first_token_ms = start + 50, start + 90
                st.generated_ms = start + 279
                st.attempts = [AttemptTrace(1, "m", start + 50, start + 90, start + 280, "ok")]
    tr.status, tr.finished_ms = "succeeded", max(s.finished_ms or 0 for s in tr.steps.values())
    doc = {"run_id": "wf-bench", "status": "succeeded", "failures": {},
           "outputs": {sid: f"output of {sid} " * 8 for sid in tr.steps},
           "trace": tr.records(),
           "report": {"critical_path": ["extract_0", "classify_0", "summarize_0"],
                      "nodes": [{"step_id": s, "deps": d} for s, d in deps.items()]}}
    return doc, deps


def median_ms(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, nargs="+", default=[42, 250, 1000])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="10 documents, drawn once")
    args = ap.parse_args()
    if args.smoke:
        args.docs, args.repeat = [10], 1
    rows = []
    for docs in args.docs:
        doc, deps = synthetic(docs)
        page_ms = median_ms(lambda d=doc: timeline_body(d), args.repeat)
        text_ms = median_ms(lambda d=doc, g=deps: waterfall(d["trace"], g), args.repeat)
        size = len(timeline_body(doc).encode())
        rows.append({"steps": 4 * docs, "page_ms": round(page_ms, 1),
                     "page_kib": round(size / 1024, 1), "trace_text_ms": round(text_ms, 1)})
        print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
