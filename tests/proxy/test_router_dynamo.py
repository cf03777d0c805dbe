"""flowlift in front of NVIDIA Dynamo 1.6.1's frontend with two simulated (mocker)
workers on loopback (issue 37 item 4): with the ``dynamo`` and ``dynamo-session`` hints,
a session's turns stick to one worker and its cached tokens come back in the usage; a
workflow run's ``nvext.agent_hints`` are accepted, and its agent step's
``X-Dynamo-Parent-Session-ID`` (a header the 1.6.1 frontend reads). The workers simulate the default
model (its tokenizer); no GPU, no etcd, no NATS."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from flowlift.local_engine.models import ensure_default_model
from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse
from tests.routers import dynamo

SERVED = "smol"


async def _proxy(aiohttp_client: Any, frontend: str) -> Any:
    app = create_app({}, file_config=parse_config({
        "backends": {"dyn": {"kind": "openai", "base_url": f"{frontend}/v1",
                             "hints": ["dynamo", "dynamo-session"]}},
        "models": {SERVED: {"backends": ["dyn"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def test_sessions_stick_to_a_worker_and_their_cache_comes_back(
        aiohttp_client, tmp_path: Path):
    async with dynamo(ensure_default_model(), SERVED, 2, tmp_path / "store") as frontend:
        client = await _proxy(aiohttp_client, frontend)
        workers: dict[int, set[int]] = defaultdict(set)
        cached: dict[int, list[int]] = defaultdict(list)
        for s in range(6):
            convo = [{"role": "user", "content": f"session {s}: " + "lorem ipsum " * 60}]
            for _ in range(3):
                resp = await client.post("/v1/chat/completions", json={
                    "model": SERVED, "max_tokens": 8, "messages": convo,
                    "nvext": {"extra_fields": ["worker_id"]}},  # where it ran
                    headers={"X-Flowlift-Session": f"sess-{s}"})
                assert resp.status == 200, await resp.text()
                doc = await resp.json()
                workers[s].add(doc["nvext"]["worker_id"]["decode_worker_id"])
                cached[s].append(doc["usage"]["prompt_tokens_details"]["cached_tokens"])
                convo = [*convo, {"role": "assistant",
                                  "content": doc["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "go on " * 10}]
    assert all(len(w) == 1 for w in workers.values()), workers  # sticky
    assert all(c[0] == 0 and c[1] > 0 and c[2] >= c[1] for c in cached.values()), cached


async def test_a_runs_agent_hints_are_accepted(aiohttp_client, tmp_path: Path):
    async with dynamo(ensure_default_model(), SERVED, 2, tmp_path / "store") as frontend:
        client = await _proxy(aiohttp_client, frontend)

        def llm(step: str, content: list[dict[str, Any]]) -> dict[str, Any]:
            return {"kind": "llm", "id": step, "model": SERVED, "params": {"max_tokens": 8},
                    "messages": [{"role": "user", "content": content}]}
        scout = {**llm("scout", [{"text": "look around"}]),  # an agent step: a sub-agent
                 "tools": [{"name": "look",      # session with the run as its parent
                            "parameters": {"type": "object", "properties": {}}}]}
        resp = await client.post("/v1/workflows", json={"nodes": [
            llm("a", [{"text": "first"}]), scout,
            llm("b", [{"text": "then "}, {"ref": "a"}, {"ref": "scout"}])]})
        events = parse_sse(await resp.text())
    finished = next(d for e, d in events if e == "run.finished")
    assert finished["status"] == "succeeded", events
