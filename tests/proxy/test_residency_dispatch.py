"""Residency wired into dispatch: several models in one memory budget behind the proxy.

Each model is a FakeEngine that refuses to generate unless loaded and checks, when it
loads, that the loaded models fit the budget; the proxy serves them through
ResidentEngine, so workflow steps and OpenAI requests load what they need on the way.
"""

from __future__ import annotations

import asyncio

import pytest

from flowlift.errors import EngineError
from flowlift.local_engine.base import GenerationRequest
from flowlift.local_engine.residency import ManagedModel, ResidencyManager
from flowlift.local_engine.resident import managed_engines
from flowlift.proxy import create_app
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse

SIZE_MB = 400.0


class LoadedOnly(FakeEngine):
    """A model that must be loaded to generate, sharing one ledger of loaded models."""

    def __init__(self, name: str, ledger: dict[str, float], budget_mb: float,
                 delay_s: float = 0.0) -> None:
        super().__init__([name], delay_s=delay_s)
        self.name, self.ledger, self.budget_mb = name, ledger, budget_mb

    async def start(self) -> None:
        self.ledger[self.name] = SIZE_MB
        assert sum(self.ledger.values()) <= self.budget_mb, f"over budget: {self.ledger}"
        await super().start()

    async def close(self) -> None:
        self.ledger.pop(self.name, None)
        await super().close()

    async def generate(self, request: GenerationRequest):  # type: ignore[override]
        if not self.started:
            raise EngineError(f"{self.name} is not loaded")
        async for chunk in super().generate(request):
            yield chunk


def _manager(names: str, slots: int, delay_s: float = 0.0) -> ResidencyManager:
    ledger: dict[str, float] = {}
    budget = slots * SIZE_MB
    return ResidencyManager({n: ManagedModel(LoadedOnly(n, ledger, budget, delay_s), SIZE_MB)
                             for n in names}, budget, recheck_s=0.05)


def _chain(*models: str) -> dict:
    nodes = [{"id": "s0", "kind": "llm", "model": models[0],
              "messages": [{"role": "user", "content": [{"text": "start here"}]}],
              "params": {"max_tokens": 4}}]
    for i, model in enumerate(models[1:], 1):
        nodes.append({"id": f"s{i}", "kind": "llm", "model": model, "params": {"max_tokens": 4},
                      "messages": [{"role": "user", "content": [
                          {"text": "continue from "}, {"ref": f"s{i - 1}"}]}]})
    return {"name": "models", "nodes": nodes}


async def _proxy(aiohttp_client, manager: ResidencyManager):
    app = create_app(managed_engines(manager), residency=manager)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def _run(client, graph: dict) -> dict:
    resp = await client.post("/v1/workflows", json=graph)
    assert resp.status == 200, await resp.text()
    events = parse_sse(await resp.text())
    return next(d for e, d in events if e == "run.finished")


async def test_a_workflow_over_more_models_than_fit_loads_each_on_the_way(aiohttp_client):
    mgr = _manager("ab", slots=1)
    client = await _proxy(aiohttp_client, mgr)
    assert mgr.resident == ["a"]  # boot loads what fits without unloading anything
    done = await _run(client, _chain("a", "b", "a", "b"))
    assert done["status"] == "succeeded", done["failures"]
    assert mgr.events == [("load", "a"), ("unload", "a"), ("load", "b"), ("unload", "b"),
                          ("load", "a"), ("unload", "a"), ("load", "b")]
    ready = await (await client.get("/readyz")).json()
    assert ready["residency"] == {"budget_mb": 400.0, "resident": ["b"], "managed": ["a", "b"],
                                  "loads": {"a": 2, "b": 2}, "unloads": {"a": 2, "b": 1}}


async def test_eviction_follows_the_compiled_plan_not_recency(aiohttp_client):
    # budget for two of three; a -> b -> c -> a: when c loads, a (used first, so LRU's
    # victim) is needed again by the plan and b is not, so b goes.
    mgr = _manager("abc", slots=2)
    client = await _proxy(aiohttp_client, mgr)
    assert mgr.resident == ["a", "b"]
    done = await _run(client, _chain("a", "b", "c", "a"))
    assert done["status"] == "succeeded", done["failures"]
    assert mgr.events[2:] == [("unload", "b"), ("load", "c")]
    assert sorted(mgr.resident) == ["a", "c"]


async def test_a_model_in_use_is_not_unloaded_the_other_waits(aiohttp_client):
    mgr = _manager("ab", slots=1, delay_s=0.02)
    client = await _proxy(aiohttp_client, mgr)
    long = {"name": "long", "nodes": [{"id": "x", "kind": "llm", "model": "a",
                                       "params": {"max_tokens": 30},
                                       "messages": [{"role": "user", "content": [
                                           {"text": " ".join(["word"] * 30)}]}]}]}
    first = asyncio.create_task(_run(client, long))
    await asyncio.sleep(0.1)  # "a" is generating
    second = await client.post("/v1/chat/completions", json={
        "model": "b", "messages": [{"role": "user", "content": "hello there"}]})
    assert second.status == 200, await second.text()
    done = await first
    assert done["status"] == "succeeded", done["failures"]
    a = mgr.models["a"].engine
    assert a.aborted == []  # type: ignore[attr-defined]
    # "b" loaded only after "a"'s request ended (the long step finished first)
    assert mgr.events == [("load", "a"), ("unload", "a"), ("load", "b")]
    step = done["trace"][1]
    assert step["completion_tokens"] == 30


async def test_the_openai_api_loads_a_managed_model_too(aiohttp_client):
    mgr = _manager("ab", slots=1)
    client = await _proxy(aiohttp_client, mgr)
    resp = await client.post("/v1/chat/completions", json={
        "model": "b", "stream": True, "messages": [{"role": "user", "content": "hi you"}]})
    assert resp.status == 200
    assert any(d == "[DONE]" for _, d in parse_sse(await resp.text()))
    assert mgr.resident == ["b"]


async def test_a_model_bigger_than_the_budget_fails_at_once():
    ledger: dict[str, float] = {}
    mgr = ResidencyManager({"a": ManagedModel(LoadedOnly("a", ledger, 1e9), 2_000.0)}, 1_000.0)
    with pytest.raises(EngineError, match="budget"):
        await mgr.ensure("a")


async def test_waiting_for_room_is_bounded():
    mgr = _manager("ab", slots=1)
    mgr.max_wait_s = 0.2
    async with mgr.use("a"):
        with pytest.raises(EngineError, match="does not fit"):
            await mgr.ensure("b")
