"""Agent sessions (case W5): the bounded session table, its per-turn accounting and
``GET /v1/sessions/{id}``, on the FakeEngine."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flowlift.local_engine.base import GenerationChunk, GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.sessions.api import setup
from flowlift.proxy.sessions.table import SESSIONS, SessionTable
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class AnswerCachingEngine(FakeEngine):
    """FakeEngine whose simulated prefix cache also keeps the generated answer, as
    vLLM keeps the KV blocks of decoded tokens: a later prompt that repeats the prompt
    and the answer (``assistant: <answer>``) hits both."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        text = ""
        async for chunk in super().generate(request):
            text += chunk.text
            yield chunk
        words = " ".join(f"{m.role}: {m.content}" for m in request.messages).split()
        self._seen[(*words, "assistant:", *text.split())] = None


# -- the table ---------------------------------------------------------------------------

def test_table_is_bounded_with_unique_session_ids() -> None:
    table = SessionTable(max_sessions=50, ttl_s=60)
    for i in range(1000):
        table.record(f"s{i}", usage(10, 2, 0), "engine-0")
    assert len(table) == 50
    assert "s999" in table and "s0" not in table


def test_turns_per_session_are_bounded_but_totals_count_all() -> None:
    table = SessionTable(max_turns=3)
    for n in range(10):
        table.record("s", usage(100 + n, 5, 90), "engine-0")
    session = table.get("s")
    assert session is not None
    body = session.to_json()
    assert [t["turn"] for t in body["turns"]] == [8, 9, 10]
    assert body["turn_count"] == 10 and body["cached_tokens"] == 900
    assert body["turns"][0]["previous_answer_cached_tokens"] is None


def test_sessions_expire_after_ttl_without_a_turn() -> None:
    clock = Clock()
    table = SessionTable(ttl_s=30, timer=clock)
    table.record("old", usage(10, 2, 0))
    table.record("busy", usage(10, 2, 0))
    clock.now += 20
    table.record("busy", usage(12, 2, 0))  # a turn restarts the TTL
    clock.now += 15
    assert table.get("old") is None
    assert table.get("busy") is not None and len(table) == 1
    clock.now += 31
    assert len(table) == 0


def test_per_turn_accounting() -> None:
    table = SessionTable()
    table.record("s", usage(300, 20, 0), "engine-0")
    table.record("s", usage(350, 10, 256), "engine-0")
    table.record("s", usage(400, 10, 384), "engine-0")
    body = table.get("s").to_json()  # type: ignore[union-attr]
    first, second, third = body["turns"]
    assert first["reusable_tokens"] == 0 and first["reuse_ratio"] is None
    assert second["reusable_tokens"] == 320 and second["reuse_ratio"] == 0.8
    assert second["previous_answer_cached_tokens"] == 0  # 256 < the 300-token prompt
    assert third["reusable_tokens"] == 360
    assert third["previous_answer_cached_tokens"] == 10  # all of turn 2's answer
    assert body["reusable_tokens"] == 680 and body["cached_tokens"] == 640
    assert body["backend"] == "engine-0"


def test_bad_bounds_are_rejected() -> None:
    with pytest.raises(ValueError):
        SessionTable(max_sessions=0)


# -- through the proxy -------------------------------------------------------------------

async def _session_client(aiohttp_client, engine: FakeEngine):  # type: ignore[no-untyped-def]
    app = create_app({"fake-model": engine})
    setup(app, SessionTable(max_sessions=8, ttl_s=60))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def _agent_turns(client, session: str, turns: int, *,  # type: ignore[no-untyped-def]
                       stream: bool = False) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": "You are an agent with a shell tool."},
                {"role": "user", "content": "List the files."}]
    usages = []
    for n in range(turns):
        body: dict[str, Any] = {"model": "fake-model", "messages": messages, "max_tokens": 16}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        r = await client.post("/v1/chat/completions", json=body,
                              headers={"X-Flowlift-Session": session})
        assert r.status == 200
        if stream:
            chunks = [d for _, d in parse_sse(await r.text()) if isinstance(d, dict)]
            answer = "".join(c["delta"].get("content") or ""
                             for chunk in chunks for c in chunk["choices"])
            got = next(c["usage"] for c in chunks if c.get("usage"))
        else:
            data = await r.json()
            answer, got = data["choices"][0]["message"]["content"], data["usage"]
        usages.append(got)
        messages = [*messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"Tool result {n}: a.py b.py c.py"}]
    return usages


