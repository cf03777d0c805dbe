"""``flowlift trace``: a run's waterfall as terminal text (pure; no I/O).

One line per step: a bar scaled to the run's wall time, one character per column
showing the stage that covered most of that column (``STAGE_CHARS``), ANSI colours when
asked, ``*`` before the steps of the measured critical path (see
:mod:`flowlift.tracing.timeline`), then the stage totals of
:func:`flowlift.tracing.summary.stage_summary`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flowlift.tracing.summary import format_stage_table, stage_summary
from flowlift.tracing.timeline import (
    SEGMENT_STAGES,
    STAGE_LABELS,
    gantt,
    path_stage_ms,
    split_records,
)

STAGE_CHARS = {"queue": ".", "prefill": "p", "decode": "=", "validate": "v",
               "tool_wait": "t", "tool_run": "r", "failed_try": "x", "cancelled": "-",
               "shared": "~"}
_COLOURS = {"queue": "90", "prefill": "34", "decode": "32", "validate": "33",
            "tool_wait": "35", "tool_run": "95", "failed_try": "31", "cancelled": "37",
            "shared": "36"}
_BOLD, _RESET = "\x1b[1m", "\x1b[0m"


def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{text}{_RESET}" if color and text.strip() else text


def raster(segments: Iterable[tuple[str, float, float]], wall_ms: float,
           width: int) -> list[str | None]:
    """The stage shown in each of ``width`` columns (None: nothing happened there).

    A column shows the stage that covers most of it; a segment shorter than a column
    still shows in a column nothing else covers.
    """
    cell = wall_ms / width if wall_ms > 0 else 1.0
    cover: list[dict[str, float]] = [{} for _ in range(width)]
    for stage, start, end in segments:
        first = min(width - 1, max(0, int(start / cell)))
        last = min(width - 1, max(first, int(end / cell - 1e-9)))
        for c in range(first, last + 1):
            lo, hi = max(start, c * cell), min(end, (c + 1) * cell)
            cover[c][stage] = cover[c].get(stage, 0.0) + max(hi - lo, 1e-6)
    return [max(cov, key=cov.__getitem__) if cov else None for cov in cover]


def _s(ms: float) -> str:
    return f"{ms / 1000:.2f} s"


def waterfall(records: Sequence[Mapping[str, Any]], deps: Mapping[str, Iterable[str]],
              planned_path: Sequence[str] = (), *, width: int = 60,
              color: bool = False) -> str:
    """The whole ``flowlift trace`` text for one run.

    Args:
        records: the run's trace records.
        deps: step id -> input ids (the compiler report's ``nodes[].deps``).
        planned_path: the compiler's ``critical_path``, named in the footer.
        width: columns of the bar (the run's wall time).
        color: ANSI colours (only for a terminal).
    """
    head, steps = split_records(records)
    chart = gantt(records, deps, planned_path)
    wall = chart.wall_ms
    name_w = min(28, max([len(r.step_id) for r in chart.rows] + [4]))
    out = [f"run {head.get('run_id', '?')} {head.get('name', '')!r}: "
           f"{head.get('status', '?')}, wall {_s(wall)}, {len(steps)} steps "
           f"(* = measured critical path)",
           f"  {'step':<{name_w}} {'kind':<4} |0 s{' ' * max(0, width - 3 - len(_s(wall)))}"
           f"{_s(wall)}|"]
    for row in chart.rows:
        cells = raster(((b.stage, b.start_ms, b.end_ms) for b in row.bars), wall, width)
        bar = "".join(_paint(STAGE_CHARS[c] * len(list(run)), _COLOURS[c], color)
                      if c else " " * len(list(run)) for c, run in itertools.groupby(cells))
        took = (row.bars[-1].end_ms - row.bars[0].start_ms) if row.bars else 0.0
        mark = "*" if row.critical else " "
        label = f"{row.step_id[:name_w]:<{name_w}}"
        if row.critical and color:
            label = f"{_BOLD}{label}{_RESET}"
        tail = f" {_s(took)}" if row.bars else ""
        if row.status not in ("done", "") or not row.bars:
            tail += f" {row.status or '-'}"
        out.append(f"{mark} {label} {row.kind[:4]:<4} |{bar}|{tail}")
    used = {b.stage for r in chart.rows for b in r.bars}
    out.append("legend: " + "  ".join(
        f"{_paint(STAGE_CHARS[s], _COLOURS[s], color)} {STAGE_LABELS[s]}"
        for s in SEGMENT_STAGES if s in used))
    out += [f"restart: a {_s(g.end_ms - g.start_ms)} gap from {_s(g.start_ms)} to "
            f"{_s(g.end_ms)} (the run's proxy stopped; it resumed from its log)"
            for g in chart.restarts]
    out += _footer(steps, chart.critical_path, planned_path, wall)
    out.append("")
    out.append(format_stage_table(stage_summary(records)))
    return "\n".join(out)


def _footer(steps: Sequence[Mapping[str, Any]], path: Sequence[str],
            planned: Sequence[str], wall_ms: float) -> list[str]:
    if not path:
        return ["critical path (measured): no step finished"]
    split = path_stage_ms(steps, path)
    on = sum(split.values())
    parts = ", ".join(f"{STAGE_LABELS[s]} {_s(ms)}" for s, ms in split.items() if ms >= 0.5)
    lines = [f"critical path (measured): {' -> '.join(path)}",
             f"  {_s(on)} of the {_s(wall_ms)} wall time in its steps: {parts or '-'}"]
    if planned:
        same = "same as measured" if list(planned) == list(path) else " -> ".join(planned)
        lines.append(f"critical path (compiler's plan): {same}")
    return lines
