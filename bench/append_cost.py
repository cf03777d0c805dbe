"""Appends that cost what they add (issue 24 part 3): per-append latency of an open run
as it grows to 10, 100, 300 and 1,000 steps, on the fake engine.

An agent loop in an open run: the app posts the first turn (``"open": true``), then per
turn waits for the previous step's answer (the run's SSE stream) and appends the next
step with ``awaited`` set to it, as the SDK does. Two shapes of step:

* **conversation** (the issue's case): each step holds the whole conversation so far --
  the system preamble, the task, every earlier turn's answer and tool result as text --
  plus the new turn, which reads the previous step's output (a reference). A step is
  O(turns) big, so parsing, storing and tokenizing it grows with the run whatever the
  compiler does.
* **chain**: each step holds the preamble, the previous step's output (a reference) and
  the new tool result: constant-size steps, so what grows is the graph alone.

Each shape runs on two proxies side by side, one turn of each in turn: the incremental
compiler (default) and ``flowlift serve --append-recompile`` (the whole grown graph
validated and compiled per append, as before). Per size N, the window of the appends
that brought the run to its last ``--window`` steps before N (appends 2..10 for N=10):
p50/p90 of the client-measured POST round trip and of the proxy's own time (the
append's ``Server-Timing: append;dur=``), and the ratio of the p50s at the largest vs
the smallest size. The baseline grows only to ``--recompile-max`` steps (its appends
cost O(run) each, O(run^2) in all).

    .venv/bin/python bench/append_cost.py                      # both shapes, ~10 min
    .venv/bin/python bench/append_cost.py --sizes 10,100 --shapes chain
    .venv/bin/python bench/append_cost.py --smoke              # seconds: plumbing only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import pct, proxy, save

PREAMBLE = ("You are a coding agent in a Python repository with a shell tool. Each turn, "
            "read the latest tool result, then state the next command and why, in one "
            "short sentence. Never edit files outside src/; run the tests after each "
            "change; prefer small, reversible steps; report failures verbatim.")
TASK = "The option --limit is ignored when it is zero: find out why and fix it."
TIMING = re.compile(r"append;dur=([0-9.]+)")


def tool_result(k: int) -> str:
    return (f"$ pytest -q tests/test_parse.py::test_limit_{k}\n"
            f"{k % 7} failed, {12 + k % 5} passed in 0.{k % 9 + 1}s")


def answer_text(k: int) -> str:
    return f"Turn {k}: run the failing test again after reading src/run.py line {k % 40}."


def step_node(k: int, shape: str) -> dict[str, Any]:
    """Wire node ``turn_k`` of the agent loop (turn_1 reads nothing)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"text": PREAMBLE}]},
        {"role": "user", "content": [{"text": TASK}]}]
    if shape == "conversation":  # every earlier turn as the app read it, as text
        for j in range(1, k - 1):
            messages += [{"role": "assistant", "content": [{"text": answer_text(j)}]},
                         {"role": "user", "content": [{"text": tool_result(j)}]}]
    if k > 1:
        messages += [{"role": "assistant", "content": [{"ref": f"turn_{k - 1}"}]},
                     {"role": "user", "content": [{"text": tool_result(k - 1)}]}]
    return {"kind": "llm", "id": f"turn_{k}", "name": "turn", "messages": messages,
            "params": {"max_tokens": 16, "temperature": 0.7}}


class Follower:
    """The run's event stream in a thread: which steps have finished."""

    def __init__(self, client: httpx.Client, first: dict[str, Any]) -> None:
        self.finished: set[str] = set()
        self.run_id: str | None = None
        self.error: str | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._follow, args=(client, first),
                                        daemon=True)
        self._thread.start()

    def _follow(self, client: httpx.Client, first: dict[str, Any]) -> None:
        try:
            with connect_sse(client, "POST", "/v1/workflows", json=first) as source:
                for sse in source.iter_sse():
                    data = json.loads(sse.data) if sse.data else {}
                    with self._cond:
                        if sse.event in ("run.started", "run.resumed"):
                            self.run_id = data["run_id"]
                        elif sse.event == "step.finished":
                            self.finished.add(data["step_id"])
                        elif sse.event == "step.failed":
                            self.error = f"{data['step_id']}: {data['error']}"
                        self._cond.notify_all()
                        if sse.event == "run.finished":
                            return
        except httpx.HTTPError as exc:
            with self._cond:
                self.error = f"stream: {exc}"
                self._cond.notify_all()

    def wait(self, step_id: str | None, timeout_s: float = 60.0) -> str:
        """Block until ``step_id`` finished (None: until the run started); the run id.

        Raises:
            RuntimeError: a step failed, the stream broke, or the wait timed out.
        """
        with self._cond:
            ok = self._cond.wait_for(lambda: self.error is not None or (
                self.run_id is not None and (step_id is None or step_id in self.finished)),
                timeout=timeout_s)
            if self.error is not None or not ok or self.run_id is None:
                raise RuntimeError(self.error or f"timed out waiting for {step_id}")
            return self.run_id


