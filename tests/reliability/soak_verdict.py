"""The soak's judgement: plateau or slope, from its samples and windows (pure: no I/O).

A *sample* (every few seconds) is the proxy process's ``rss_mib``, ``fds`` (open file
descriptors) and ``open_runs`` (``flowlift_active_workflows``) at ``t`` seconds. A *window*
(``soak_long.py``'s ``--window-s``) adds what the traffic saw in it (runs started and
ended, errors, latency percentiles, the achieved rate) and, from the proxy's
``/soak/tables``, its live Python ``objects``, named ``tables`` and the sizes of every
container reachable from its state (``walk``).

After the warm-up (the tables fill), a least-squares line is fitted to each measure
(:func:`statistics.linear_regression`); its growth over the fitted span must stay within
``share x level + floor`` of :data:`MARGINS` (RSS 5% + 8 MiB, the bound ``test_soak.py``
has always used; fds and open runs 10% + 32, over the connections and runs in flight at
a time that come and go; objects 2% + 1,000). Besides: any error, a window under 90% of
the asked rate, a table past ``bound``, a container that grew past its warm-up size
(10% + 64, or the bound) and runs still open after every client finished fail it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

MARGINS: dict[str, tuple[float, float]] = {
    "rss_mib": (0.05, 8.0), "fds": (0.10, 32.0), "open_runs": (0.10, 32.0),
    "objects": (0.02, 1000.0)}
"""Measure -> (share of its level, floor): the growth a plateau may show over the run."""
SWEEP_S = 5.0
"""The proxy's sweep period (``proxy/app.py``): the run store is pruned at each sweep."""
MIN_RATE_SHARE = 0.9


def fit(points: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """The least-squares line through ``(t seconds, value)`` points: its ``slope_per_min``,
    its ``growth`` over the points' span and the ``level`` it starts at (None: fewer than
    three points, or all at one time)."""
    if len(points) < 3 or len({t for t, _ in points}) < 2:
        return None
    ts, vs = [t for t, _ in points], [v for _, v in points]
    slope, intercept = statistics.linear_regression(ts, vs)
    return {"slope_per_min": slope * 60, "growth": slope * (ts[-1] - ts[0]),
            "level": intercept + slope * ts[0]}


def slopes(samples: Sequence[dict[str, float]], windows: Sequence[dict[str, Any]],
           warmup_s: float) -> dict[str, dict[str, float]]:
    """Each measure's :func:`fit` after ``warmup_s``: RSS, fds and open runs over the
    samples, live objects over the windows' ends."""
    out = {}
    for name in ("rss_mib", "fds", "open_runs"):
        line = fit([(s["t"], s[name]) for s in samples if s["t"] >= warmup_s])
        if line is not None:
            out[name] = line
    line = fit([(w["t1"], w["objects"]) for w in windows
                if w["t1"] >= warmup_s and w.get("objects") is not None])
    if line is not None:
        out["objects"] = line
    return out


def _tables(windows: Sequence[dict[str, Any]], bound: int, rate_per_min: float) -> list[str]:
    problems = []
    limits = {"sessions": bound, "inferred": bound, "runs.finished": bound}
    for w in windows:
        tables = w.get("tables") or {}
        problems += [f"{name} = {tables[name]} > {limit} at {w['t1']:.0f} s"
                     for name, limit in limits.items() if tables.get(name, 0) > limit]
        # between two sweeps the runs finished since are in the store too
        runs = tables.get("store.runs", 0)
        if runs > bound + tables.get("runs.active", 0) + 2 * SWEEP_S * rate_per_min / 60:
            problems.append(f"store.runs = {runs} at {w['t1']:.0f} s")
    return problems


def _walk(after: Sequence[dict[str, Any]], bound: int) -> list[str]:
    if len(after) < 2 or not after[0].get("walk"):
        return []
    first, last = after[0]["walk"], after[-1]["walk"]
    return [f"{path} grew {first.get(path, 0)} -> {n} after the warm-up"
            for path, n in last.items() if n > max(1.1 * first.get(path, 0) + 64, bound)]


def verdict(report: dict[str, Any]) -> list[str]:
    """What went wrong (an empty list: a plateau) in a soak's ``report``: its
    ``samples``, ``windows``, ``warmup_s``, ``bound`` (0: the proxy's defaults, not
    checked), ``rate_per_min`` asked, ``errors`` (first lines) and ``left_open`` (runs
    still active after every client finished)."""
    windows, warmup_s = report["windows"], report["warmup_s"]
    problems = [f"{name}: grew {line['growth']:+.1f} ({line['slope_per_min']:+.2f}/min) "
                f"from {line['level']:.1f} after the warm-up, more than "
                f"{MARGINS[name][0]:.0%} + {MARGINS[name][1]:g}"
                for name, line in report["slopes"].items()
                if line["growth"] > MARGINS[name][0] * line["level"] + MARGINS[name][1]]
    problems += [f"{w['errors']} error(s) in window {w['window']}" for w in windows
                 if w["errors"]]
    problems += report["errors"][:5]
    problems += [f"window {w['window']}: {w['rate_per_min']:.0f} workflows/min, under "
                 f"{MIN_RATE_SHARE:.0%} of {report['rate_per_min']:g}" for w in windows
                 if w["rate_per_min"] < MIN_RATE_SHARE * report["rate_per_min"]]
    if report["bound"]:
        problems += _tables([w for w in windows if w["t1"] > warmup_s], report["bound"],
                            report["rate_per_min"])
    problems += _walk([w for w in windows if w["t1"] >= warmup_s], report["bound"])
    if report["left_open"]:
        problems.append(f"{report['left_open']} run(s) still open after every client "
                        "finished")
    if not any(w["t1"] >= warmup_s for w in windows[1:]):
        problems.append("too short a soak: no window after the warm-up to judge")
    return problems


def table(windows: Sequence[dict[str, Any]]) -> str:
    """The windows as a Markdown table: counts, the proxy's RSS, fds and open runs at the
    window's end (max over its samples in brackets), and latency p50/p99 in ms."""
    head = ("| window | end s | workflows/min | started | succeeded | cancelled | errors | "
            "in flight | RSS MiB (max) | fds (max) | open runs (max) | live objects | "
            "first event p50/p99 ms | whole run p50/p99 ms | chat p50/p99 ms |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for w in windows:
        lat = [f"{w['latency_ms'][n]['p50']:.0f} / {w['latency_ms'][n]['p99']:.0f}"
               if n in w["latency_ms"] else "-" for n in ("wf_first_event", "wf_run", "chat")]
        rows.append(
            f"| {w['window']} | {w['t1']:.0f} | {w['rate_per_min']:.0f} | {w['started']} | "
            f"{w['ended'].get('succeeded', 0)} | {w['ended'].get('cancelled', 0)} | "
            f"{w['errors']} | {w['in_flight']} | {w['rss_mib']:.1f} ({w['rss_mib_max']:.1f}) | "
            f"{w['fds']} ({w['fds_max']}) | {w['open_runs']:.0f} ({w['open_runs_max']:.0f}) | "
            f"{w.get('objects') or '-'} | " + " | ".join(lat) + " |")
    return "\n".join(rows)
