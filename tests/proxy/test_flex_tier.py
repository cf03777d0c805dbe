"""The flex tier (flowlift.proxy.dispatch.batch.flex): service_tier on the wire for flex and
priority backends, the tier an answer was served at, and what a capacity 429 does."""

from __future__ import annotations

import contextlib
from typing import Any

from flowlift.local_engine.base import ChatMessage, GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.config import UpstreamSpec, parse_config
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.batch.flex import after_capacity_429, cost, served_tier, tier_fields
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.dispatch.steps import StepDispatcher
from flowlift.proxy.state import STATE
from flowlift.tiers import TierProfile
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes


def spec(**kw: Any) -> UpstreamSpec:
    return UpstreamSpec(kind="openai", base_url="http://up.example/v1", **kw)


def test_tier_fields_never_override_the_clients_own_service_tier() -> None:
    assert tier_fields(spec(tier="flex"), {}) == {"service_tier": "flex"}
    assert tier_fields(spec(tier="flex"), {"service_tier": "default"}) == {}
    assert tier_fields(spec(), {}) == {}
    assert tier_fields(spec(), {}, deferred=True) == {}  # this backend offers no flex
    assert tier_fields(spec(offers_flex=True), {}, deferred=True) == {"service_tier": "flex"}
    assert tier_fields(spec(tier="priority"), {}) == {"service_tier": "priority"}


def test_cost_is_accounted_at_the_tier_the_answer_says_served_it() -> None:
    tiers = {"flex": TierProfile("flex", 0.5, 2.0), "standard": TierProfile("standard", 1, 4)}
    assert served_tier({"service_tier": "flex"}, "flex") == "flex"
    assert served_tier({"service_tier": "default"}, "flex") == "standard"
    assert served_tier({}, "flex") == "flex"
    assert cost(1000, 1000, served_tier({"service_tier": "default"}, "flex"), tiers) == 5.0
    assert cost(1000, 1000, "flex", tiers) == 2.5
    assert cost(1000, 1000, "batch", tiers) is None


def test_a_capacity_429_backs_off_only_while_the_slack_allows() -> None:
    assert after_capacity_429(slack_s=600, fast_s=60, retry_after_s=30) == "backoff"
    assert after_capacity_429(slack_s=80, fast_s=60, retry_after_s=30) == "standard"
    assert after_capacity_429(slack_s=85, fast_s=60, retry_after_s=None,
                              default_wait_s=30) == "standard"


async def test_a_flex_backend_gets_service_tier_flex_on_chat_but_not_on_embeddings(
        aiohttp_client: Any, aiohttp_server: Any) -> None:
    fake = FakeUpstream([FakeUpstream.json(chat_json(service_tier="flex"))])
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    app = create_app({}, file_config=parse_config({
        "backends": {"f": {"kind": "openai", "base_url": url, "tier": "flex"}},
        "models": {"up": {"backends": ["f"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    r = await client.post("/v1/chat/completions", json={
        "model": "up", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200
    assert fake.received[-1].json()["service_tier"] == "flex"
    await client.post("/v1/embeddings", json={"model": "up", "input": "hi"})
    assert "service_tier" not in fake.received[-1].json()


async def test_a_step_planned_on_flex_asks_flex_of_a_backend_that_offers_it(
        aiohttp_server: Any) -> None:
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(
        chunk({"role": "assistant", "content": "ok"}), chunk(finish="stop")))])
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    backends = Backends({}, config=parse_config({
        "backends": {"s": {"kind": "openai", "base_url": url, "offers_flex": True}},
        "models": {"up": {"backends": ["s"]}}}))
    dispatcher = StepDispatcher(backends)
    for tier, expected in (("flex", "flex"), (None, None)):
        request = GenerationRequest(f"r:s:{tier}", "up", [ChatMessage("user", "hi")],
                                    service_tier=tier)
        text = ""
        async with contextlib.aclosing(dispatcher.generate(
                request, priority=Priority("batch", 0.0, 0.0))) as chunks:
            async for c in chunks:
                text += c.text
        assert text == "ok"
        assert fake.received[-1].json().get("service_tier") == expected
    await backends.aclose()
