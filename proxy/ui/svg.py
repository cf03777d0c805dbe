"""The Gantt chart of a run as inline SVG (pure; geometry from
:func:`flowlift.tracing.timeline.gantt`).

Every text that comes from a graph or a run (step ids, names, models, outputs, errors)
goes through :func:`html.escape`; nothing user-given becomes markup or an attribute
name. Markers the page's test reads:

* each bar is ``<rect class="bar stage-{stage}" data-stage="{stage}" data-step="{id}">``;
* the bars of steps on the measured critical path also carry ``critical`` in their
  class and ``data-critical="measured"``; no other bar does;
* a row on the compiler's planned critical path carries ``data-planned-critical``;
* a restart's gap is ``<g class="restart" data-restart="{from ms}-{to ms}">``, labelled.
"""

from __future__ import annotations

from html import escape

from flowlift.tracing.timeline import SEGMENT_STAGES, STAGE_LABELS, Bar, Gantt, Row

BAR_PX = 14.0


def _ms(ms: float) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def _bar(row: Row, b: Bar, y: float) -> str:
    crit = ' critical" data-critical="measured' if row.critical else ""
    tip = (f"{row.step_id} \u00b7 {STAGE_LABELS[b.stage]} {_ms(b.end_ms - b.start_ms)} "
           f"({_ms(b.start_ms)} \u2192 {_ms(b.end_ms)})")
    if b.attempt:
        tip += f", try {b.attempt}"
    if b.note:
        tip += f": {b.note}"
    return (f'<rect class="bar stage-{b.stage}{crit}" data-stage="{b.stage}" '
            f'data-step="{escape(row.step_id)}" x="{b.x:.1f}" y="{y:.1f}" '
            f'width="{b.width:.1f}" height="{BAR_PX:.0f}" rx="2">'
            f"<title>{escape(tip)}</title></rect>")


def _row(chart: Gantt, row: Row, k: int) -> str:
    y = row.y + (chart.row_px - BAR_PX) / 2
    parts = [f'<g class="row{" critical" if row.critical else ""}" '
             f'data-step="{escape(row.step_id)}"'
             f'{" data-planned-critical" if row.planned_critical else ""}>']
    if row.critical:
        parts.append(f'<rect class="band" x="0" y="{row.y:.1f}" width="{chart.width_px:.0f}" '
                     f'height="{chart.row_px:.0f}"/>')
    elif k % 2:
        parts.append(f'<rect class="stripe" x="0" y="{row.y:.1f}" '
                     f'width="{chart.width_px:.0f}" height="{chart.row_px:.0f}"/>')
    mark = "\u25cf " if row.critical else ""
    planned = "\u25c7" if row.planned_critical else ""
    sub = row.model or row.kind
    ty = row.y + chart.row_px / 2 + 4
    title = f"{row.step_id} ({row.kind}{', ' + row.model if row.model else ''}): {row.status}"
    parts.append(f'<text class="label" x="6" y="{ty:.1f}"><title>{escape(title)}</title>'
                 f"{escape(mark + _short(row.step_id, 24))}"
                 f'<tspan class="sub"> {escape(_short(sub, 14))}</tspan>'
                 f'<tspan class="planned">{planned}</tspan></text>')
    parts += [_bar(row, b, y) for b in row.bars]
    if not row.bars:
        parts.append(f'<text class="note" x="{chart.label_px + 4:.1f}" y="{ty:.1f}">'
                     f"{escape(row.status or 'no timing')}</text>")
    parts.append("</g>")
    return "".join(parts)


def _links(chart: Gantt) -> str:
    rows = {r.step_id: r for r in chart.rows}
    out = []
    for a, b in zip(chart.critical_path, chart.critical_path[1:], strict=False):
        ra, rb = rows.get(a), rows.get(b)
        if ra is None or rb is None or not ra.bars or not rb.bars:
            continue
        x1 = ra.bars[-1].x + ra.bars[-1].width
        x2 = rb.bars[0].x
        y1, y2 = ra.y + chart.row_px / 2, rb.y + chart.row_px / 2
        out.append(f'<path class="critical-link" d="M{x1:.1f},{y1:.1f} '
                   f'L{max(x1, x2 - 3):.1f},{y1:.1f} L{max(x1, x2 - 3):.1f},{y2:.1f} '
                   f'L{x2:.1f},{y2:.1f}"/>')
    return "".join(out)


def _restart(chart: Gantt, gap: Bar) -> str:
    """A restart's gap: a hatched band over every row, labelled above the axis."""
    text = f"restart: {_ms(gap.end_ms - gap.start_ms)} gap"
    tip = (f"{gap.note} from {_ms(gap.start_ms)} to {_ms(gap.end_ms)} (its proxy stopped; "
           "the run resumed from its log)")
    return (f'<g class="restart" data-restart="{gap.start_ms:.0f}-{gap.end_ms:.0f}">'
            f'<rect class="gap" x="{gap.x:.1f}" y="{chart.top_px - 6:.1f}" '
            f'width="{gap.width:.1f}" height="{chart.height_px - chart.top_px - 10:.1f}">'
            f"<title>{escape(tip)}</title></rect>"
            f'<text class="gap-label" x="{gap.x + gap.width / 2:.1f}" '
            f'y="{chart.height_px - 3:.1f}">{escape(text)}</text></g>')


def gantt_svg(chart: Gantt) -> str:
    """The chart as one ``<svg>`` element."""
    w, h = chart.width_px, chart.height_px
    axis = [f'<line class="axis" x1="{chart.label_px:.1f}" y1="{chart.top_px - 6:.1f}" '
            f'x2="{chart.label_px + chart.chart_px:.1f}" y2="{chart.top_px - 6:.1f}"/>']
    for ms, x in chart.ticks:
        axis.append(f'<line class="tick" x1="{x:.1f}" y1="{chart.top_px - 6:.1f}" '
                    f'x2="{x:.1f}" y2="{h - 8:.1f}"/>'
                    f'<text class="tick-label" x="{x:.1f}" y="{chart.top_px - 11:.1f}">'
                    f"{_ms(ms)}</text>")
    rows = "".join(_row(chart, r, k) for k, r in enumerate(chart.rows))
    rows += "".join(_restart(chart, g) for g in chart.restarts)
    label = f"Gantt chart of {len(chart.rows)} steps over {_ms(chart.wall_ms)}"
    return (f'<svg class="gantt" xmlns="http://www.w3.org/2000/svg" width="{w:.0f}" '
            f'height="{h:.0f}" viewBox="0 0 {w:.0f} {h:.0f}" role="img" '
            f'aria-label="{escape(label)}">{"".join(axis)}{rows}{_links(chart)}</svg>')


def legend_html(used: set[str] | None = None, restarts: bool = False) -> str:
    """The colour legend (every stage, or only ``used`` ones), plus the path markers
    (and the restart gap's, when the run has one)."""
    items = [f'<li><span class="swatch stage-{s}"></span>{escape(STAGE_LABELS[s])}</li>'
             for s in SEGMENT_STAGES if used is None or s in used]
    items.append('<li><span class="swatch critical-swatch"></span>\u25cf critical path '
                 "(measured: the chain of waits that set the wall time)</li>")
    items.append("<li>\u25c7 on the compiler's planned critical path</li>")
    if restarts:
        items.append('<li><span class="swatch gap-swatch"></span>restart: a gap in which '
                     "the run's proxy was down (it resumed from its log)</li>")
    return f'<ul class="legend">{"".join(items)}</ul>'
