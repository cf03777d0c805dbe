"""Model loads counted (issue 18 item 1): a workflow over two models in a memory budget
that fits one loads each model once when the residency manager follows the run's plan
and queue; request-level clients of the same proxy (the drop-in API, which loads on
demand) pay a load per switch. The counts are what ``/readyz`` and ``/metrics`` report.
Without the run's lookahead (its queued steps pinned: ``ResidencyManager.lookahead``
unset, or ``choose_evictions`` ignoring ``pinned``) the chain test swaps models between
the steps of a same-model chain; without the in-flight leases the two-stage test fails.

Each model is a stricter tests/proxy/test_residency_dispatch.py ``LoadedOnly`` fake: it checks
the budget at every load and fails a generation that finds its model unloaded at any
chunk (not just at the start), so a count of 2 cannot come from unloading a model under
its running requests."""

from __future__ import annotations

import asyncio
from typing import Any

from flowlift.errors import EngineError
from flowlift.local_engine.base import GenerationRequest
from flowlift.local_engine.residency import ManagedModel, ResidencyManager
from flowlift.proxy import create_app
from flowlift.proxy.config import ProxyConfig
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse
from tests.proxy.test_residency_dispatch import SIZE_MB, LoadedOnly


class LoadedThroughout(LoadedOnly):
    async def generate(self, request: GenerationRequest):  # type: ignore[override]
        async for chunk in super().generate(request):
            if not self.started:
                raise EngineError(f"{self.name} was unloaded under a running request")
            yield chunk


def _manager(names: str, slots: int, delay_s: float) -> ResidencyManager:
    ledger: dict[str, float] = {}
    budget = slots * SIZE_MB
    return ResidencyManager({n: ManagedModel(LoadedThroughout(n, ledger, budget, delay_s),
                                             SIZE_MB) for n in names}, budget, recheck_s=0.05)


def _two_stage(docs: int) -> dict[str, Any]:
    """Per document: ``read`` on model a, then ``label`` on model b reading its output."""
    nodes: list[dict[str, Any]] = []
    for i in range(docs):
        nodes.append({"id": f"read_{i}", "kind": "llm", "model": "a",
                      "params": {"max_tokens": 6, "temperature": 0},
                      "messages": [{"role": "user", "content": [
                          {"text": f"document {i}: " + "word " * (4 + i % 3)}]}]})
        nodes.append({"id": f"label_{i}", "kind": "llm", "model": "b",
                      "params": {"max_tokens": 3, "temperature": 0},
                      "messages": [{"role": "user", "content": [
                          {"text": "label this: "}, {"ref": f"read_{i}"}]}]})
    return {"name": "two-stage", "nodes": nodes}


async def _client(aiohttp_client, delay_s: float = 0.01):
    mgr = _manager("ab", slots=1, delay_s=delay_s)
    # 4 requests in flight per model: the 8 documents' reads cannot all go at once
    app = create_app(_engines(mgr), ProxyConfig(max_concurrency=4), residency=mgr)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client, mgr


def _engines(mgr):
    from flowlift.local_engine.resident import managed_engines

    return managed_engines(mgr)


async def _chat(client, model: str, text: str) -> None:
    resp = await client.post("/v1/chat/completions", json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]})
    assert resp.status == 200, await resp.text()


async def test_a_workflow_loads_each_model_once(aiohttp_client):
    client, mgr = await _client(aiohttp_client)
    resp = await client.post("/v1/workflows", json=_two_stage(8))
    done = next(d for e, d in parse_sse(await resp.text()) if e == "run.finished")
    assert done["status"] == "succeeded", done["failures"]
    assert mgr.loads == {"a": 1, "b": 1}  # a at boot, b once every read was done
    ready = await (await client.get("/readyz")).json()
    assert ready["residency"]["loads"] == {"a": 1, "b": 1}
    assert ready["residency"]["unloads"] == {"a": 1}
    metrics = await (await client.get("/metrics")).text()
    assert 'flowlift_model_loads_total{model="b"} 1.0' in metrics
    assert 'flowlift_model_unloads_total{model="a"} 1.0' in metrics


async def test_per_document_chains_through_the_drop_in_api_load_per_switch(aiohttp_client):
    client, mgr = await _client(aiohttp_client)
    for i in range(3):
        await _chat(client, "a", f"document {i}")
        await _chat(client, "b", f"label document {i}")
    assert mgr.loads == {"a": 3, "b": 3}
    assert mgr.unloads == {"a": 3, "b": 2}
    metrics = await (await client.get("/metrics")).text()
    assert 'flowlift_model_loads_total{model="a"} 3.0' in metrics


async def test_stage_by_stage_clients_load_each_model_once(aiohttp_client):
    client, mgr = await _client(aiohttp_client)
    await asyncio.gather(*(_chat(client, "a", f"document {i}") for i in range(4)))
    await asyncio.gather(*(_chat(client, "b", f"label {i}") for i in range(4)))
    assert mgr.loads == {"a": 1, "b": 1}


def _step(step_id: str, model: str, after: str | None = None) -> dict[str, Any]:
    content: list[dict[str, str]] = [{"text": f"step {step_id}: " + "word " * 4}]
    if after is not None:
        content.append({"ref": after})
    return {"id": step_id, "kind": "llm", "model": model,
            "params": {"max_tokens": 6, "temperature": 0},
            "messages": [{"role": "user", "content": content}]}


async def test_a_chain_on_one_model_keeps_it_loaded_beside_a_step_on_another(aiohttp_client):
    # a1 -> a2 -> a3 on model a, and b1 on b ready from the start: b1 waits while a's
    # chain runs (its next step is queued as the one before it ends, and a queued step's
    # model is pinned), so each model loads once; a manager deciding per request swaps
    # to b between a-steps and back (5 or more loads)
    client, mgr = await _client(aiohttp_client)
    graph = {"name": "chain", "nodes": [_step("a1", "a"), _step("a2", "a", "a1"),
                                        _step("a3", "a", "a2"), _step("b1", "b")]}
    resp = await client.post("/v1/workflows", json=graph)
    done = next(d for e, d in parse_sse(await resp.text()) if e == "run.finished")
    assert done["status"] == "succeeded", done["failures"]
    assert mgr.events == [("load", "a"), ("unload", "a"), ("load", "b")]

