"""Routing (affinity, least-loaded, fallbacks), Retry-After parsing, cool-down, the
config file, and workflow steps on upstream models."""

from __future__ import annotations

import json
import time
from collections import Counter
from email.utils import formatdate

import pytest

from flowlift.errors import ConfigError, RequestError
from flowlift.proxy import create_app
from flowlift.proxy.config import load_config, parse_config
from flowlift.proxy.dispatch.routing.routing import Route, pick
from flowlift.proxy.dispatch.upstream.provider import Health, forwarded_headers, retry_after_s
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse
from tests.upstream_fake import FakeUpstream, chunk, sse_bytes, upstream_only_proxy

ROUTE = Route("m", ("r1", "r2", "r3"), ("fb1", "fb2"))


def route_pick(available=lambda n: True, load=lambda n: 0, **kw):
    return pick(ROUTE, available=available, load=load, **kw)


def test_affinity_is_stable_and_spreads_keys():
    chosen = {f"wf-{i}": route_pick(affinity=f"wf-{i}") for i in range(300)}
    assert chosen == {k: route_pick(affinity=k) for k in chosen}  # same key, same replica
    spread = Counter(chosen.values())
    assert set(spread) == {"r1", "r2", "r3"} and min(spread.values()) > 60


def test_affinity_moves_only_the_keys_of_a_replica_that_goes_away():
    before = {f"wf-{i}": route_pick(affinity=f"wf-{i}") for i in range(300)}
    after = {k: route_pick(affinity=k, available=lambda n: n != "r2") for k in before}
    for key, replica in before.items():
        if replica != "r2":
            assert after[key] == replica
        else:
            assert after[key] in ("r1", "r3")


def test_least_loaded_without_affinity():
    loads = {"r1": 5, "r2": 1, "r3": 3}
    assert route_pick(load=loads.__getitem__) == "r2"


def test_fallbacks_in_order_then_none():
    assert route_pick(available=lambda n: n.startswith("fb")) == "fb1"
    assert route_pick(available=lambda n: n == "fb2") == "fb2"
    assert route_pick(available=lambda n: False) is None


def test_tried_backends_are_avoided_while_others_are_available():
    assert route_pick(tried={"r1", "r2", "r3"}) == "fb1"
    only = Route("m", ("a",))
    assert pick(only, available=lambda n: True, load=lambda n: 0, tried={"a"}) == "a"


@pytest.mark.parametrize("headers,expected", [
    ({"retry-after": "2"}, 2.0), ({"retry-after": "0.5"}, 0.5),
    ({"retry-after-ms": "1500"}, 1.5), ({"retry-after": "soon"}, None), ({}, None),
    ({"retry-after": "-3"}, 0.0), ({"retry-after": "nan"}, None)])
def test_retry_after_values(headers, expected):
    assert retry_after_s(headers) == expected


def test_retry_after_http_date():
    now = time.time()
    assert 9 <= retry_after_s({"retry-after": formatdate(now + 10, usegmt=True)}, now=now) <= 10
    assert retry_after_s({"retry-after": formatdate(now - 10, usegmt=True)}, now=now) == 0.0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_health_cools_after_failures_of_distinct_requests_in_a_row_and_a_success_resets():
    clock = Clock()
    h = Health(failures_to_cool=2, cooldown_s=10, clock=clock)
    h.call(1).failed("down")
    assert h.available(clock.t)
    h.call(2).succeeded()
    h.call(3).failed("down")
    assert h.available(clock.t)
    h.call(3).failed("down")  # the same request again: counted once
    assert h.available(clock.t)
    clock.t = 102.0
    h.call(4).failed("down")
    assert not h.available(105.0) and h.available(112.0)


def test_a_429_with_retry_after_cools_at_once_for_that_long():
    clock = Clock()
    clock.t = 0.0
    h = Health(failures_to_cool=5, cooldown_s=30, clock=clock)
    h.call().failed("busy", retry_after_s=4)
    assert not h.available(3.9) and h.available(4.0)


def test_forwarded_headers_keep_trace_context_only():
    out = forwarded_headers({"traceparent": "00-abc-def-01", "authorization": "Bearer x",
                             "x-api-key": "k", "tracestate": "a=b", "cookie": "c"})
    assert out == {"traceparent": "00-abc-def-01", "tracestate": "a=b"}
    with pytest.raises(RequestError) as err:
        forwarded_headers({"traceparent": "caf\u00e9"})
    assert err.value.param == "header:traceparent"


def test_config_errors_name_every_field(tmp_path, monkeypatch):
    monkeypatch.delenv("MISSING_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        parse_config({"backends": {"a": {"kind": "openai", "base_url": "ftp://x",
                                         "first_token_timeout_s": -1}},
                      "models": {"m": {"backends": ["nope"]}}})
    msg = str(err.value)
    assert "backends.a.base_url" in msg and "first_token_timeout_s" in msg
    with pytest.raises(ConfigError, match=r"models\.m\.backends: no backend named 'nope'"):
        parse_config({"backends": {}, "models": {"m": {"backends": ["nope"]}}})
    with pytest.raises(ConfigError, match="MISSING_KEY is not set"):
        parse_config({"backends": {"a": {"kind": "openai", "base_url": "http://x",
                                         "api_key_env": "MISSING_KEY"}}})
    bad = tmp_path / "bad.toml"
    bad.write_text("[backends\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")


