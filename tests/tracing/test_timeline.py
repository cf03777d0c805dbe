"""The pure timeline: stage segments, the measured critical path, Gantt geometry, and
the terminal waterfall drawn from them."""

from __future__ import annotations

import pytest

from flowlift.proxy.ui.svg import gantt_svg
from flowlift.tracing.recorder import AttemptTrace, RunTrace
from flowlift.tracing.timeline import (
    gantt,
    measured_critical_path,
    nice_ticks,
    path_stage_ms,
    report_deps,
    segments,
    split_records,
)
from flowlift.tracing.waterfall import raster, waterfall


def _llm(tr: RunTrace, sid: str, ready: float, start: float, first: float, gen: float,
         end: float, attempts: list[AttemptTrace] | None = None) -> None:
    st = tr.add_step(sid, "llm", model="m")
    st.ready_ms, st.started_ms, st.first_token_ms = ready, start, first
    st.generated_ms, st.finished_ms, st.status = gen, end, "done"
    st.attempts = attempts or [AttemptTrace(1, "m", start, first, end, "ok")]


def _trace() -> tuple[list[dict], dict[str, list[str]]]:
    """a -> b (retried once) -> t (tool) ; d independent and short; e reuses d."""
    tr = RunTrace("wf-x", "demo")
    _llm(tr, "a", 0, 10, 100, 300, 310)
    _llm(tr, "b", 310, 320, 400, 500, 505,
         [AttemptTrace(1, "m", 320, 340, 380, "contract_failed", error="not JSON"),
          AttemptTrace(2, "m2", 390, 400, 505, "ok")])
    t = tr.add_step("t", "tool", name="lookup")
    t.ready_ms, t.finished_ms, t.status = 505, 900, "done"
    _llm(tr, "d", 0, 50, 60, 200, 201)
    e = tr.add_step("e", "llm", model="m")
    e.ready_ms, e.finished_ms, e.status, e.same_as = 0, 201, "done", "d"
    tr.add_step("skipped", "llm", model="m").status = "failed"
    tr.status, tr.finished_ms = "succeeded", 905
    return tr.records(), {"b": ["a"], "t": ["b"], "e": []}


def _by_id(records):
    return {r["step_id"]: r for r in split_records(records)[1]}


def test_segments_split_each_try_and_stage():
    records, _ = _trace()
    steps = _by_id(records)
    assert [(s.stage, s.start_ms, s.end_ms) for s in segments(steps["a"])] == [
        ("queue", 0, 10), ("prefill", 10, 100), ("decode", 100, 300), ("validate", 300, 310)]
    b = segments(steps["b"])
    assert [s.stage for s in b] == ["queue", "failed_try", "queue", "prefill", "decode",
                                    "validate"]
    failed = b[1]
    assert (failed.start_ms, failed.end_ms, failed.attempt) == (320, 380, 1)
    assert "contract_failed" in failed.note and "not JSON" in failed.note
    assert b[3].attempt == 2 and (b[3].start_ms, b[3].end_ms) == (390, 400)
    assert [(s.stage, s.ms) for s in segments(steps["t"])] == [("tool_wait", 395)]
    assert [s.stage for s in segments(steps["e"])] == ["shared"]
    assert segments(steps["skipped"]) == []


def test_segments_of_a_running_step_end_at_now():
    tr = RunTrace("wf-r", "r")
    st = tr.add_step("a", "llm")
    st.ready_ms, st.started_ms = 0.0, 5.0
    st.attempts = [AttemptTrace(1, "m", 5.0)]
    rec = split_records(tr.records())[1][0]
    assert [(s.stage, s.end_ms) for s in segments(rec, now_ms=40.0)] == [
        ("queue", 5.0), ("prefill", 40.0)]


def test_measured_critical_path_follows_the_input_that_finished_last():
    records, deps = _trace()
    steps = split_records(records)[1]
    assert measured_critical_path(steps, deps) == ["a", "b", "t"]
    # the same steps, but the tool answered at once: then d -> e ended last
    fast = [dict(r, finished_ms=506) if r.get("step_id") == "t" else r for r in steps]
    fast = [dict(r, finished_ms=700) if r.get("step_id") == "e" else r for r in fast]
    assert measured_critical_path(fast, deps) == ["d", "e"]  # e reused d's output
    both = {**deps, "t": ["b", "d"]}
    assert measured_critical_path(steps, both) == ["a", "b", "t"]
    assert measured_critical_path([], {}) == []


def test_path_stage_ms_sums_the_stages_along_the_path():
    records, _ = _trace()
    steps = split_records(records)[1]
    split = path_stage_ms(steps, ["a", "b", "t"])
    assert split["tool_wait"] == 395 and split["failed_try"] == 60
    assert split["queue"] == 10 + 10 + 10 and split["prefill"] == 90 + 10


