"""flowlift in front of a real vllm-router 0.1.17 (the PyPI wheel) on loopback, the
router in front of two fake upstreams (issue 37 item 4): sessions stick to one
upstream, and the program fields flowlift writes (``vllm-session``,
``vllm-router-program``) arrive there and are accepted by the router's program
scheduling (it refuses a malformed context, so a 200 is an acceptance); an agent step
is a sub-agent program whose parent is its run."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import aiohttp
import pytest

from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse
from tests.routers import require, vllm_router
from tests.upstream_fake import FakeUpstream, chat_answer

HINTS = ["vllm-session", "vllm-router-program"]


async def _fleet(aiohttp_server: Any) -> tuple[list[FakeUpstream], list[str]]:
    fakes = [FakeUpstream([chat_answer(f"up{i}")]) for i in range(2)]
    roots = [str((await aiohttp_server(f.app())).make_url("")).rstrip("/") for f in fakes]
    return fakes, roots


async def _proxy(aiohttp_client: Any, router: str) -> Any:
    app = create_app({}, file_config=parse_config({
        "backends": {"fleet": {"kind": "openai", "base_url": f"{router}/v1",
                               "hints": HINTS}},
        "models": {"m": {"backends": ["fleet"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


def _llm(step: str, content: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"kind": "llm", "id": step, "model": "m", "params": {"max_tokens": 16},
            "messages": [{"role": "user", "content": content}], **extra}


async def _run(client: Any, router: str, graph: dict[str, Any]
               ) -> tuple[str, list[dict[str, Any]]]:
    """Run ``graph`` to success; its run id and the router's programs after it."""
    resp = await client.post("/v1/workflows", json=graph)
    events = parse_sse(await resp.text())
    finished = next(d for e, d in events if e == "run.finished")
    assert finished["status"] == "succeeded", events
    async with aiohttp.ClientSession() as http, http.get(
            f"{router}/scheduling/diagnostics") as diag:
        programs = [p for rank in (await diag.json())["ranks"] for p in rank["programs"]]
    return finished["run_id"], programs


def _chats(fakes: list[FakeUpstream]) -> list[tuple[int, dict[str, str], dict[str, Any]]]:
    return [(i, {k.lower(): v for k, v in r.headers.items()}, r.json())
            for i, f in enumerate(fakes) for r in f.received
            if r.path.endswith("/chat/completions")]


async def test_sessions_stick_and_the_program_fields_arrive(aiohttp_client, aiohttp_server):
    fakes, roots = await _fleet(aiohttp_server)
    async with vllm_router(roots) as router:
        client = await _proxy(aiohttp_client, router)
        for turn in range(3):
            for s in range(8):
                resp = await client.post("/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}]},
                    headers={"X-Flowlift-Session": f"sess-{s}"})
                assert resp.status == 200, await resp.text()
    where: dict[str, set[int]] = defaultdict(set)
    steps: dict[str, list[int]] = defaultdict(list)
    for upstream, headers, body in _chats(fakes):
        session = headers["x-session-id"]
        where[session].add(upstream)
        assert body["session_id"] == session  # vLLM's own field, through the router
        context = json.loads(body["vllm_xargs"]["agentic_context"])
        assert context["program_id"] == session
        steps[session].append(context["step_id"])
    assert sorted(where) == [f"sess-{s}" for s in range(8)]
    assert all(len(upstreams) == 1 for upstreams in where.values()), where  # sticky
    assert all(s == [0, 1, 2] for s in steps.values())


async def test_a_runs_program_is_scheduled_by_the_router(aiohttp_client, aiohttp_server):
    fakes, roots = await _fleet(aiohttp_server)
    async with vllm_router(roots) as router:
        client = await _proxy(aiohttp_client, router)
        run_id, programs = await _run(client, router, {
            "workflow_class": "interactive", "deadline_s": 300, "nodes": [
                _llm("a", [{"text": "first"}]), _llm("b", [{"text": "then "}, {"ref": "a"}])]})
    sent = _chats(fakes)
    assert len(sent) == 2 and len({u for u, _, _ in sent}) == 1  # one replica for the run
    contexts = [json.loads(b["vllm_xargs"]["agentic_context"]) for _, _, b in sent]
    assert [c["step_id"] for c in contexts] == [0, 1]
    assert all(c["program_id"] == run_id and c["expected_output_length"] == 16
               and 0 < c["deadline_seconds"] <= 300 for c in contexts)
    # the router knows the run as one program, at its last step, placed where it ran
    [program] = [p for p in programs if p["session_id"] == run_id]
    assert program["step_id"] == 1
    assert program["home_target"] == roots[sent[0][0]]


async def test_the_router_refuses_a_malformed_context_the_clients_own_wins(
        aiohttp_client, aiohttp_server):
    fakes, roots = await _fleet(aiohttp_server)
    async with vllm_router(roots) as router:
        client = await _proxy(aiohttp_client, router)
        resp = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "vllm_xargs": {"agentic_context": json.dumps({"program_id": "p", "step_id": -1})}},
            headers={"X-Flowlift-Session": "sess-x"})
        # the router parsed it and refused it (a plain-text 400, which flowlift passes on
        # as a 502 naming the status): a 200 to flowlift's own context is an acceptance
        assert resp.status == 502
        assert "HTTP 400" in (await resp.json())["error"]["message"]
    assert _chats(fakes) == []


def test_a_missing_router_fails_under_the_require_rule(monkeypatch):
    monkeypatch.setenv("FLOWLIFT_REQUIRE_ROUTERS", "1")
    with pytest.raises(pytest.fail.Exception, match="FLOWLIFT_REQUIRE_ROUTERS=1"):
        require("no_such_router_module", "no-such-router")
    monkeypatch.delenv("FLOWLIFT_REQUIRE_ROUTERS")
    with pytest.raises(pytest.skip.Exception):
        require("no_such_router_module", "no-such-router")
    require("vllm_router_rs", "vllm-router")  # installed by the test extra: no skip


async def test_a_runs_agent_step_is_a_sub_agent_program_of_the_run(
        aiohttp_client, aiohttp_server):
    fakes, roots = await _fleet(aiohttp_server)
    async with vllm_router(roots) as router:
        client = await _proxy(aiohttp_client, router)
        run_id, programs = await _run(client, router, {"nodes": [  # the router accepts both
            _llm("scout", [{"text": "look around"}], tools=[
                {"name": "look", "parameters": {"type": "object", "properties": {}}}]),
            _llm("sum", [{"text": "sum up "}, {"ref": "scout"}])]})
    sent = _chats(fakes)
    assert len(sent) == 2 and len({u for u, _, _ in sent}) == 1  # placed with its run
    # the router knows the agent step as a sub-agent program whose parent is the run
    mine = {p["agent_role"]: p for p in programs if p["task_id"] == run_id}
    assert set(mine) == {"lead", "subagent"}, programs
    sub = mine["subagent"]
    assert (sub["agent_id"], sub["parent_program_id"], sub["blocks_parent"]) == (
        "scout", run_id, False)
    assert mine["lead"]["parent_program_id"] is None
    assert sub["home_target"] == mine["lead"]["home_target"] == roots[sent[0][0]]
