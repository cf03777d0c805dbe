"""The SDK shipping graphs to a real proxy (aiohttp test server on a FakeEngine)."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from pydantic import BaseModel

from flowlift import GraphError, ProxyUnavailable, StepFailed, WorkflowFailed, step, tool, workflow
from flowlift.testing import FakeEngine


class Facts(BaseModel):
    name: str
    tags: list[str]


@step(output=Facts, model="fake-model")
def extract(doc):
    return [{"role": "system", "content": "Shared preamble."},
            {"role": "user", "content": f"Document: {doc}"}]


@step(output=Literal["alpha", "beta"])
def classify(facts):
    return f"Classify {facts.name}"


CALLS: list[tuple] = []


@tool
def lookup(facts: Facts, label: str, k: int = 2):
    CALLS.append((type(facts).__name__, label, k))
    return {"related": [facts.name] * k, "label": label}


@tool
async def alookup(facts: Facts, label: str):
    await asyncio.sleep(0)
    return [label, facts.tags[0]]


@step(max_tokens=50)
def summarize(facts, label, related):
    return f"{facts.name} is {label}; related {related}"


def pipeline(docs, lookup_tool):
    outs = []
    for doc in docs:
        facts = extract(doc)
        label = classify(facts)
        outs.append(summarize(facts, label, lookup_tool(facts, label)))
    return outs


async def test_async_workflow_with_tools(client, tmp_path):
    base = str(client.make_url("")).rstrip("/")
    trace = tmp_path / "trace.jsonl"
    async with workflow("e2e", base_url=base, trace_path=trace) as wf:
        outs = pipeline(["d1", "d2", "d3"], alookup)
        first_facts = extract("d4")
    assert wf.status == "succeeded" and wf.run_id.startswith("wf-")
    assert [o.value for o in outs] == ["echo: x is alpha; related [\"alpha\", \"x\"]"] * 3
    assert isinstance(first_facts.value, Facts) and first_facts.name.value == "x"
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["type"] == "run" and len(records) == 1 + 13
    summary = wf.summary()
    assert summary["stages"]["tool_wait"]["count"] == 3
    assert summary["stages"]["prefill"]["count"] == 10
    assert "tool_wait" in wf.report()


async def test_sync_workflow_in_a_thread(client):
    base = str(client.make_url("")).rstrip("/")
    CALLS.clear()

    def run():
        with workflow("sync", base_url=base, workflow_class="batch") as wf:
            outs = pipeline(["a", "b"], lookup)
        return wf, outs

    wf, outs = await asyncio.to_thread(run)
    assert wf.status == "succeeded"
    assert CALLS == [("Facts", "alpha", 2), ("Facts", "alpha", 2)]
    assert outs[0].value.startswith("echo: x is alpha; related {")


async def test_failures_raise_but_keep_finished_outputs(aiohttp_client, make_app, engine):
    from flowlift.proxy.state import STATE

    engine.responder = lambda req: "not json" if req.constraint else "fine"
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()

    @step
    def free(x):
        return f"free {x}"

    base = str(client.make_url("")).rstrip("/")
    with pytest.raises(WorkflowFailed) as info:
        async with workflow("fails", base_url=base):
            facts = extract("doc")
            label = classify(facts)
            ok = free("y")
    assert set(info.value.failures) == {"extract_1", "classify_1"}
    assert ok.value == "fine"
    with pytest.raises(StepFailed, match="not valid JSON"):
        _ = facts.value
    with pytest.raises(StepFailed, match="skipped"):
        _ = label.value


async def test_invalid_graph_raises_graph_error_with_all_problems(client):
    base = str(client.make_url("")).rstrip("/")

    @step(model="no-such-model")
    def bad():
        return "x"

    with pytest.raises(GraphError) as info:
        async with workflow("bad", base_url=base):
            bad()
            bad()
    assert len(info.value.problems) == 2


async def test_eager_step_outside_workflow(client, monkeypatch):
    monkeypatch.setenv("FLOWLIFT_BASE_URL", str(client.make_url("")).rstrip("/"))

    @step
    def hello(name):
        return f"hi {name}"

    assert await asyncio.to_thread(hello, "bob") == "echo: hi bob"


def test_no_proxy_is_a_clear_error():
    @step
    def hello():
        return "hi"

    with pytest.raises(ProxyUnavailable, match="flowlift serve"), \
            workflow("x", base_url="http://127.0.0.1:9"):
        hello()


def test_fake_engine_reports_prefix_cache_hits():
    from flowlift.local_engine.base import ChatMessage, GenerationRequest

    eng = FakeEngine()

    async def go():
        usages = []
        for tail in ("one", "two"):
            req = GenerationRequest(request_id=tail, model="fake-model",
                                    messages=[ChatMessage("user", f"shared words here {tail}")])
            async for chunk in eng.generate(req):
                if chunk.usage:
                    usages.append(chunk.usage)
        return usages

    first, second = asyncio.run(go())
    assert first.cached_tokens == 0 and second.cached_tokens == 4


async def test_cancel_from_the_sdk(aiohttp_client, make_app, engine):
    from flowlift.proxy.state import STATE

    engine.delay_s = 0.2
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    base = str(client.make_url("")).rstrip("/")

    @step
    def slow(x):
        return f"a long answer please {x} " * 5

    wf = workflow("cancel-me", base_url=base)

    async def run():
        async with wf:
            slow(slow("x"))

    task = asyncio.create_task(run())
    while wf.run_id is None:
        await asyncio.sleep(0.01)
    assert await wf.acancel() is True
    with pytest.raises(WorkflowFailed, match="cancelled"):
        await task
    assert wf.status == "cancelled" and engine.aborted


class SlowStart(FakeEngine):
    load_s = 1.2

    async def start(self) -> None:
        await asyncio.sleep(self.load_s)  # the proxy answers 503 with Retry-After meanwhile
        await super().start()


class NeverReady(SlowStart):
    load_s = 60.0


async def test_a_workflow_sent_while_the_engine_loads_waits_for_it(aiohttp_client):
    from flowlift.proxy import create_app

    client = await aiohttp_client(create_app({"fake-model": SlowStart(["fake-model"])}))
    base = str(client.make_url("")).rstrip("/")
    async with workflow("early", base_url=base) as wf:
        label = classify(extract("sent before the engine was ready"))
    assert wf.status == "succeeded" and label.value in ("alpha", "beta")


async def test_a_proxy_that_keeps_refusing_the_graph_is_one_clear_error(aiohttp_client):
    from flowlift.proxy import create_app

    client = await aiohttp_client(create_app({"fake-model": NeverReady(["fake-model"])}))
    base = str(client.make_url("")).rstrip("/")
    with pytest.raises(ProxyUnavailable, match=r"answered 503 to the workflow for 0\.\d s: "
                                               "not ready: the engine is still loading"):
        async with workflow("refused", base_url=base, reconnect_s=0.3):
            extract("never runs")


@tool
async def gather(items: list, note: str):
    return {"kinds": [type(x).__name__ for x in items[0]], "labels": items[1], "note": note}


async def test_a_tool_gets_a_list_of_variables_as_a_list_of_values(client):
    base = str(client.make_url("")).rstrip("/")
    async with workflow("lists", base_url=base):
        facts = [extract("d1"), extract("d2")]
        labels = [classify(f) for f in facts]
        out = gather([facts, labels], note=f"{len(facts)} docs")
    assert out.value == {"kinds": ["Facts", "Facts"], "labels": ["alpha", "alpha"],
                         "note": "2 docs"}


async def test_several_replicas_the_graph_goes_to_the_first_that_takes_a_connection(client):
    """``base_url=[...]``: a replica that refuses the connection was sent nothing, so the
    graph goes to the next one; all of them refusing is one clear error."""
    from flowlift.errors import RequestError

    base = str(client.make_url("")).rstrip("/")

    @step
    def hello():
        return "hi"

    dead = "http://127.0.0.1:9"
    async with workflow("replicas", base_url=[dead, base + "/"]) as wf:
        out = hello()
    assert wf.status == "succeeded" and out.value == "echo: hi" and wf.base_url == base
    assert wf.base_urls == (dead, base)
    with pytest.raises(ProxyUnavailable):
        async with workflow("none", base_url=[dead, "http://127.0.0.1:7"]):
            hello()
    with pytest.raises(RequestError, match="base_url"):
        workflow("empty", base_url=[])
