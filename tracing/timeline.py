"""A run's timeline: stage segments per step, the measured critical path, Gantt geometry.

Pure functions over trace records (``RunTrace.records()``, the ``trace`` of
``GET /v1/workflows/{run_id}``, or the JSON-lines file); the proxy's page
(:mod:`flowlift.proxy.ui.pages`) and ``flowlift trace`` (:mod:`flowlift.tracing.waterfall`)
draw what these compute.

Segments of one step, in ms since the run started (see :mod:`flowlift.tracing.recorder`):

* ``tool``: ``tool_wait`` from wanted to result.
* ``llm`` with attempts: ``queue`` until the first try starts; every try that did not
  succeed is one ``failed_try`` segment (a contract failure or an engine error, retried
  or final), or ``cancelled`` for a try stopped on purpose (a ``first``/``quorum``
  group resolved without it, the run cancelled or out of time); a gap before the next
  try is ``queue`` again; the last successful try is
  ``prefill`` (start to first token), ``decode`` (to the last token) and ``validate``
  (to the output stored).
* ``llm`` without attempts (an identical call served by another step's output, or a
  step failed while queued): ``queue``/``shared`` from ready to finished.
* an agent step (``llm`` with ``tool_calls``): each model turn is its own ``prefill`` and
  ``decode`` (noted ``turn N``; a turn that called tools is no failed try), and each tool
  call a ``tool_wait`` segment from wanted to result (noted with the tool's name, turn
  and outcome), or ``tool_run`` for a tool the proxy ran itself (:mod:`flowlift.proxy.tools`:
  not the app's time); the wait for the calls is not counted as ``queue``.

The *measured critical path* is the chain of waits that set the run's wall time: start
from the step that finished last and go back, each time to the input (a graph
dependency, or the identical step it reused) that finished last; that input is what
the step was waiting for. A step that ended skipped (a group's member cancelled when the
group resolved without it, a condition not taken) delivered nothing, so nothing waited
for it: it is never on the path. It differs from the compiler's ``critical_path`` (an
estimate, before the run) when queues, retries or tool calls took longer than planned.

A run resumed after its proxy stopped (a restart, a takeover) has a gap in which nothing
of it ran; the run record's ``restarts`` names each (``Gantt.restarts``), so the chart
labels it instead of leaving an unexplained hole.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SEGMENT_STAGES = ("queue", "prefill", "decode", "validate", "tool_wait", "tool_run",
                  "failed_try", "cancelled", "shared")
"""Every stage a segment can have, in legend order."""

STAGE_LABELS = {"queue": "queue wait", "prefill": "prefill (TTFT)", "decode": "decode",
                "validate": "validate", "tool_wait": "tool wait (client)",
                "tool_run": "tool run (proxy)",
                "failed_try": "failed try (retried or final)",
                "cancelled": "cancelled (its group resolved, or the run ended)",
                "shared": "identical call (reused)"}


@dataclass(frozen=True, slots=True)
class Segment:
    """One stage of one step: ``start_ms``/``end_ms`` since the run started."""

    stage: str
    start_ms: float
    end_ms: float
    attempt: int | None = None
    note: str = ""

    @property
    def ms(self) -> float:
        return max(0.0, self.end_ms - self.start_ms)


def _f(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _seg(stage: str, start: float | None, end: float | None, **kw: Any) -> list[Segment]:
    if start is None or end is None or end < start:
        return []
    return [Segment(stage, start, end, **kw)]


def _tool_segments(rec: Mapping[str, Any], turn: Any, now_ms: float
                   ) -> tuple[list[Segment], float | None]:
    """The ``tool_wait`` segments of the calls one agent turn asked for, and when the
    last of them ended."""
    out: list[Segment] = []
    for c in rec.get("tool_calls") or []:
        wanted = _f(c.get("wanted_ms"))
        if c.get("turn") != turn or wanted is None:
            continue
        done = _f(c.get("finished_ms"))
        stage = "tool_wait" if c.get("server") is None else "tool_run"
        out += _seg(stage, wanted, now_ms if done is None else done,
                    note=f"{c.get('name', '')} (turn {turn}): {c.get('outcome', '')}"
                         + (f": {c['error']}" if c.get("error") else ""))
    return out, max((s.end_ms for s in out), default=None)


def _llm_segments(rec: Mapping[str, Any], now_ms: float) -> list[Segment]:
    ready, finished = _f(rec.get("ready_ms")), _f(rec.get("finished_ms"))
    end = finished if finished is not None else now_ms
    attempts = [a for a in rec.get("attempts") or [] if _f(a.get("started_ms")) is not None]
    if not attempts:
        stage = "shared" if rec.get("same_as") else "queue"
        return _seg(stage, ready, end)
    out: list[Segment] = []
    t = ready
    for k, a in enumerate(attempts):
        start = float(a["started_ms"])
        a_end = _f(a.get("finished_ms"))
        a_end = end if a_end is None else a_end
        out += _seg("queue", t, start)
        n = int(a.get("attempt") or 0) or None
        turn = a.get("turn")
        note = "" if turn is None else f"turn {turn}"
        if a.get("outcome") in ("ok", "running", "tool_calls"):
            first = _f(a.get("first_token_ms"))
            gen = _f(rec.get("generated_ms")) if k == len(attempts) - 1 else None
            gen = gen if gen is not None and gen >= start else None
            last = gen if gen is not None else a_end
            out += _seg("prefill", start, first if first is not None else last, attempt=n,
                        note=note)
            out += _seg("decode", first, last, attempt=n, note=note)
            if gen is not None:
                out += _seg("validate", gen, a_end, attempt=n)
        else:
            stage = "cancelled" if a.get("outcome") == "cancelled" else "failed_try"
            out += _seg(stage, start, a_end, attempt=n,
                        note=f"{a.get('model', '')}: {a.get('outcome')}: "
                             f"{a.get('error') or ''}".strip(": "))
        calls, calls_end = _tool_segments(rec, turn, now_ms) if turn is not None else ([], None)
        out += calls
        t = a_end if calls_end is None else max(a_end, calls_end)
    return out


def segments(rec: Mapping[str, Any], now_ms: float | None = None) -> list[Segment]:
    """The stage segments of one step record (see the module docstring).

    Args:
        rec: a ``step`` trace record.
        now_ms: where a step that has not finished ends on the chart (default: its
            last known instant).
    """
    if now_ms is None:
        now_ms = max(_instants(rec), default=0.0)
    if rec.get("kind") == "tool":
        ready, finished = _f(rec.get("ready_ms")), _f(rec.get("finished_ms"))
        return _seg("tool_wait", ready, finished if finished is not None else now_ms)
    if rec.get("kind") == "llm":
        return _llm_segments(rec, now_ms)
    return []


def _instants(rec: Mapping[str, Any]) -> list[float]:
    keys = ("ready_ms", "started_ms", "first_token_ms", "generated_ms", "finished_ms")
    vals = [_f(rec.get(k)) for k in keys]
    for a in rec.get("attempts") or []:
        vals += [_f(a.get(k)) for k in ("started_ms", "first_token_ms", "finished_ms")]
    for c in rec.get("tool_calls") or []:
        vals += [_f(c.get("wanted_ms")), _f(c.get("finished_ms"))]
    return [v for v in vals if v is not None]


def split_records(records: Iterable[Mapping[str, Any]]
                  ) -> tuple[dict[str, Any], list[Mapping[str, Any]]]:
    """``(run record or {}, step records)`` of a trace."""
    head: dict[str, Any] = {}
    steps = []
    for rec in records:
        if rec.get("type") == "run":
            head = dict(rec)
        elif rec.get("type") == "step":
            steps.append(rec)
    return head, steps


def measured_critical_path(steps: Sequence[Mapping[str, Any]],
                           deps: Mapping[str, Iterable[str]]) -> list[str]:
    """The chain of steps that set the wall time, first to last (module docstring).

    Args:
        steps: ``step`` trace records.
        deps: step id -> the ids of its inputs (the compiler report's ``nodes[].deps``
            or :func:`flowlift.dataflow.dependencies`).

    Returns:
        Step ids; empty when no step finished. Input (constant) nodes, steps skipped
        because an input failed (never ready) and skipped steps (a group's cancelled
        losers: nothing waited for them) are left out.
    """
    by_id = {s["step_id"]: s for s in steps}
    finished = {sid: f for sid, s in by_id.items()
                if (f := _f(s.get("finished_ms"))) is not None and s.get("kind") != "input"
                and _f(s.get("ready_ms")) is not None and s.get("status") != "skipped"}
    if not finished:
        return []
    order = {sid: k for k, sid in enumerate(by_id)}
    cur = max(finished, key=lambda s: (finished[s], -order[s]))
    path = [cur]
    seen = {cur}
    while True:
        preds = set(deps.get(cur, ()))
        if by_id[cur].get("same_as"):
            preds.add(by_id[cur]["same_as"])
        preds = {p for p in preds if p in finished and p not in seen}
        if not preds:
            break
        cur = max(preds, key=lambda s: (finished[s], -order[s]))
        path.append(cur)
        seen.add(cur)
    return path[::-1]


def path_stage_ms(steps: Sequence[Mapping[str, Any]], path: Iterable[str]) -> dict[str, float]:
    """Time per stage summed along ``path`` (what the critical path spent its time on)."""
    by_id = {s["step_id"]: s for s in steps}
    out = dict.fromkeys(SEGMENT_STAGES, 0.0)
    for sid in path:
        for seg in segments(by_id[sid]):
            out[seg.stage] += seg.ms
    return out


def nice_ticks(span_ms: float, max_ticks: int = 8) -> list[float]:
    """Axis ticks at 1/2/5 x 10^k ms from 0 to ``span_ms`` (at most ``max_ticks + 1``)."""
    if span_ms <= 0:
        return [0.0]
    raw = span_ms / max_ticks
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(mag * m for m in (1, 2, 5, 10) if mag * m >= raw)
    n = int(span_ms / step + 1e-9)
    return [round(k * step, 6) for k in range(n + 1)]


@dataclass(frozen=True, slots=True)
class Bar:
    """One drawn segment: pixel box plus what it shows."""

    stage: str
    x: float
    width: float
    start_ms: float
    end_ms: float
    attempt: int | None
    note: str


@dataclass(frozen=True, slots=True)
class Row:
    step_id: str
    kind: str
    name: str
    model: str | None
    status: str
    y: float
    bars: tuple[Bar, ...]
    critical: bool
    planned_critical: bool
    record: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Gantt:
    """The chart: rows top to bottom, ``x = label_px + ms * px_per_ms``."""

    wall_ms: float
    label_px: float
    chart_px: float
    row_px: float
    top_px: float
    height_px: float
    px_per_ms: float
    ticks: tuple[tuple[float, float], ...]  # (ms, x)
    rows: tuple[Row, ...]
    critical_path: tuple[str, ...]
    planned_path: tuple[str, ...]
    restarts: tuple[Bar, ...] = ()
    """The gaps the run's proxy restarts left (the run record's ``restarts``): stage
    ``restart``, from the last instant recorded before to the resume."""

    @property
    def width_px(self) -> float:
        return self.label_px + self.chart_px + 10


def gantt(records: Iterable[Mapping[str, Any]], deps: Mapping[str, Iterable[str]],
          planned_path: Sequence[str] = (), *, label_px: float = 190, chart_px: float = 640,
          row_px: float = 22, top_px: float = 28, min_bar_px: float = 1.0) -> Gantt:
    """Lay a trace out as a Gantt chart (rows ordered by when each step became ready).

    Args:
        records: the run's trace records.
        deps: step id -> input ids (for the measured critical path).
        planned_path: the compiler report's ``critical_path`` (marked separately).
        label_px / chart_px / row_px / top_px: geometry, in pixels.
        min_bar_px: the narrowest a segment is drawn, so instant stages stay visible.
    """
    head, steps = split_records(records)
    now = max((v for s in steps for v in _instants(s)), default=0.0)
    wall = _f(head.get("wall_ms")) or now
    wall = max(wall, now, 1e-9)
    scale = chart_px / wall
    path = measured_critical_path(steps, deps)
    on_path, planned = set(path), set(planned_path)
    order = {s["step_id"]: k for k, s in enumerate(steps)}
    ranked = sorted(steps, key=lambda s: (_f(s.get("ready_ms")) is None,
                                          _f(s.get("ready_ms")) or 0.0, order[s["step_id"]]))
    rows = []
    for k, s in enumerate(ranked):
        bars = tuple(Bar(g.stage, label_px + g.start_ms * scale,
                         max(min_bar_px, g.ms * scale), g.start_ms, g.end_ms, g.attempt, g.note)
                     for g in segments(s, now))
        rows.append(Row(s["step_id"], str(s.get("kind", "")), str(s.get("name") or ""),
                        s.get("model"), str(s.get("status", "")), top_px + k * row_px, bars,
                        s["step_id"] in on_path, s["step_id"] in planned, s))
    ticks = tuple((ms, label_px + ms * scale) for ms in nice_ticks(wall))
    gaps = tuple(Bar("restart", label_px + a * scale, max(min_bar_px, (b - a) * scale), a, b,
                     None, "proxy restart: nothing of the run ran")
                 for g in head.get("restarts") or []
                 if (a := _f(g.get("from_ms"))) is not None
                 and (b := _f(g.get("to_ms"))) is not None and b >= a)
    height = top_px + len(rows) * row_px + 8 + (14 if gaps else 0)  # (room for the label)
    return Gantt(wall, label_px, chart_px, row_px, top_px, height,
                 scale, ticks, tuple(rows), tuple(path), tuple(planned_path), gaps)


def report_deps(report: Mapping[str, Any] | None) -> dict[str, list[str]]:
    """step id -> deps from a compiler report's ``nodes`` (empty without a report)."""
    return {n["step_id"]: list(n.get("deps") or []) for n in (report or {}).get("nodes", [])}
