"""A resumed run's trace remembers what happened before the crash: the same workflow run
once without interruption and once with a ``kill -9`` of its proxy mid-run (resumed by a
second proxy on the same state database) has the same token totals, the steps that
finished before the crash keep their timings, and the wall time counts from the first
start."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from flowlift import step, workflow
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.workflows.replay import trace_records
from flowlift.testing import free_port, running_proxy
from flowlift.tracing import stage_summary


@step(max_tokens=16)
def extend(text):
    return f"Continue the line: {text}"


def _serve(port: int, db: Path, log: Path):  # type: ignore[no-untyped-def]
    return running_proxy("--engine", "fake", "--state-db", str(db), "--fake-delay-s", "0.04",
                         log_path=log, port=port, ready_timeout_s=60)


def _chain(wf) -> None:  # type: ignore[no-untyped-def]
    with wf:
        x = extend("a river")
        for _ in range(3):
            x = extend(x)


def _steps(records: list[dict]) -> dict[str, dict]:  # type: ignore[type-arg]
    return {r["step_id"]: r for r in records if r["type"] == "step"}


def test_resumed_trace_matches_an_uninterrupted_run(tmp_path):
    port = free_port()
    with _serve(port, tmp_path / "a.sqlite", tmp_path / "a.log"):
        plain = workflow("chain", base_url=f"http://127.0.0.1:{port}")
        _chain(plain)
    assert plain.status == "succeeded"

    port, db = free_port(), tmp_path / "b.sqlite"
    crashed = workflow("chain", base_url=f"http://127.0.0.1:{port}", reconnect_s=60)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _chain(crashed)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    with _serve(port, db, tmp_path / "b.log") as (_, proc):
        thread.start()
        deadline = time.monotonic() + 30
        while len(crashed._outputs) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(crashed._outputs) >= 2, "the run did not get going"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    before = set(crashed._outputs)
    stored = RunStore(db).load(crashed.run_id)
    assert stored is not None
    pre_crash = _steps(trace_records(crashed.run_id, stored.graph, stored.events))
    killed_at = time.monotonic()
    with _serve(port, db, tmp_path / "b.log"):
        thread.join(timeout=60)
    outage_ms = (time.monotonic() - killed_at) * 1000
    assert not thread.is_alive() and not errors, errors
    assert crashed.status == "succeeded"

    want, got = stage_summary(plain.trace), stage_summary(crashed.trace)
    assert got["tokens"]["prompt"] == want["tokens"]["prompt"] > 0
    assert got["tokens"]["completion"] == want["tokens"]["completion"] > 0
    # wall time from the first start: the uninterrupted run's, plus at most the outage
    assert 0.8 * want["wall_ms"] <= got["wall_ms"] <= want["wall_ms"] + outage_ms + 1000

    resumed, plain_steps = _steps(crashed.trace), _steps(plain.trace)
    for sid in before:  # finished before the crash: recorded, not re-measured
        step = resumed[sid]
        assert step["status"] == "done" and step["attempts"], sid
        assert step["finished_ms"] == pre_crash[sid]["finished_ms"]
        assert step["prompt_tokens"] == plain_steps[sid]["prompt_tokens"]
        took, plain_took = (s["finished_ms"] - s["ready_ms"] for s in (step, plain_steps[sid]))
        assert abs(took - plain_took) <= max(300.0, 0.5 * plain_took), (sid, took, plain_took)
    after = [resumed[s] for s in resumed if s not in before]
    assert min(s["ready_ms"] for s in after) > max(resumed[s]["finished_ms"] for s in before)
    # the restart's gap is in the run record, from the last instant before to the resume
    (gap,) = crashed.trace[0]["restarts"]
    assert max(resumed[s]["finished_ms"] for s in before) <= gap["from_ms"] < gap["to_ms"]
    assert gap["to_ms"] <= min(s["ready_ms"] for s in after)
    assert gap["to_ms"] - gap["from_ms"] <= outage_ms + 1000
