"""Estimates that can be trusted: output lengths learned per (step, model) from finished
runs (``step_output_tokens`` in the state database) are what the compiler plans a second
run of the same workflow with, on a FakeEngine with fixed per-chunk delays (a first run,
planned at ``max_tokens`` per step, is off by far more); the run page shows estimate
against measurement per step. The planned critical path lands in the measured one's range
here; the ±30% goal (P10) is checked by ``bench/estimate_check.py`` on the real engine,
not by a timed test (under CI load one run's wall clock can swing by more than 30%: the
test failed that way when it asserted ±30%).
"""

from __future__ import annotations

import time
import warnings

import httpx
import pytest

from flowlift import step, workflow
from flowlift.errors import DeadlineWarning, RequestError
from flowlift.proxy.store.outcomes import OutputLengths, StepOutcomes
from flowlift.testing import running_proxy
from flowlift.tracing.timeline import (
    measured_critical_path,
    path_stage_ms,
    report_deps,
    split_records,
)


@step(max_tokens=200)
def outline(topic):
    return f"Outline an essay on {topic}"


@step(max_tokens=200)
def counter(topic):
    return f"Argue against {topic}"


@step(max_tokens=200)
def merge(a, b):
    return f"Merge {a} with {b}"


def _run(base: str) -> tuple[str, float, float]:
    """A run's id, its planned and its measured critical path (ms)."""
    run_id, report, measured = _run_report(base)
    return run_id, report["critical_path_ms"], measured


def _run_report(base: str) -> tuple[str, dict, float]:
    """A run's id, its compile report and its measured critical path (ms)."""
    with workflow("essay", base_url=base) as wf:
        topic = wf.input("tides and the moon")
        merge(outline(topic), counter(topic))
    doc = httpx.get(f"{base}/v1/workflows/{wf.run_id}").json()
    report = doc["report"]
    _, steps = split_records(doc["trace"])
    path = measured_critical_path(steps, report_deps(report))
    return wf.run_id, report, sum(path_stage_ms(steps, path).values())


def _recorded(outcomes: StepOutcomes, steps: tuple[str, ...], timeout_s: float = 30.0
              ) -> dict[str, OutputLengths | None]:
    """The output lengths learned per step, once every step's are in the state database:
    the proxy records a finished run's outcomes through its store worker, after the run's
    last event (a CI run read them too early: two of three steps not yet recorded)."""
    until = time.monotonic() + timeout_s
    while True:
        learned = {s: outcomes.lengths(s, "fake-model") for s in steps}
        if all(v is not None for v in learned.values()) or time.monotonic() > until:
            return learned
        time.sleep(0.05)


def test_second_run_plans_with_the_lengths_the_first_run_produced(tmp_path):
    db = tmp_path / "state.sqlite"
    with running_proxy("--engine", "fake", "--state-db", str(db), "--fake-delay-s", "0.05",
                       log_path=tmp_path / "proxy.log", ready_timeout_s=60) as (base, _):
        _, first, first_measured = _run_report(base)
        learned = _recorded(StepOutcomes(db), ("outline", "counter", "merge"))
        run_id, second, measured = _run_report(base)
        page = httpx.get(f"{base}/ui/workflows/{run_id}").text
    assert first["critical_path_ms"] > 3 * first_measured  # planned at max_tokens (200)
    planned_out = {n["step_id"].rsplit("_", 1)[0]: n["output_tokens"] for n in second["nodes"]
                   if n["kind"] == "llm"}
    assert all(v is not None and v.samples == 1 for v in learned.values()), learned
    assert planned_out == {s: v.p50 for s, v in learned.items() if v is not None}
    assert all(v < 200 for v in planned_out.values())
    planned = second["critical_path_ms"]
    assert 0.5 * measured <= planned <= 2 * measured, (planned, measured)
    lengths = StepOutcomes(db).lengths("merge", "fake-model")
    assert lengths is not None and lengths.samples == 2 and lengths.p50 < 200
    assert "est / took" in page and "out est/got" in page


def test_infeasible_deadline_warns_at_submission_or_is_refused(tmp_path):
    with running_proxy("--engine", "fake", "--state-db", ":memory:", "--fake-delay-s", "0.0",
                       log_path=tmp_path / "proxy.log", ready_timeout_s=60) as (base, _):
        # planned at max_tokens per step with unmeasured costs: ~40 s; it takes far less
        with (pytest.warns(DeadlineWarning, match=r"deadline of 5 s looks infeasible"),
              workflow("hurry", base_url=base, deadline_s=5) as wf):
            merge(outline("x"), counter("x"))
        assert wf.status == "succeeded"  # it ran all the same
        with (pytest.raises(RequestError, match="strict_deadline") as refused,
              workflow("hurry", base_url=base, deadline_s=0.001, strict_deadline=True)):
            merge(outline("x"), counter("x"))
        assert refused.value.param == "deadline_s"
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeadlineWarning)
            with workflow("relaxed", base_url=base, deadline_s=3600, strict_deadline=True):
                outline("x")
