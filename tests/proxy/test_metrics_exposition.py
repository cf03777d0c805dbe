"""``/metrics`` text after a fixed traffic, byte for byte against the text the proxy
served before its request metrics were kept in plain Python structures (issue 28 item 5):
the golden files in ``tests/data`` were written by this module's :func:`traffic` through
prometheus_client's own ``Counter`` and ``Histogram`` objects (flowlift 5bed833,
``python tests/proxy/test_metrics_exposition.py --write``). Same names, help, types, labels,
children in the same order, buckets, ``_sum``, ``_count``, and ``_created`` (each
child's creation time, from a fake clock; none with created series disabled)."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics import Counter, Histogram

from flowlift.tracing import AttemptTrace
from flowlift.tracing.metrics import Metrics
from flowlift.tracing.recorder import RunTrace, StepTrace

DATA = Path(__file__).parents[1] / "data"
GOLDEN = {True: DATA / "metrics_exposition.txt",
          False: DATA / "metrics_exposition.no_created.txt"}
PRICES = {"m-a": 0.5, "m-c": 2.0}


def make_metrics() -> Metrics:
    return Metrics(queue_depth=lambda: [("engine-0", "batch", 3), ("engine-0", "interactive", 0)],
                   active_workflows=lambda: 2,
                   upstream_in_flight=lambda: [("up-1", 4)],
                   preemptions=lambda: [("engine-0", 5)],
                   price_per_1k=PRICES.get,
                   model_loads=lambda: [("m-a", 2, 1)],
                   programs=lambda: [("engine-0", 3, 1, 2, 0)])


def a_run() -> RunTrace:
    trace = RunTrace("r-1", "wf", workflow_class="batch", started_at=1.0e9, status="succeeded")
    one = trace.steps["s1"] = StepTrace("s1", "llm", model="small", ready_ms=1.0,
                                        started_ms=4.5, generated_ms=90.0)
    one.attempts = [AttemptTrace(1, "small", 5.0, 9.0, 20.0, "contract_failed", 30, 8, 10),
                    AttemptTrace(2, "small", 21.0, 24.0, 40.0, "low_confidence", 30, 6, 30),
                    AttemptTrace(3, "m-c", 41.0, 50.0, None, "ok", 31, 12, 0)]
    two = trace.steps["s2"] = StepTrace("s2", "llm", model="m-a", ready_ms=2.0, started_ms=2.0,
                                        generated_ms=2.5)
    two.attempts = [AttemptTrace(1, "m-a", 2.0, None, 2.5, "error", 9, 0, 0)]
    trace.steps["s3"] = StepTrace("s3", "llm", model="m-a", same_as="s2")  # reused: not counted
    trace.steps["t"] = StepTrace("t", "tool")
    return trace


def traffic(metrics: Metrics) -> None:
    """OpenAI requests of every kind the observer reports, a run, and the direct calls."""
    overheads = [0.0, 0.0001, 0.00042, 0.0005, 0.0009, 0.0015, 0.004, 0.3, 2.0, float("inf")]
    for i, overhead in enumerate(overheads):
        stream = i % 2 == 0
        metrics.observe_request("chat", "complete", "m-a", 0.005 * i, 0.01 * i,
                                (10 + i, 20 + i, i), overhead_s=overhead, stream=stream)
        metrics.spend("m-a", 10 + i, 20 + i)
        metrics.tenant_usage("acme" if stream else None, "m-a", 10 + i, 20 + i)
    metrics.observe_request("text_completion", "abandoned", "m-b", 0.3, None, (7, 2, None),
                            partial=True, overhead_s=0.0002, stream=True)
    metrics.spend("m-b", 7, 2)  # no price: no spend
    metrics.tenant_usage("beta", "m-b", 7, 2)  # a tenant's tokens, at no price
    metrics.observe_request("chat", "error", None, None, None, (None, None, None),
                            overhead_s=0.0007)
    metrics.observe_request("embeddings", "complete", "m-c", None, None, (5, 0, 0))
    metrics.tenant_usage("acme", "m-c", 0, 0)  # zeros still make the child
    metrics.observe_run(a_run(), deadline_missed=True, tenant="acme")
    metrics.cascade_escalated("m-c", "m-d")
    metrics.observe_request("chat", "complete", "m-a", 100.0, 0.5, (3, 1, 0),
                            overhead_s=0.0001)


def exposition(created: bool) -> str:
    clock = itertools.count(1_700_000_000.0, 0.25)
    real = time.time
    time.time = lambda: next(clock)  # each child's creation instant, in order
    try:
        metrics = make_metrics()
        traffic(metrics)
    finally:
        time.time = real
    if not created:
        prometheus_metrics.disable_created_metrics()
    try:
        return metrics.exposition().decode()
    finally:
        prometheus_metrics.enable_created_metrics()


@pytest.mark.parametrize("created", [True, False])
def test_the_scrape_text_is_the_one_served_before(created):
    assert exposition(created) == GOLDEN[created].read_text()


def test_recording_touches_no_prometheus_client_metric(monkeypatch):
    """Requests and runs are counted in plain Python structures, folded into
    prometheus_client's metric families only at scrape time."""
    def refuse(*args, **kwargs):
        raise AssertionError("a prometheus_client metric touched while recording")
    for cls, method in ((Counter, "inc"), (Counter, "labels"), (Histogram, "observe"),
                        (Histogram, "labels")):
        monkeypatch.setattr(cls, method, refuse)
    metrics = make_metrics()
    traffic(metrics)
    text = metrics.exposition().decode()
    assert 'flowlift_openai_requests_total{operation="chat",outcome="complete"} 11.0' in text


def test_a_negative_count_is_refused_as_prometheus_client_refuses_it():
    metrics = Metrics()
    with pytest.raises(ValueError):
        metrics.observe_request("chat", "complete", "m", None, None, (3, -1, 0))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    for created, path in GOLDEN.items():
        path.write_text(exposition(created))
        print("wrote", path)