def test_gantt_geometry_scales_to_wall_time_and_marks_only_the_path():
    records, deps = _trace()
    chart = gantt(records, deps, planned_path=["d", "e"], label_px=100, chart_px=905,
                  row_px=20, top_px=30)
    assert chart.wall_ms == 905 and chart.px_per_ms == pytest.approx(1.0)
    rows = {r.step_id: r for r in chart.rows}
    assert [r.step_id for r in chart.rows][:3] == ["a", "d", "e"]  # by ready time
    assert chart.rows[-1].step_id == "skipped" and chart.rows[-1].bars == ()
    assert {r.step_id for r in chart.rows if r.critical} == {"a", "b", "t"}
    assert {r.step_id for r in chart.rows if r.planned_critical} == {"d", "e"}
    tool = rows["t"].bars[0]
    assert (tool.x, tool.width) == pytest.approx((100 + 505, 395))
    assert rows["a"].y == 30 and chart.rows[1].y == 50
    assert chart.height_px == 30 + 6 * 20 + 8
    assert chart.ticks[0] == (0.0, 100.0) and chart.ticks[-1][0] <= 905


def test_a_restart_gap_is_labelled_on_the_chart_and_in_the_terminal():
    """A run resumed after its proxy stopped: the gap between the last instant recorded
    before and the resume is drawn and named (issue 38 item 9), on the page and in
    `flowlift trace`; a run without one draws none."""
    tr = RunTrace("wf-r", "resumed")
    _llm(tr, "a", 0, 10, 100, 300, 310)
    gap = tr.restarted()  # (the clock is at ~0 ms here: a gap of ~0 from a's 310 ms)
    assert gap["from_ms"] <= gap["to_ms"] and tr.restarts == [gap]
    tr.restarts = [{"from_ms": 310.0, "to_ms": 2310.0}]  # a 2 s outage
    _llm(tr, "b", 2310, 2320, 2400, 2500, 2505)
    tr.status, tr.finished_ms = "succeeded", 2505
    records = tr.records()
    assert records[0]["restarts"] == [{"from_ms": 310.0, "to_ms": 2310.0}]
    chart = gantt(records, {"b": ["a"]}, label_px=100, chart_px=2505)
    assert [(g.start_ms, g.end_ms, g.x, g.width) for g in chart.restarts] == [
        (310.0, 2310.0, 410.0, 2000.0)]
    svg = gantt_svg(chart)
    assert 'data-restart="310-2310"' in svg and "restart: 2.00 s gap" in svg
    assert "restart: a 2.00 s gap from 0.31 s to 2.31 s" in waterfall(records, {"b": ["a"]})
    plain, _ = _trace()
    assert gantt(plain, {}).restarts == () and "data-restart" not in gantt_svg(gantt(plain, {}))


def test_nice_ticks():
    assert nice_ticks(905) == [0, 200, 400, 600, 800]
    assert nice_ticks(10_000, max_ticks=5) == [0, 2000, 4000, 6000, 8000, 10000]
    assert nice_ticks(0.3, max_ticks=3) == [0, 0.1, 0.2, 0.3]
    assert nice_ticks(0) == [0.0]


def test_report_deps():
    assert report_deps({"nodes": [{"step_id": "b", "deps": ["a"]}]}) == {"b": ["a"]}
    assert report_deps(None) == {}


def test_raster_gives_short_segments_a_column():
    cells = raster([("queue", 0, 1), ("decode", 1, 100)], wall_ms=100, width=10)
    assert cells == ["decode"] * 10
    cells = raster([("prefill", 0, 2), ("tool_wait", 50, 60)], wall_ms=100, width=10)
    assert cells[0] == "prefill" and cells[5] == "tool_wait" and cells[9] is None


def test_waterfall_plain_and_coloured():
    records, deps = _trace()
    plain = waterfall(records, deps, ["a", "b", "t"], width=40)
    assert "\x1b[" not in plain
    lines = plain.splitlines()
    rows = {ln[2:].split()[0]: ln for ln in lines[2:8]}
    assert rows["a"].startswith("* ") and rows["t"].startswith("* ")
    assert rows["d"].startswith("  ") and rows["skipped"].rstrip().endswith("failed")
    bar = rows["t"].split("|")[1]
    assert len(bar) == 40 and set(bar.strip()) == {"t"}
    assert rows["b"].split("|")[1].count("x") >= 2  # the failed try
    assert "critical path (measured): a -> b -> t" in plain
    assert "critical path (compiler's plan): same as measured" in plain
    assert lines[-2].startswith("tool_wait") and lines[-1].startswith("wall time 0.91 s")  # stages
    coloured = waterfall(records, deps, ["d"], width=40, color=True)
    assert "\x1b[35m" in coloured and "\x1b[1m" in coloured
    assert "critical path (compiler's plan): d" in coloured
