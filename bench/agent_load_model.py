"""A queueing model of ``bench/agent_load.py``: what least-attained-service ordering can
gain over first come, first served for its sessions, with no engine at all.

Each session is ``turns`` turns; a turn holds one of ``capacity`` slots for ``turn_s``
(constant, or growing by ``growth_s`` per turn already done: a longer conversation's
turn decodes over more context), then its tool runs ``tool_s`` and the next turn
queues. Waiting turns are granted by arrival (``fcfs``) or by their session's LAS level
then arrival (``las``: :func:`flowlift.proxy.dispatch.slots.programs.las_level` over the
engine-seconds the session held slots). A discrete-event simulation; pure.

    .venv/bin/python bench/agent_load_model.py [--turn-s 1.5] [--growth-s 0.02]
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import pct
from flowlift.proxy.dispatch.slots.programs import las_level


def simulate(plan: list[tuple[float, int]], policy: str, *, turn_s: float,
             tool_s: float, capacity: int, quantum_s: float = 1.0,
             growth_s: float = 0.0) -> dict[str, float]:
    """Session completion times (arrival to last turn's end) under ``policy``.

    Args:
        plan: ``(arrival s, turns)`` per session.
        policy: ``"fcfs"`` or ``"las"``.

    Returns:
        ``mean_s``, ``p90_s`` and ``makespan_s``.
    """
    events: list[tuple[float, int, str, int]] = []
    for i, (offset, _) in enumerate(plan):
        heapq.heappush(events, (offset, i, "ready", i))
    seq = len(plan)
    left = {i: n for i, (_, n) in enumerate(plan)}
    served = {i: 0.0 for i in left}
    done_turns = {i: 0 for i in left}
    waiting: list[tuple[int, float, int, int]] = []
    busy, completion, last = 0, {}, 0.0
    while events:
        now, _, kind, i = heapq.heappop(events)
        if kind == "ready":
            level = las_level(served[i], quantum_s, 16) if policy == "las" else 0
            heapq.heappush(waiting, (level, now, seq, i))
            seq += 1
        else:
            busy -= 1
            left[i] -= 1
            done_turns[i] += 1
            if left[i] == 0:
                completion[i] = now - plan[i][0]
                last = max(last, now)
            else:
                heapq.heappush(events, (now + tool_s, seq, "ready", i))
                seq += 1
        while busy < capacity and waiting:
            *_, j = heapq.heappop(waiting)
            hold = turn_s + growth_s * done_turns[j]
            served[j] += hold
            busy += 1
            heapq.heappush(events, (now + hold, seq, "end", j))
            seq += 1
    times = list(completion.values())
    return {"mean_s": round(statistics.mean(times), 2), "p90_s": round(pct(times, 90), 2),
            "makespan_s": round(last - min(o for o, _ in plan), 2)}


def compare(plan: list[tuple[float, int]], **kw: Any) -> dict[str, Any]:
    """Both policies on ``plan`` and the ratio fcfs / las of mean and p90."""
    fcfs, las = simulate(plan, "fcfs", **kw), simulate(plan, "las", **kw)
    return {"fcfs": fcfs, "las": las,
            "mean_ratio": round(fcfs["mean_s"] / las["mean_s"], 2),
            "p90_ratio": round(fcfs["p90_s"] / las["p90_s"], 2)}


def main() -> int:
    from bench.agent_load import DEFAULT_TURNS, schedule
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--turn-s", type=float, default=1.5)
    parser.add_argument("--growth-s", type=float, default=0.0)
    parser.add_argument("--tool-s", type=float, default=0.2)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="the same (it takes < 1 s)")
    args = parser.parse_args()
    for gap in (0.0, 1.0, 2.0, 4.0):
        out = compare(schedule(DEFAULT_TURNS, gap, 0), turn_s=args.turn_s,
                      tool_s=args.tool_s, capacity=args.capacity, growth_s=args.growth_s)
        print(f"arrival gap {gap:3.1f} s: fcfs {out['fcfs']} las {out['las']} "
              f"fcfs/las mean {out['mean_ratio']} p90 {out['p90_ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
