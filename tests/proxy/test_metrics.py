"""``GET /metrics``: Prometheus' text format, parsed with prometheus_client's own parser,
after real runs on a FakeEngine."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse
from flowlift.tracing import AttemptTrace
from flowlift.tracing.metrics import Metrics

PREAMBLE = "You are a careful assistant. " * 6


def llm(node_id, text, **extra):
    return {"kind": "llm", "id": node_id,
            "messages": [{"role": "user", "content": [{"text": text}]}], **extra}


async def scrape(client) -> dict[str, dict[tuple, float]]:
    """Metric samples by name, then by sorted label items."""
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(await resp.text()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


@pytest.fixture
async def proxy(aiohttp_client):
    async def make(engine: FakeEngine, config: ProxyConfig | None = None):
        app = create_app({"fake-model": engine}, config)
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        return client
    return make


async def test_metrics_after_a_workflow_and_openai_requests(proxy):
    client = await proxy(FakeEngine(["fake-model"]))
    graph = {"name": "m", "nodes": [llm(f"s{i}", f"{PREAMBLE} item {i} please") for i in range(4)]}
    resp = await client.post("/v1/workflows", json=graph)
    trace = next(d for e, d in parse_sse(await resp.text()) if e == "run.finished")["trace"]
    steps = [r for r in trace if r["type"] == "step"]
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "one two three"}]}
    assert (await client.post("/v1/chat/completions", json=chat)).status == 200
    got = await scrape(client)
    wf = (("model", "fake-model"), ("source", "workflow"))
    assert got["gen_ai_server_time_to_first_token_seconds_count"][wf] == 4
    oa = (("model", "fake-model"), ("source", "openai"))
    assert got["gen_ai_server_time_to_first_token_seconds_count"][oa] == 1
    assert got["gen_ai_server_time_per_output_token_seconds_count"][wf] == sum(
        r["completion_tokens"] > 1 for r in steps)
    assert got["flowlift_queue_wait_seconds_count"][(("model", "fake-model"),)] == 4
    prompt = sum(r["prompt_tokens"] for r in steps) + 4  # the chat prompt: 4 words
    cached = sum(r["cached_tokens"] for r in steps)
    assert cached > 0  # the shared preamble hit the (fake) prefix cache
    key = (("model", "fake-model"),)
    assert got["flowlift_prompt_tokens_total"][key] == prompt
    assert got["flowlift_cached_prompt_tokens_total"][key] >= cached
    ratio = got["flowlift_prefix_cache_hit_ratio"][key]
    assert ratio == pytest.approx(got["flowlift_cached_prompt_tokens_total"][key] / prompt)
    assert got["flowlift_workflows_total"][(("status", "succeeded"),)] == 1
    assert got["flowlift_active_workflows"][()] == 0
    assert got["flowlift_openai_requests_total"][(("operation", "chat"),
                                                  ("outcome", "complete"))] == 1
    assert got["flowlift_queue_depth"][(("backend", "engine-0"), ("class", "batch"))] == 0


async def test_queue_depth_and_active_workflows_are_live(proxy):
    engine = FakeEngine(["fake-model"], delay_s=0.05)
    client = await proxy(engine, ProxyConfig(max_concurrency=2))
    graph = {"name": "q", "workflow_class": "batch",
             "nodes": [llm(f"s{i}", f"distinct {i}") for i in range(6)]}
    run = asyncio.create_task(client.post("/v1/workflows", json=graph))
    deadline = time.monotonic() + 3
    while True:
        got = await scrape(client)
        depth = got["flowlift_queue_depth"][(("backend", "engine-0"), ("class", "batch"))]
        if depth >= 3:
            break
        assert time.monotonic() < deadline, "never saw the batch steps queued"
        await asyncio.sleep(0.01)
    assert got["flowlift_active_workflows"][()] == 1
    await (await run).text()
    got = await scrape(client)
    assert got["flowlift_active_workflows"][()] == 0
    assert got["flowlift_queue_depth"][(("backend", "engine-0"), ("class", "batch"))] == 0


async def test_deadline_misses_are_counted(proxy):
    client = await proxy(FakeEngine(["fake-model"], delay_s=0.05))
    graph = {"name": "late", "deadline_s": 0.05, "nodes": [
        llm("slow", " ".join(["word"] * 40), params={"max_tokens": 40})]}
    await (await client.post("/v1/workflows", json=graph)).text()
    got = await scrape(client)
    assert got["flowlift_deadline_misses_total"][(("workflow_class", "interactive"),)] == 1
    assert got["flowlift_workflows_total"][(("status", "failed"),)] == 1


async def test_each_app_has_its_own_registry(proxy):
    a = await proxy(FakeEngine(["fake-model"]))
    b = await proxy(FakeEngine(["fake-model"]))
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    await (await a.post("/v1/chat/completions", json=chat)).read()
    assert (await scrape(a))["flowlift_openai_requests_total"]
    assert "flowlift_openai_requests_total" not in await scrape(b)


async def test_metrics_need_no_key_and_no_loaded_engine(aiohttp_client):
    config = ProxyConfig(api_keys=frozenset({"sk-proxy"}))
    app = create_app({"fake-model": FakeEngine(["fake-model"])}, config)
    client = await aiohttp_client(app)
    assert (await client.get("/metrics")).status == 200  # scrapers carry no key
    assert (await client.get("/v1/workflows/x")).status == 401


def test_retries_and_cascade_escalations_come_from_the_attempts():
    metrics = Metrics()
    metrics.record_attempts([AttemptTrace(1, "small", 0.0, outcome="contract_failed"),
                             AttemptTrace(2, "small", 5.0, outcome="contract_failed"),
                             AttemptTrace(3, "large", 9.0, outcome="ok")])
    metrics.cascade_escalated("large", "xl")
    got = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    retries = "flowlift_step_retries_total"
    assert got[(retries, (("model", "small"), ("reason", "contract_failed")))] == 1
    assert (retries, (("model", "large"), ("reason", "contract_failed"))) not in got  # escalated
    esc = "flowlift_cascade_escalations_total"
    assert got[(esc, (("from_model", "small"), ("to_model", "large")))] == 1
    assert got[(esc, (("from_model", "large"), ("to_model", "xl")))] == 1