def test_config_file_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("K", "secret")
    path = tmp_path / "flowlift.toml"
    path.write_text('[server]\napi_keys_env = "K"\n[backends.local]\nkind = "embedded"\n'
                    '[backends.up]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
                    'api_key_env = "K"\nrename = { small = "gpt-4o-mini" }\n'
                    '[models.small]\nbackends = ["local"]\nfallbacks = ["up"]\n')
    config = load_config(path)
    assert config.proxy_keys() == {"secret"} and config.upstream_key("up") == "secret"
    app = create_app({"fake-model": FakeEngine(["fake-model"])}, file_config=config)
    route = app[STATE].backends.route("small")
    assert route.replicas == ("embedded:fake-model",) and route.fallbacks == ("up",)


async def test_workflow_steps_run_on_an_upstream_model_with_affinity(aiohttp_client,
                                                                     aiohttp_server):
    fakes = [FakeUpstream([FakeUpstream.stream(sse_bytes(
        chunk({"content": f"from replica {i}"}), chunk({}, "stop"),
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}))])
        for i in range(2)]
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, *fakes)
    graph = {"nodes": [{"kind": "llm", "id": f"s{i}", "model": "up", "messages": [
        {"role": "user", "content": [{"text": f"step {i}"}]}]} for i in range(4)]}
    resp = await client.post("/v1/workflows", json=graph)
    events = parse_sse(await resp.text())
    values = {d["step_id"]: d["value"] for e, d in events if e == "step.finished"}
    assert len(values) == 4 and len(set(values.values())) == 1  # one replica for the run
    served = [f for f in fakes if f.received]
    assert len(served) == 1
    sent = json.loads(served[0].received[0].body)
    assert sent["model"] == "up" and sent["stream"] is True
    assert sent["messages"][-1]["content"] in {f"step {i}" for i in range(4)}


async def test_serving_nothing_is_a_config_error():
    with pytest.raises(ConfigError, match="nothing to serve"):
        create_app({})


async def test_a_truncated_upstream_stream_fails_the_workflow_step(aiohttp_client,
                                                                   aiohttp_server):
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "half"}),
                                                       done=False))])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    resp = await client.post("/v1/workflows", json={"nodes": [{
        "kind": "llm", "id": "s", "model": "up",
        "messages": [{"role": "user", "content": [{"text": "go"}]}]}]})
    events = parse_sse(await resp.text())
    failed = [d for e, d in events if e == "step.failed"]
    assert failed and "ended the stream before it finished" in json.dumps(failed[0])
    assert not [d for e, d in events if e == "step.finished"]


async def test_a_workflow_opens_no_new_upstream_connections_after_warm_up(aiohttp_client,
                                                                          aiohttp_server):
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(
        chunk({"content": "a step's answer"}), chunk({}, "stop")))])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)

    def chain(n):
        nodes = [{"kind": "llm", "id": "s0", "model": "up",
                  "messages": [{"role": "user", "content": [{"text": "start"}]}]}]
        nodes += [{"kind": "llm", "id": f"s{i}", "model": "up", "messages": [
            {"role": "user", "content": [{"text": "go on: "}, {"ref": f"s{i - 1}"}]}]}
            for i in range(1, n)]
        return {"nodes": nodes}

    await (await client.post("/v1/workflows", json=chain(3))).read()  # warm-up
    warm = {r.peer for r in fake.received}
    seen = len(fake.received)
    events = parse_sse(await (await client.post("/v1/workflows", json=chain(20))).text())
    assert len([e for e, _ in events if e == "step.finished"]) == 20
    new = {r.peer for r in fake.received[seen:]} - warm
    assert len(fake.received) - seen == 20 and new == set()


async def test_drop_in_requests_reuse_pooled_upstream_connections(aiohttp_client,
                                                                   aiohttp_server):
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "x"}),
                                                       chunk({}, "stop")))])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    for _ in range(10):
        resp = await client.post("/v1/chat/completions", json={
            "model": "up", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        await resp.read()
    assert len(fake.received) == 10 and len({r.peer for r in fake.received}) == 1


async def test_an_injected_httpx_transport_sees_the_upstream_request(monkeypatch):
    import httpx

    from flowlift.proxy.config import UpstreamSpec
    from flowlift.proxy.dispatch.upstream.provider import Upstream

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    up = Upstream("u", UpstreamSpec(kind="openai", base_url="http://up.example:8000/v1"),
                  "sk-up", transport=httpx.MockTransport(handler))
    response = await up.post("/chat/completions", b'{"model":"m"}',
                             {"traceparent": "00-a-b-01"})
    assert await response.read() == b'{"ok":true}'
    req = seen[0]
    assert str(req.url) == "http://up.example:8000/v1/chat/completions"
    assert req.headers["host"] == "up.example:8000" and req.headers["content-length"] == "13"
    assert req.headers["authorization"] == "Bearer sk-up"
    assert req.headers["traceparent"] == "00-a-b-01" and req.content == b'{"model":"m"}'
    await up.aclose()


async def test_aborting_an_upstream_backed_generation_closes_its_stream(aiohttp_client,
                                                                        aiohttp_server):
    from flowlift.local_engine.base import ChatMessage, GenerationRequest

    fake = FakeUpstream([FakeUpstream.stream(
        sse_bytes(*[chunk({"content": f"t{i} "}) for i in range(50)], chunk({}, "stop")),
        gap_s=0.1)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    engine = client.app[STATE].backends.resolve("up")[1].engine
    request = GenerationRequest("req-1", "up", [ChatMessage("user", "go")])
    chunks = []
    async for piece in engine.generate(request):
        chunks.append(piece)
        if len(chunks) == 2:
            assert engine.running() == 1
            await engine.abort("req-1")
    assert chunks[-1].finish_reason == "abort" and len(chunks) < 10
    assert engine.running() == 0
    await engine.abort("req-1")  # finished ids are ignored
