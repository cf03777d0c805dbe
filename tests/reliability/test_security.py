"""Security: proxy keys on every route, client credentials never upstream, secrets never in
logs or traces, and no request that makes the proxy call an address that is not a
configured backend (a URL as ``model``, a ``base_url`` in the body, a graph node naming a
URL, a remote ``$ref`` in a schema, an upstream's redirect)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from structlog.testing import capture_logs

from flowlift.proxy import ProxyConfig
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse
from tests.reliability.faults import config_for, proxy_client, redirect, serve
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes

PROXY_KEY = "sk-proxy-canary-91c2"
UPSTREAM_KEY = "sk-upstream-canary-7f3a"  # UP_KEY, set by conftest
CLIENT_SECRETS = {"X-Api-Key": "canary-x-api-key", "Api-Key": "canary-azure-key",
                  "Cookie": "sid=canary-cookie", "OpenAI-Organization": "canary-org",
                  "OpenAI-Project": "canary-project", "Proxy-Authorization": "Basic canary-pa",
                  "X-Goog-Api-Key": "canary-goog", "Anthropic-Api-Key": "canary-anthropic",
                  "X-Forwarded-For": "10.0.0.1"}
SECRETS = [PROXY_KEY, *(v.split("=")[-1].split()[-1] for v in CLIENT_SECRETS.values())]
CHAT = {"model": "up", "messages": [{"role": "user", "content": "hi"}]}


def everything(fake: FakeUpstream) -> str:
    return "\n".join(f"{r.path} {json.dumps(r.headers)} {r.body.decode(errors='replace')}"
                     for r in fake.received)


async def answer_anything(request):  # type: ignore[no-untyped-def]
    """A JSON or streamed answer, whatever was asked (chat, completions, responses...)."""
    body = json.loads(await request.read() or b"{}")
    if body.get("stream") is True:
        return await FakeUpstream.stream(sse_bytes(chunk({"content": "ok"}),
                                                   chunk({}, "stop")))(request)
    return await FakeUpstream.json(chat_json("ok"))(request)


@pytest.fixture
async def guarded(aiohttp_client, aiohttp_server, tmp_path):
    """(client, upstream, trace_dir): a proxy with a proxy key over one recording upstream."""
    fake = FakeUpstream([answer_anything])
    (url,) = await serve(aiohttp_server, [fake.app()])
    client = await proxy_client(aiohttp_client, config_for({"up": {"backends": ["b0"]}},
                                                           {"b0": url}),
                                proxy_config=ProxyConfig(api_keys=frozenset({PROXY_KEY}),
                                                         trace_dir=tmp_path / "traces"))
    return client, fake, tmp_path / "traces"


def _concrete(path: str) -> str:
    return path.replace("{run_id}", "wf-x").replace("{step_id}", "s").replace(
        "{model}", "up").replace("{id}", "x").replace("{session_id}", "x")


async def test_every_route_but_the_probes_and_metrics_needs_the_proxy_key(guarded):
    client, fake, _ = guarded
    routes = {(r.method, r.resource.canonical) for r in client.app.router.routes()
              if r.method != "HEAD"}
    assert len(routes) >= 12, routes
    for method, path in sorted(routes):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": PROXY_KEY},
                        {"Authorization": f"Basic {PROXY_KEY}"}):
            resp = await client.request(method, _concrete(path), json=CHAT, headers=headers)
            if path in ("/healthz", "/readyz", "/metrics"):  # probes and the scrape
                assert resp.status == 200, path
                assert PROXY_KEY not in await resp.text()
                continue
            assert resp.status == 401, (method, path, headers, resp.status)
            assert (await resp.json())["error"]["param"] == "Authorization"
        ok = await client.request(method, _concrete(path), json=CHAT,
                                  headers={"Authorization": f"Bearer {PROXY_KEY}"})
        assert ok.status != 401, (method, path)
    assert fake.received == [b for b in fake.received if PROXY_KEY not in json.dumps(
        b.headers)]


async def test_no_client_credential_reaches_an_upstream_on_any_forwarded_route(guarded):
    client, fake, _ = guarded
    headers = {"Authorization": f"Bearer {PROXY_KEY}", **CLIENT_SECRETS}
    bodies = {"/v1/chat/completions": CHAT,
              "/v1/completions": {"model": "up", "prompt": "hi"},
              "/v1/embeddings": {"model": "up", "input": "hi"},
              "/v1/responses": {"model": "up", "input": "hi"}}
    for path, body in bodies.items():
        for stream in (False, True):
            if path == "/v1/embeddings" and stream:
                continue
            resp = await client.post(path + "?api_key=canary-query", headers=headers,
                                     json={**body, "stream": stream})
            assert resp.status == 200, (path, await resp.text())
            await resp.read()
    graph = {"nodes": [{"kind": "llm", "id": "a", "model": "up", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]}
    resp = await client.post("/v1/workflows", json=graph, headers=headers)
    assert parse_sse(await resp.text())[-1][1]["status"] == "succeeded"
    assert len(fake.received) == 8
    seen = everything(fake)
    for secret in [*SECRETS, "canary-query"]:
        assert secret not in seen, secret
    for r in fake.received:
        got = {k.lower(): v for k, v in r.headers.items()}
        assert got["authorization"] == f"Bearer {UPSTREAM_KEY}"
        assert "cookie" not in got and "x-forwarded-for" not in got


async def test_secrets_never_reach_logs_or_traces(guarded, aiohttp_client, aiohttp_server):
    client, _, traces = guarded
    headers = {"Authorization": f"Bearer {PROXY_KEY}", **CLIENT_SECRETS}
    graph = {"nodes": [{"kind": "llm", "id": "a", "model": "up", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]}
    rejecting = FakeUpstream([FakeUpstream.json(
        {"error": {"message": f"Incorrect API key provided: {UPSTREAM_KEY}"}}, 401)])
    (url,) = await serve(aiohttp_server, [rejecting.app()])
    other = await proxy_client(aiohttp_client, config_for({"up": {"backends": ["b0"]}},
                                                          {"b0": url}))
    with capture_logs() as logs:
        await (await client.post("/v1/chat/completions", json=CHAT, headers=headers)).read()
        await (await client.post("/v1/chat/completions", json=CHAT,
                                 headers={"Authorization": "Bearer sk-wrong-canary"})).read()
        await (await client.post("/v1/workflows", json=graph, headers=headers)).read()
        refused = await other.post("/v1/chat/completions", json=CHAT, headers=headers)
        answer = await refused.text()
    assert refused.status == 502 and UPSTREAM_KEY not in answer  # not the upstream's echo
    assert logs, "nothing was logged: the check would prove nothing"
    text = json.dumps(logs, default=str) + "".join(
        p.read_text() for p in Path(traces).glob("*.jsonl"))
    assert list(Path(traces).glob("*.jsonl")), "no trace was written"
    for secret in [*SECRETS, UPSTREAM_KEY, "sk-wrong-canary"]:
        assert secret not in text, secret


@pytest.fixture
async def canary(aiohttp_server):
    """(upstream, url): a server that must never be called."""
    fake = FakeUpstream([FakeUpstream.json(chat_json("canary"))])
    (url,) = await serve(aiohttp_server, [fake.app()])
    return fake, url


async def test_a_url_as_model_or_base_url_in_the_body_calls_nothing_else(guarded, canary):
    client, fake, _ = guarded
    trap, trap_url = canary
    auth = {"Authorization": f"Bearer {PROXY_KEY}"}
    for model in (trap_url, f"{trap_url}/chat/completions", trap_url.replace("http", "openai"),
                  "b0", "embedded:fake-model"):
        resp = await client.post("/v1/chat/completions", headers=auth,
                                 json={**CHAT, "model": model})
        assert resp.status == 404, (model, resp.status)
        assert (await resp.json())["error"]["param"] == "model"
    for field in ("base_url", "api_base", "url", "endpoint"):
        resp = await client.post("/v1/chat/completions", headers=auth,
                                 json={**CHAT, field: trap_url})
        assert resp.status == 200
    graph = {"nodes": [{"kind": "llm", "id": "a", "model": trap_url, "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]}
    for route in ("/v1/workflows", "/v1/workflows:compile"):
        resp = await client.post(route, json=graph, headers=auth)
        assert resp.status == 400
        assert any("model" in p for p in (await resp.json())["error"]["problems"])
    assert trap.received == []
    assert {r.headers.get("Host") for r in fake.received} == {
        f"{fake_host(client)}"}


def fake_host(client: Any) -> str:
    """The configured backend's ``host:port`` (the only Host an upstream request may name)."""
    up = client.app[STATE].backends.upstreams["b0"]
    return urlsplit(up.spec.base_url).netloc


