"""``@tool(timeout_s=...)`` and the rule for app tools under a deadline (issue 38, item
6): the deadline clock stops while a tool is out, but never past its ``timeout_s`` (or,
without one, the run's ``deadline_s``): the step fails then, the app's call is
cancelled, and a result that comes later is discarded and recorded in the trace.
Warnings name the user's line, not the SDK's."""

from __future__ import annotations

import asyncio
import time
import warnings

import pytest

from flowlift import DeadlineExceeded, ToolError, UserError, WorkflowFailed, step, tool, workflow
from flowlift.errors import DeadlineWarning
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse


@step(max_tokens=400)
def say(text):
    return f"Say {text}"


async def _base(aiohttp_client, make_app) -> str:
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return str(client.make_url("")).rstrip("/")


async def test_a_tool_past_its_timeout_fails_its_step_and_is_cancelled(aiohttp_client,
                                                                      make_app):
    cancelled: list[float] = []

    @tool(timeout_s=0.5)
    async def stuck(x):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(time.monotonic())
            raise
        return "never"

    base = await _base(aiohttp_client, make_app)
    t0 = time.monotonic()
    with pytest.raises(WorkflowFailed) as failed:
        async with workflow("stuck", base_url=base) as wf:
            stuck("x")
    assert time.monotonic() - t0 < 5
    (error,) = failed.value.failures.values()
    assert isinstance(error, ToolError) and "timed out after 0.5 s" in str(error)
    assert cancelled and cancelled[0] - t0 < 3
    assert wf.graph().nodes[0].timeout_s == 0.5


async def test_without_a_timeout_the_runs_deadline_bounds_a_tool(aiohttp_client, make_app):
    @tool
    async def stuck(x):
        await asyncio.sleep(30)
        return "never"

    base = await _base(aiohttp_client, make_app)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadlineWarning)
        with pytest.raises(WorkflowFailed) as failed:
            async with workflow("bounded", base_url=base, deadline_s=1.0):
                stuck("x")
    took = time.monotonic() - t0
    (error,) = failed.value.failures.values()
    assert isinstance(error, DeadlineExceeded) and "run's deadline of 1 s" in str(error)
    assert 0.9 <= took < 5  # at its deadline, not after the tool's 30 s


async def test_a_late_result_is_discarded_and_traced(aiohttp_client, make_app):
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    graph = {"id": "wf-late", "nodes": [
        {"kind": "tool", "id": "slow", "name": "slow", "timeout_s": 0.3}]}
    events = parse_sse(await (await client.post("/v1/workflows", json=graph)).text())
    names = [n for n, _ in events]
    assert names.index("tool.cancelled") < names.index("step.failed") < names.index(
        "run.finished")
    late = await client.post("/v1/workflows/wf-late/steps/slow/result", json={"value": 1})
    assert late.status == 200 and (await late.json())["outcome"] == "discarded"
    run = await (await client.get("/v1/workflows/wf-late")).json()
    (record,) = [r for r in run["trace"] if r.get("step_id") == "slow"]
    assert record["status"] == "failed" and record["late_result_ms"] is not None
    assert run["status"] == "failed" and "timed out after 0.3 s" in run["failures"]["slow"]


def test_timeout_s_must_be_positive():
    with pytest.raises(UserError, match="timeout_s"):
        tool(timeout_s=0)(lambda: None)


async def test_a_deadline_warning_names_the_users_line(aiohttp_client, make_app):
    base = await _base(aiohttp_client, make_app)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with workflow("hurry", base_url=base, deadline_s=0.01):
            say("x")
    found = [w for w in caught if issubclass(w.category, DeadlineWarning)]
    assert found and all(w.filename == __file__ for w in found), [
        (w.filename, w.lineno) for w in found]
