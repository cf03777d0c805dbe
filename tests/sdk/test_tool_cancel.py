"""Tool calls the proxy no longer wants are cancelled in the app too (issue 38, item 14):
a ``first``/``quorum`` loser's ``@tool`` call still out, an agent step's calls when its
run is cancelled; the proxy says so (``tool.cancelled``) before the run ends, an async
tool's task is cancelled at once, and a call cancelled ends ``cancelled`` in the trace
(never left ``running``)."""

from __future__ import annotations

import asyncio
import time

from flowlift import step, tool, workflow
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse, tool_calls_text


@step(max_tokens=40)
def say(text):
    return f"Say {text}"


async def test_a_losing_async_tool_is_cancelled_in_the_app_when_its_group_resolves(
        aiohttp_client, make_app, engine):
    cancelled_at: list[float] = []
    started_at: list[float] = []
    meanwhile_done: list[float] = []

    @tool
    async def slow_lookup(x):
        started_at.append(time.monotonic())
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled_at.append(time.monotonic())
            raise
        return "never"

    @tool
    async def meanwhile(x):  # keeps the run going after the group resolved
        await asyncio.sleep(1.0)
        meanwhile_done.append(time.monotonic())
        return "done"

    engine.responder = lambda r: "quick answer"
    # the winner takes ~0.3 s to decode, so the loser's call is out in the app before the
    # group resolves (with an instant winner the loser may be skipped before it is sent)
    engine.delay_s = 0.1
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    t0 = time.monotonic()
    async with workflow("loser", base_url=str(client.make_url("")).rstrip("/")) as wf:
        looked = slow_lookup("q")
        best = wf.first(looked, say("q"))
        rest = meanwhile("x")
    assert best.value == "quick answer" and rest.value == "done"
    assert looked.step_id in wf.skipped and wf.status == "succeeded"
    # cancelled when the group resolved, not when the run ended a second later
    assert started_at, "the losing tool never started; the test's race is not set up"
    assert cancelled_at and meanwhile_done and cancelled_at[0] < meanwhile_done[0]
    assert time.monotonic() - t0 < 5


async def test_a_cancelled_runs_agent_tool_call_ends_cancelled_and_the_app_hears(
        aiohttp_client, make_app, engine):
    engine.responder = lambda r: tool_calls_text(("lookup", {"city": "Oslo"}))
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    graph = {"id": "wf-agent-cancel", "nodes": [
        {"kind": "llm", "id": "answer", "model": "fake-model",
         "messages": [{"role": "user", "content": [{"text": "weather?"}]}],
         "tools": [{"name": "lookup", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}],
         "max_turns": 3}]}
    resp = await client.post("/v1/workflows", json=graph)
    events = []
    async for line in resp.content:
        events.append(line)
        if b"tool.wanted" in line:
            break
    assert (await client.delete("/v1/workflows/wf-agent-cancel")).status == 200
    rest = parse_sse(b"".join(events).decode() + (await resp.read()).decode())
    names = [name for name, _ in rest]
    assert "tool.cancelled" in names and names.index("tool.cancelled") < names.index(
        "run.finished")
    cancel = dict(rest)["tool.cancelled"]
    assert cancel["step_id"] == "answer:call_1" and "cancelled" in cancel["reason"]
    run = await (await client.get("/v1/workflows/wf-agent-cancel")).json()
    (record,) = [r for r in run["trace"] if r.get("step_id") == "answer"]
    (call,) = record["tool_calls"]
    assert call["outcome"] == "cancelled" and call["finished_ms"] is not None
