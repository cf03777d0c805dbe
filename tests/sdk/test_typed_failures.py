"""Failures have types (issue 15, item 7): the proxy's ``step.failed`` event names a
``kind``; the SDK turns it into a class of the one error tree, text unchanged."""

from __future__ import annotations

import pytest

from flowlift import (
    ContractError,
    DeadlineExceeded,
    StepContractError,
    StepFailed,
    StepSkipped,
    ToolError,
    WorkflowFailed,
    step,
    tool,
    workflow,
)
from flowlift.errors import (
    STEP_FAILURE_KINDS,
    ContextLengthExceeded,
    EngineError,
    FlowliftError,
    RunError,
    failure_kind,
    step_failure,
)
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.state import STATE
from flowlift.proxy.workflows.runs import Run
from flowlift.testing import FakeEngine


@step(output={"type": "object"}, max_tokens=32, retries=1)
def extract(doc):
    return f"Facts of {doc} as JSON"


@step
def summarize(facts):
    return f"Summarize {facts}"


@tool
def explode(x):
    raise KeyError("no such index")


@step
def after_tool(t):
    return f"then {t}"


async def test_failures_are_typed_with_fields_and_keep_their_text(aiohttp_client, make_app,
                                                                  engine):
    engine.responder = lambda req: "not json" if req.constraint else "fine"
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    base = str(client.make_url("")).rstrip("/")
    with pytest.raises(WorkflowFailed) as info:
        async with workflow("typed", base_url=base) as wf:
            facts = extract("doc")
            summary = summarize(facts)
            t = explode("x")
            later = after_tool(t)
    failures = info.value.failures
    assert failures is not wf.failures and failures.keys() == wf.failures.keys()
    bad, skipped = failures[facts.step_id], failures[summary.step_id]
    assert isinstance(bad, StepContractError) and isinstance(bad, ContractError)
    assert bad.kind == "contract" and bad.step_id == "extract_1" and bad.attempts == 2
    assert "output is not valid JSON" in str(bad) and bad.reason == str(bad)
    assert isinstance(skipped, StepSkipped) and skipped.attempts is None
    assert str(skipped) == "skipped: input 'extract_1' failed"
    boom = failures[t.step_id]
    assert isinstance(boom, ToolError) and "KeyError" in str(boom)
    assert isinstance(failures[later.step_id], StepSkipped)
    with pytest.raises(StepSkipped, match="skipped"):
        _ = summary.value
    assert f"extract_1: {bad}" in str(info.value)


async def test_a_missed_deadline_is_deadline_exceeded():
    engine = FakeEngine(["m"], delay_s=0.1)
    run = Run(Graph.model_validate({"deadline_s": 0.2, "nodes": [
        {"kind": "llm", "id": "slow", "messages": [
            {"role": "user", "content": [{"text": "word " * 40}]}]}]}), Backends({"m": engine}))
    await run.start()
    events = [(name, data) for _, name, data in run.log.history() if name == "step.failed"]
    assert events and events[0][1]["kind"] == "deadline"
    assert events[0][1]["error"] == run.failures["slow"]
    failure = step_failure("slow", events[0][1]["error"], events[0][1]["kind"])
    assert isinstance(failure, DeadlineExceeded) and "deadline of 0.2 s" in str(failure)


def test_kinds_map_both_ways_in_one_place():
    for kind, cls in STEP_FAILURE_KINDS.items():
        made = step_failure("s", "why", kind, 3)
        assert type(made) is cls and made.kind == kind and made.attempts == 3
        assert failure_kind(made) == kind
        assert isinstance(made, StepFailed) and isinstance(made, RunError)
        assert isinstance(made, FlowliftError)
    assert type(step_failure("s", "why", "from-a-newer-proxy")) is StepFailed
    assert failure_kind(ContractError("x")) == "contract"
    assert failure_kind(ContextLengthExceeded("x")) == "rejected"
    assert failure_kind(EngineError("x")) == "engine"
    assert failure_kind(ValueError("x")) == "error"


def test_workflow_failed_still_takes_text():
    err = WorkflowFailed("wf-1", {"a": "boom"})
    assert type(err.failures["a"]) is StepFailed and str(err.failures["a"]) == "boom"
    assert err.failures["a"].cause == "boom"
    assert "a: boom" in str(err)