@pytest.mark.parametrize("stream", [False, True])
async def test_w5_multi_turn_reuse_covers_the_previous_answer(aiohttp_client,
                                                              stream: bool) -> None:
    """Case W5: turn N+1 repeats turn N's prompt plus the answer; the cached prefix
    reported in usage covers the answer's tokens too, and the session route shows it."""
    client = await _session_client(aiohttp_client, AnswerCachingEngine(["fake-model"]))
    usages = await _agent_turns(client, "agent-1", 4, stream=stream)
    r = await client.get("/v1/sessions/agent-1")
    assert r.status == 200
    body = await r.json()
    assert body["turn_count"] == 4 and body["backend"] == "engine-0"
    turns = body["turns"]
    assert [t["prompt_tokens"] for t in turns] == [u["prompt_tokens"] for u in usages]
    for prev, turn in itertools.pairwise(turns):
        assert turn["reusable_tokens"] == prev["prompt_tokens"] + prev["completion_tokens"]
        assert turn["previous_answer_cached_tokens"] == prev["completion_tokens"] > 0
        assert turn["reuse_ratio"] == 1.0
    assert body["reuse_ratio"] == 1.0


async def test_w5_detects_an_engine_that_does_not_reuse_the_answer(aiohttp_client) -> None:
    """The plain FakeEngine caches prompts only: the session route must show the answer
    as not reused (the W5 check can fail)."""
    client = await _session_client(aiohttp_client, FakeEngine(["fake-model"]))
    await _agent_turns(client, "agent-2", 3)
    body = await (await client.get("/v1/sessions/agent-2")).json()
    later = body["turns"][1:]
    assert all(t["previous_answer_cached_tokens"] == 0 for t in later)
    assert all(t["reuse_ratio"] < 1.0 for t in later)


async def test_requests_without_a_session_header_record_nothing(aiohttp_client) -> None:
    client = await _session_client(aiohttp_client, FakeEngine(["fake-model"]))
    r = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200
    assert len(client.app[SESSIONS]) == 0


async def test_unknown_session_is_404(aiohttp_client) -> None:
    client = await _session_client(aiohttp_client, FakeEngine(["fake-model"]))
    r = await client.get("/v1/sessions/nope")
    assert r.status == 404
    err = (await r.json())["error"]
    assert err["code"] == "session_not_found" and err["param"] == "session_id"
    ttl = client.app[SESSIONS].ttl_s  # the table is empty (falsy) but it has a TTL
    assert f"expire after {ttl:.0f} s" in err["message"] and ttl > 0


async def test_session_table_stays_bounded_through_the_proxy(aiohttp_client) -> None:
    client = await _session_client(aiohttp_client, FakeEngine(["fake-model"]))
    for i in range(20):
        r = await client.post("/v1/chat/completions", json={
            "model": "fake-model", "messages": [{"role": "user", "content": f"hi {i}"}]},
            headers={"X-Flowlift-Session": f"unique-{i}"})
        assert r.status == 200
    assert len(client.app[SESSIONS]) == 8
    assert (await client.get("/v1/sessions/unique-19")).status == 200
    assert (await client.get("/v1/sessions/unique-0")).status == 404


async def test_app_without_a_session_table_still_answers(aiohttp_client) -> None:
    app = create_app({"fake-model": FakeEngine(["fake-model"])})
    app.pop(SESSIONS, None)  # e.g. an app built without sessions_api.setup
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    r = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Flowlift-Session": "s"})
    assert r.status == 200


async def test_create_app_records_sessions_by_default(aiohttp_client) -> None:
    app = create_app({"fake-model": FakeEngine(["fake-model"])})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    await _agent_turns(client, "default-table", 2)
    body = await (await client.get("/v1/sessions/default-table")).json()
    assert body["turn_count"] == 2 and body["turns"][1]["reusable_tokens"] > 0