class Session:
    """One growing agent-loop run on one proxy."""

    def __init__(self, base: str, shape: str, name: str) -> None:
        self.shape = shape
        self.client = httpx.Client(base_url=base, timeout=600)
        self.follower = Follower(self.client, {"open": True, "name": name,
                                               "nodes": [step_node(1, shape)],
                                               "class": "interactive"})
        self.run_id = self.follower.wait(None)
        self.rows: list[dict[str, float]] = []

    def turn(self, k: int) -> None:
        """Wait for turn k-1's answer, then append turn k (timed)."""
        self.follower.wait(f"turn_{k - 1}")
        body = {"nodes": [step_node(k, self.shape)], "awaited": [f"turn_{k}"]}
        t0 = time.perf_counter()
        r = self.client.post(f"/v1/workflows/{self.run_id}/nodes", json=body)
        client_ms = (time.perf_counter() - t0) * 1000
        r.raise_for_status()
        found = TIMING.search(r.headers.get("server-timing", ""))
        self.rows.append({"steps": k, "client_ms": client_ms,
                          "proxy_ms": float(found.group(1)) if found else float("nan"),
                          "body_kb": len(json.dumps(body)) / 1024})

    def close(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            self.client.post(f"/v1/workflows/{self.run_id}/close")
        self.client.close()


def windows(rows: list[dict[str, float]], sizes: list[int], width: int
            ) -> dict[str, dict[str, float]]:
    """Per size N: p50/p90 over the appends that brought the run to N-width+1..N steps."""
    out: dict[str, dict[str, float]] = {}
    for n in sizes:
        got = [r for r in rows if n - width < r["steps"] <= n]
        if not got:
            continue
        c = [r["client_ms"] for r in got]
        p = [r["proxy_ms"] for r in got]
        out[str(n)] = {"appends": len(got), "client_p50_ms": round(pct(c, 50), 2),
                       "client_p90_ms": round(pct(c, 90), 2),
                       "proxy_p50_ms": round(pct(p, 50), 2),
                       "proxy_p90_ms": round(pct(p, 90), 2),
                       "body_kb": round(got[-1]["body_kb"], 1)}
    return out


def ratio(per_size: dict[str, dict[str, float]], key: str) -> float | None:
    """p50 ``key`` at the largest size over the smallest."""
    if len(per_size) < 2:
        return None
    sizes = sorted(per_size, key=int)
    low = per_size[sizes[0]][key]
    return round(per_size[sizes[-1]][key] / low, 2) if low else None


@contextlib.contextmanager
def proxies(smoke: bool) -> Iterator[dict[str, str]]:
    with proxy(name="append_incremental", engine="fake") as fast, \
            proxy("--append-recompile", name="append_recompile", engine="fake") as full:
        yield {"incremental": fast, "recompile": full}
    del smoke


def measure(bases: dict[str, str], shape: str, sizes: list[int], width: int,
            recompile_max: int) -> dict[str, Any]:
    """Both modes grown turn by turn, alternating; their per-size windows."""
    top = max(sizes)
    sessions = {"incremental": Session(bases["incremental"], shape, f"append-{shape}")}
    if recompile_max > 1:
        sessions["recompile"] = Session(bases["recompile"], shape, f"append-{shape}-full")
    for k in range(2, top + 1):
        for mode, s in sessions.items():
            if mode == "incremental" or k <= recompile_max:
                s.turn(k)
        if k in sizes:
            print(f"[{shape}] {k} steps: " + ", ".join(
                f"{m} {s.rows[-1]['client_ms']:.1f} ms" for m, s in sessions.items()
                if s.rows and s.rows[-1]['steps'] == k), flush=True)
    out: dict[str, Any] = {}
    for mode, s in sessions.items():
        per = windows(s.rows, [n for n in sizes if mode == "incremental" or
                               n <= recompile_max], width)
        out[mode] = {"per_size": per, "client_p50_ratio": ratio(per, "client_p50_ms"),
                     "proxy_p50_ratio": ratio(per, "proxy_p50_ms")}
        s.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10,100,300,1000",
                   help="run sizes (steps) to report, comma-separated")
    p.add_argument("--shapes", default="conversation,chain",
                   help="step shapes: conversation, chain (comma-separated)")
    p.add_argument("--window", type=int, default=20,
                   help="appends per size the percentiles cover (default 20)")
    p.add_argument("--recompile-max", type=int, default=300,
                   help="largest run the --append-recompile baseline grows to")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: plumbing only")
    a = p.parse_args()
    sizes = [10, 30] if a.smoke else sorted(int(s) for s in a.sizes.split(","))
    recompile_max = 30 if a.smoke else a.recompile_max
    results: dict[str, Any] = {"sizes": sizes, "window": a.window,
                               "recompile_max": recompile_max, "shapes": {}}
    with proxies(a.smoke) as bases:
        for shape in a.shapes.split(","):
            results["shapes"][shape] = measure(bases, shape, sizes, a.window, recompile_max)
    for shape, modes in results["shapes"].items():
        for mode, got in modes.items():
            ends = sorted(got["per_size"], key=int)
            print(f"\n{shape} / {mode}: p50 ratio {ends[-1]} vs {ends[0]} steps: client "
                  f"{got['client_p50_ratio']}, proxy {got['proxy_p50_ratio']}")
            for n, row in got["per_size"].items():
                print(f"  {n:>5} steps  client p50 {row['client_p50_ms']:8.2f}  p90 "
                      f"{row['client_p90_ms']:8.2f} ms | proxy p50 {row['proxy_p50_ms']:8.2f}"
                      f"  p90 {row['proxy_p90_ms']:8.2f} ms | step {row['body_kb']} KiB")
    save("append_cost", results, smoke=a.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