async def test_schemas_with_remote_refs_fetch_nothing(guarded, canary):
    client, _, _ = guarded
    trap, trap_url = canary
    auth = {"Authorization": f"Bearer {PROXY_KEY}"}
    remote = {"type": "object", "properties": {"x": {"$ref": f"{trap_url}/schema.json"}}}
    graph = {"nodes": [{"kind": "llm", "id": "a", "model": "fake-model", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}],
        "contract": {"json_schema": remote}}]}
    for route in ("/v1/workflows:compile", "/v1/workflows"):
        resp = await client.post(route, json=graph, headers=auth)
        assert resp.status < 500, (route, await resp.text())
        await resp.read()
    resp = await client.post("/v1/chat/completions", headers=auth, json={
        **CHAT, "model": "fake-model", "response_format": {
            "type": "json_schema", "json_schema": {"name": "o", "schema": remote}}})
    assert resp.status < 500, await resp.text()
    tool = {"type": "function", "function": {"name": "f", "parameters": remote}}
    resp = await client.post("/v1/chat/completions", headers=auth,
                             json={**CHAT, "model": "fake-model", "tools": [tool]})
    assert resp.status < 500, await resp.text()
    assert trap.received == []


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_redirect_is_not_followed(aiohttp_client, aiohttp_server, canary,
                                                    status, stream):
    trap, trap_url = canary
    fake = FakeUpstream([redirect(f"{trap_url}/chat/completions", status)])
    (url,) = await serve(aiohttp_server, [fake.app()])
    client = await proxy_client(aiohttp_client, config_for(
        {"up": {"backends": ["b0"], "max_attempts": 1}}, {"b0": url}))
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert resp.status == 502, await resp.text()
    assert "error" in await resp.json()
    graph = {"nodes": [{"kind": "llm", "id": "a", "model": "up", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]}
    final = parse_sse(await (await client.post("/v1/workflows", json=graph)).text())[-1][1]
    assert final["status"] == "failed"
    assert trap.received == [] and len(fake.received) == 2


@pytest.mark.parametrize("run_id", ["../escaped", "../../escaped", "/tmp/flowlift-escaped",
                                    "a/b", "..", ".hidden", "x" * 129, "a\\b", "a b"])
async def test_a_client_chosen_run_id_cannot_write_outside_the_trace_dir(aiohttp_client,
                                                                          tmp_path, run_id):
    """Found by this suite: ``<run id>.jsonl`` is the run's trace file, and a graph's
    ``id`` of ``../x`` or ``/tmp/x`` wrote it outside ``--trace-dir`` (``a/b`` crashed the
    run's clean-up instead). Run ids are now safe names, or a 400 naming ``id``."""
    traces = tmp_path / "deep" / "traces"
    client = await proxy_client(aiohttp_client, config_for({}, {}),
                                proxy_config=ProxyConfig(trace_dir=traces))
    graph = {"id": run_id, "nodes": [{"kind": "llm", "id": "a", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]}
    resp = await client.post("/v1/workflows", json=graph)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "id"
    assert not list(tmp_path.rglob("*.jsonl")) and not Path("/tmp/flowlift-escaped.jsonl").exists()
    ok = await client.post("/v1/workflows", json={**graph, "id": "run-1.a:b_c"})
    assert parse_sse(await ok.text())[-1][1]["status"] == "succeeded"
    assert [p.name for p in traces.iterdir()] == ["run-1.a:b_c.jsonl"]
