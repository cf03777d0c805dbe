"""The stage split of a step tried more than once: earlier tries are `retry`, prefill and
decode are the last try's, and the stages add up to the step's wall time."""

from __future__ import annotations

import pytest

from flowlift.tracing import AttemptTrace, StepTrace, stage_summary
from flowlift.tracing.recorder import ToolCallTrace


def test_a_retried_step_splits_into_queue_retry_prefill_decode_validate():
    st = StepTrace("s", "llm", ready_ms=0.0, started_ms=10.0, first_token_ms=15.0,
                   generated_ms=100.0, finished_ms=102.0)
    st.attempts = [AttemptTrace(1, "small", 10.0, first_token_ms=15.0, finished_ms=40.0,
                                outcome="contract_failed"),
                   AttemptTrace(2, "small", 45.0, first_token_ms=60.0, finished_ms=102.0,
                                outcome="ok")]
    stages = st.durations_ms()
    assert stages == {"queue": 10.0, "retry": 35.0, "prefill": 15.0, "decode": 40.0,
                      "validate": 2.0}
    assert sum(stages.values()) == pytest.approx(st.finished_ms - st.ready_ms)


def test_one_try_has_no_retry_stage_and_the_summary_counts_retries():
    one = StepTrace("a", "llm", ready_ms=0.0, started_ms=1.0, first_token_ms=2.0,
                    generated_ms=5.0, finished_ms=5.0)
    one.attempts = [AttemptTrace(1, "m", 1.0, first_token_ms=2.0, finished_ms=5.0,
                                 outcome="ok")]
    assert "retry" not in one.durations_ms()
    two = StepTrace("b", "llm", ready_ms=0.0, started_ms=1.0, first_token_ms=2.0,
                    generated_ms=9.0, finished_ms=9.0)
    two.attempts = [AttemptTrace(1, "m", 1.0, finished_ms=3.0, outcome="error"),
                    AttemptTrace(2, "m", 4.0, first_token_ms=6.0, finished_ms=9.0,
                                 outcome="ok")]
    summary = stage_summary([{"type": "step", "stages_ms": s.durations_ms()}
                             for s in (one, two)])
    assert summary["stages"]["retry"] == {"total_ms": 3.0, "count": 1, "mean_ms": 3.0}


def test_an_agent_step_sums_decode_and_prefill_over_its_turns():
    """Three turns: 300 + 260 ms of decode before a last turn of 22 ms. The step shows
    582 ms of decode, not the last turn's alone (nor 0 ms), and no retry: a turn that
    called tools is work, not a failed try (issue 38 item 9)."""
    st = StepTrace("agent", "llm", ready_ms=0.0, started_ms=5.0, first_token_ms=905.0,
                   generated_ms=927.0, finished_ms=930.0)
    st.attempts = [AttemptTrace(1, "m", 5.0, first_token_ms=45.0, finished_ms=345.0,
                                outcome="tool_calls", turn=1),
                   AttemptTrace(2, "m", 400.0, first_token_ms=440.0, finished_ms=700.0,
                                outcome="tool_calls", turn=2),
                   AttemptTrace(3, "m", 800.0, first_token_ms=905.0, finished_ms=930.0,
                                outcome="ok", turn=3)]
    st.tool_calls = [ToolCallTrace("agent:call_1", "search", 1, 345.0, 400.0, "ok"),
                     ToolCallTrace("agent:call_2", "read", 2, 700.0, 800.0, "ok",
                                   server="docs")]
    assert st.durations_ms() == {"queue": 5.0, "prefill": 40.0 + 40.0 + 105.0,
                                 "decode": 300.0 + 260.0 + 22.0, "validate": 3.0,
                                 "tool_wait": 55.0, "tool_run": 100.0}
    assert sum(st.durations_ms().values()) == pytest.approx(st.finished_ms - st.ready_ms)
