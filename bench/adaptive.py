"""Graphs that decide on the proxy (issue 27): the vote and the debate, three ways each.

The two shapes of ``examples/agents/adaptive.py`` over its eight multiple-choice
questions (every question of a shape in one run), each run three ways on one engine,
with the same prompts, model and sampling:

* **static**: the full graph: all five voters (the majority taken after), every one of
  the six debate edges (no router);
* **proxy**: the decisions in the graph: ``wf.quorum(k=3, agree_on="choice")`` cancels
  the voters left once three agree; the router's edges decide which revisions run
  (``when=``), the others are skipped;
* **app**: the same decisions made by the app in an open run: three voters awaited,
  then one more at a time until three agree; the router's output awaited, then only the
  chosen revisions recorded (one round trip per decision).

Per shape and variant: makespan (the run's wall time in the app), tokens (prompt plus
generated, from the trace; a cancelled voter counts what it generated), accuracy (of
the final answers), and each variant's ratio to static. The variants run alternately
(the order rotates per repetition); figures are medians over ``--reps``.

    .venv/bin/python bench/adaptive.py [--reps 3] [--limit 8]
    .venv/bin/python bench/adaptive.py --smoke   # seconds, fake engine: plumbing only
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import proxy, save
from examples.agents.adaptive import QUESTIONS, Outcome, run_shape

VARIANTS = ("static", "proxy", "app")


def summarize(runs: list[Outcome], n: int) -> dict[str, Any]:
    """Medians of one shape and variant over its repetitions."""
    return {"makespan_s": round(statistics.median(o.makespan_s for o in runs), 3),
            "tokens": int(statistics.median(o.tokens for o in runs)),
            "accuracy": round(statistics.median(o.correct / n for o in runs), 3),
            "skipped": int(statistics.median(o.skipped for o in runs)),
            "failed": int(statistics.median(o.failed for o in runs)),
            "reps": len(runs)}


async def measure(base: str, reps: int, limit: int) -> dict[str, dict[str, Any]]:
    questions = list(QUESTIONS[:limit])
    out: dict[str, dict[str, Any]] = {}
    for shape in ("vote", "debate"):
        runs: dict[str, list[Outcome]] = {v: [] for v in VARIANTS}
        for rep in range(reps):
            order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
            for variant in order:
                runs[variant].append(await run_shape(shape, variant, questions, base))
        out[shape] = {v: summarize(runs[v], len(questions)) for v in VARIANTS}
        base_row = out[shape]["static"]
        for v in VARIANTS:
            row = out[shape][v]
            row["makespan_vs_static"] = round(row["makespan_s"] / base_row["makespan_s"], 3)
            row["tokens_vs_static"] = round(row["tokens"] / max(base_row["tokens"], 1), 3)
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'shape':<7} {'variant':<7} {'makespan s':>10} {'x static':>8} "
             f"{'tokens':>7} {'x static':>8} {'accuracy':>8} {'skipped':>7} {'failed':>6}"]
    for shape, rows in results.items():
        for v, r in rows.items():
            lines.append(f"{shape:<7} {v:<7} {r['makespan_s']:>10.2f} "
                         f"{r['makespan_vs_static']:>8.2f} {r['tokens']:>7} "
                         f"{r['tokens_vs_static']:>8.2f} {r['accuracy']:>8.2f} "
                         f"{r['skipped']:>7} {r['failed']:>6}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--limit", type=int, default=len(QUESTIONS))
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine, two questions, one repetition; nothing saved")
    args = parser.parse_args()
    reps, limit = (1, 2) if args.smoke else (args.reps, args.limit)
    with proxy(name="adaptive", engine="fake" if args.smoke else "vllm") as base:
        results = asyncio.run(measure(base, reps, limit))
    print(table(results))
    save("adaptive", {"questions": limit, "reps": reps, "results": results},
         smoke=args.smoke)


if __name__ == "__main__":
    main()
