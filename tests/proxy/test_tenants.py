"""Tenants (issue 16 item 9): keys map to tenants; a tenant sees only its own runs,
sessions, inferred workflows and pages (another tenant's id answers exactly what an
unknown id answers: 404, never a 403); per-tenant request rate and active-run limits
(429 + ``Retry-After``); tokens and spend per tenant in ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from typing import Any

import pytest

from flowlift.errors import ConfigError
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.lifecycle import DRAIN
from flowlift.proxy.state import STATE
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.tenants import DEFAULT_TENANT, Tenant, Tenants, TokenBucket, visible
from flowlift.testing import FakeEngine
from tests.upstream_fake import FakeUpstream, chat_json

ACME, GLOBEX = "sk-acme-1", "sk-globex-1"
MESSAGES = [{"role": "user", "content": "hello"}]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _llm(node_id: str, text: str) -> dict[str, Any]:
    return {"kind": "llm", "id": node_id, "model": "fake-model", "params": {"max_tokens": 4},
            "messages": [{"role": "user", "content": [{"text": text}]}]}


async def tenant_proxy(aiohttp_client: Any, aiohttp_server: Any, *tenants: Tenant,
                       api_keys: frozenset[str] = frozenset()) -> Any:
    """A proxy with ``fake-model`` (embedded) and ``up`` (a fake upstream answering
    5 prompt + 2 completion tokens, priced 2.0 per 1,000) for ``tenants``."""
    fake = FakeUpstream([FakeUpstream.json(chat_json("ok"))] * 50)
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    app = create_app({"fake-model": FakeEngine(["fake-model"])},
                     ProxyConfig(tenants=tenants, api_keys=api_keys),
                     file_config=parse_config({
                         "backends": {"b0": {"kind": "openai", "base_url": url}},
                         "models": {"up": {"backends": ["b0"], "price_per_1k_tokens": 2.0}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


TWO = (Tenant("acme", frozenset({ACME})), Tenant("globex", frozenset({GLOBEX})))


def _same(text: str, run_id: str) -> str:
    """A 404's body with the id it names (and a page's nonces) made neutral."""
    return re.sub(r'nonce="[^"]+"', 'nonce=""', text.replace(run_id, "<id>"))


async def _answer(client: Any, method: str, path: str, key: str) -> tuple[int, str]:
    body = {"nodes": [_llm("z", "more")]} if path.endswith("/nodes") else {"value": 1}
    resp = await client.request(method, path, headers=auth(key),
                                json=body if method == "POST" else None)
    return resp.status, await resp.text()


RUN_ROUTES = (("GET", "/v1/workflows/{}"), ("GET", "/v1/workflows/{}/events"),
              ("GET", "/v1/workflows/{}/progress"), ("POST", "/v1/workflows/{}/nodes"),
              ("POST", "/v1/workflows/{}/steps/a/result"),
              ("POST", "/v1/workflows/{}/close"), ("DELETE", "/v1/workflows/{}"),
              ("GET", "/ui/workflows/{}"))


async def _assert_hidden(client: Any, owned: str, unknown: str, *,
                         routes: tuple[tuple[str, str], ...] = RUN_ROUTES) -> None:
    """GLOBEX gets, for ``owned`` (ACME's), exactly what it gets for ``unknown``."""
    for method, path in routes:
        theirs = await _answer(client, method, path.format(owned), GLOBEX)
        nobody = await _answer(client, method, path.format(unknown), GLOBEX)
        assert theirs[0] == 404, (method, path, theirs)
        assert (theirs[0], _same(theirs[1], owned)) == (nobody[0], _same(nobody[1], unknown)), \
            (method, path)


async def test_another_tenants_run_session_and_workflow_ids_are_404_like_unknown_ones(
        aiohttp_client, aiohttp_server):
    client = await tenant_proxy(aiohttp_client, aiohttp_server, *TWO)
    state = client.server.app[STATE]
    # ACME: an open run (active), a chat in a session and an inferred workflow
    opened = await client.post("/v1/workflows", headers=auth(ACME), json={
        "id": "acme-run-1", "open": True, "nodes": [_llm("a", "first")]})
    assert opened.status == 200
    stream = asyncio.ensure_future(opened.text())
    await asyncio.sleep(0.05)
    assert "acme/acme-run-1" in state.runs.active  # (keyed per tenant)
    chat = await client.post("/v1/chat/completions", headers={
        **auth(ACME), "X-Flowlift-Session": "acme-s", "X-Flowlift-Workflow": "acme-wf"},
        json={"model": "fake-model", "messages": MESSAGES})
    assert chat.status == 200
    # ACME itself sees each of them
    for path in ("/v1/workflows/acme-run-1", "/v1/workflows/acme-run-1/progress",
                 "/v1/sessions/acme-s", "/v1/workflows/acme-wf", "/ui/workflows/acme-wf",
                 "/ui/workflows/acme-run-1"):
        assert (await client.get(path, headers=auth(ACME))).status == 200, path
    # GLOBEX: while the run is active, then finished, then only in the store
    await _assert_hidden(client, "acme-run-1", "wf-0123456789abcdef")
    assert not state.runs.active["acme/acme-run-1"].growth.closed  # GLOBEX's /close did nothing
    closed = await client.post("/v1/workflows/acme-run-1/close", headers=auth(ACME))
    assert closed.status == 200
    assert '"succeeded"' in await stream
    await _assert_hidden(client, "acme-run-1", "never-a-run")
    state.runs.finished.clear()
    await _assert_hidden(client, "acme-run-1", "never-a-run")
    await _assert_hidden(client, "acme-s", "no-such-session",
                         routes=(("GET", "/v1/sessions/{}"),))
    await _assert_hidden(client, "acme-wf", "no-such-wf",
                         routes=(("GET", "/v1/workflows/{}"), ("GET", "/ui/workflows/{}")))
    # the same session and workflow ids are GLOBEX's own, apart from ACME's
    again = await client.post("/v1/chat/completions", headers={
        **auth(GLOBEX), "X-Flowlift-Session": "acme-s", "X-Flowlift-Workflow": "acme-wf"},
        json={"model": "fake-model", "messages": [{"role": "user", "content": "other"}]})
    assert again.status == 200
    mine = await (await client.get("/v1/sessions/acme-s", headers=auth(GLOBEX))).json()
    assert mine["turn_count"] == 1
    acme_wf = await (await client.get("/v1/workflows/acme-wf", headers=auth(ACME))).json()
    assert len(acme_wf["steps"]) == 1
    assert (await client.get("/v1/sessions/acme-s", headers=auth(ACME))).status == 200


async def test_a_tenant_guessing_run_ids_learns_nothing(aiohttp_client, aiohttp_server):
    client = await tenant_proxy(aiohttp_client, aiohttp_server, *TWO)
    ids = []
    for _ in range(3):
        resp = await client.post("/v1/workflows", headers=auth(ACME),
                                 json={"nodes": [_llm("a", "hi")]})
        text = await resp.text()
        ids.append(json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])["run_id"])
    guesses = [*ids, *(f"wf-{i:016x}" for i in range(5)), ids[0][:-1] + "0"]
    answers = set()
    for guess in guesses:
        for method, path in RUN_ROUTES:
            status, text = await _answer(client, method, path.format(guess), GLOBEX)
            answers.add((method, path, status, _same(text, guess)))
    assert len(answers) == len(RUN_ROUTES)  # one answer per route, whatever the id
    assert {a[2] for a in answers} == {404}


async def test_listings_show_only_the_tenants_own_runs(aiohttp_client, aiohttp_server):
    client = await tenant_proxy(aiohttp_client, aiohttp_server, *TWO)
    for key, run_id in ((ACME, "a-1"), (GLOBEX, "g-1"), (ACME, "a-2")):
        resp = await client.post("/v1/workflows", headers=auth(key),
                                 json={"id": run_id, "nodes": [_llm("a", "hi")]})
        await resp.read()

    async def listed(key: str, query: str = "") -> list[str]:
        body = await (await client.get(f"/v1/workflows{query}", headers=auth(key))).json()
        return [r["id"] for r in body["data"]]

    assert await listed(ACME) == ["a-2", "a-1"]
    assert await listed(GLOBEX) == ["g-1"]
    assert await listed(GLOBEX, "?after=a-2") == ["g-1"]  # another's cursor: from the top
    page = await (await client.get("/ui/", headers=auth(GLOBEX))).text()
    assert "g-1" in page and "a-1" not in page and "a-2" not in page


async def test_the_request_rate_is_limited_per_tenant(aiohttp_client, aiohttp_server):
    limited = Tenant("acme", frozenset({ACME}), requests_per_s=0.5, burst=2)
    client = await tenant_proxy(aiohttp_client, aiohttp_server, limited, TWO[1])
    statuses = [(await client.get("/v1/models", headers=auth(ACME))).status for _ in range(2)]
    refused = await client.get("/v1/models", headers=auth(ACME))
    assert statuses == [200, 200] and refused.status == 429
    assert int(refused.headers["Retry-After"]) == 2  # one token at 0.5/s
    assert (await refused.json())["error"]["code"] == "rate_limit_exceeded"
    for _ in range(5):  # the other tenant is not limited by it
        assert (await client.get("/v1/models", headers=auth(GLOBEX))).status == 200


def test_the_token_bucket_refills_at_its_rate():
    now = [0.0]
    bucket = TokenBucket(2.0, 3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [None, None, None]
    assert bucket.take() == pytest.approx(0.5)
    now[0] = 0.25
    assert bucket.take() == pytest.approx(0.25)
    now[0] = 0.5
    assert bucket.take() is None
    now[0] = 100.0  # saved up to its capacity only
    assert [bucket.take() for _ in range(4)][-1] == pytest.approx(0.5)


async def test_active_runs_are_limited_per_tenant(aiohttp_client, aiohttp_server):
    one = Tenant("acme", frozenset({ACME}), max_active_runs=1)
    client = await tenant_proxy(aiohttp_client, aiohttp_server, one, TWO[1])
    first = await client.post("/v1/workflows", headers=auth(ACME), json={
        "id": "a-open", "open": True, "nodes": [_llm("a", "first")]})
    stream = asyncio.ensure_future(first.text())
    await asyncio.sleep(0.05)
    second = await client.post("/v1/workflows", headers=auth(ACME),
                               json={"nodes": [_llm("a", "second")]})
    assert second.status == 429 and second.headers["Retry-After"] == "1"
    assert "max_active_runs" in (await second.json())["error"]["message"]
    other = await client.post("/v1/workflows", headers=auth(GLOBEX),
                              json={"nodes": [_llm("a", "theirs")]})
    assert other.status == 200 and '"succeeded"' in await other.text()
    await client.post("/v1/workflows/a-open/close", headers=auth(ACME))
    await stream
    third = await client.post("/v1/workflows", headers=auth(ACME),
                              json={"nodes": [_llm("a", "third")]})
    assert third.status == 200 and '"succeeded"' in await third.text()


async def test_while_draining_another_tenants_running_run_is_refused_like_an_unknown_one(
        aiohttp_client, aiohttp_server):
    client = await tenant_proxy(aiohttp_client, aiohttp_server, *TWO)
    opened = await client.post("/v1/workflows", headers=auth(ACME), json={
        "id": "acme-live", "open": True, "nodes": [_llm("a", "first")]})
    stream = asyncio.ensure_future(opened.text())
    await asyncio.sleep(0.05)
    client.app[DRAIN].draining_since = time.monotonic()
    theirs = await client.get("/v1/workflows/acme-live/events", headers=auth(GLOBEX))
    unknown = await client.get("/v1/workflows/wf-gone/events", headers=auth(GLOBEX))
    assert theirs.status == unknown.status == 503
    assert await theirs.json() == await unknown.json()
    own = await client.get("/v1/workflows/acme-live/events", headers=auth(ACME))
    assert own.status == 200  # its own running run is still followed
    own.close()
    await client.post("/v1/workflows/acme-live/close", headers=auth(ACME))
    assert '"succeeded"' in await stream


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[-1])
    return 0.0


async def test_tokens_and_spend_are_counted_per_tenant(aiohttp_client, aiohttp_server):
    client = await tenant_proxy(aiohttp_client, aiohttp_server, *TWO)
    for _ in range(2):
        resp = await client.post("/v1/chat/completions", headers=auth(ACME),
                                 json={"model": "up", "messages": MESSAGES})
        assert resp.status == 200
    run = await client.post("/v1/workflows", headers=auth(GLOBEX),
                            json={"nodes": [_llm("a", "hi")]})
    assert '"succeeded"' in await run.text()
    text = await (await client.get("/metrics")).text()
    usage = chat_json("ok")["usage"]
    per_chat = usage["prompt_tokens"] + usage["completion_tokens"]
    assert _metric(text, "flowlift_tenant_tokens_total", tenant="acme",
                   kind="prompt") == 2 * usage["prompt_tokens"]
    assert _metric(text, "flowlift_tenant_spend_total", tenant="acme") == pytest.approx(
        2 * per_chat / 1000 * 2.0)
    assert _metric(text, "flowlift_tenant_tokens_total", tenant="globex", kind="prompt") > 0
    assert _metric(text, "flowlift_tenant_spend_total", tenant="globex") == 0.0  # unpriced
    labels = set(re.findall(r'tenant="([^"]*)"', text))
    assert labels == {"acme", "globex"}  # bounded: configured tenants only


async def test_the_old_api_keys_env_is_the_default_tenant(aiohttp_client, aiohttp_server):
    client = await tenant_proxy(aiohttp_client, aiohttp_server, TWO[0],
                                api_keys=frozenset({"sk-old"}))
    resp = await client.post("/v1/workflows", headers=auth("sk-old"),
                             json={"id": "old-1", "nodes": [_llm("a", "hi")]})
    assert '"succeeded"' in await resp.text()
    assert (await client.get("/v1/workflows/old-1", headers=auth("sk-old"))).status == 200
    assert (await client.get("/v1/workflows/old-1", headers=auth(ACME))).status == 404
    assert client.server.app[STATE].runs.store.load("old-1").tenant == DEFAULT_TENANT
    assert (await client.get("/v1/models")).status == 401


async def test_with_no_keys_one_anonymous_tenant_sees_everything(client):
    resp = await client.post("/v1/workflows", json={"id": "anon-1",
                                                    "nodes": [_llm("a", "hi")]})
    assert '"succeeded"' in await resp.text()
    assert (await client.get("/v1/workflows/anon-1")).status == 200
    assert client.server.app[STATE].tenants.names() == frozenset()
    assert client.server.app[STATE].runs.store.load("anon-1").tenant is None


def test_config_maps_keys_to_tenants_and_names_every_problem(monkeypatch):
    monkeypatch.setenv("ACME_KEYS", "k1, k2")
    monkeypatch.setenv("OLD_KEYS", "k0")
    config = parse_config({"server": {"api_keys_env": "OLD_KEYS"}, "tenants": {"acme": {
        "api_key_env": "ACME_KEYS", "max_active_runs": 2, "requests_per_s": 5, "burst": 10}}})
    (acme,) = config.server_settings()["tenants"]
    assert acme == Tenant("acme", frozenset({"k1", "k2"}), 2, 5.0, 10, frozenset())
    assert {"k0", "k1", "k2"} <= config.secrets()
    tenants = Tenants.build(config.proxy_keys(), (acme,))
    assert tenants.by_key("k2") == acme and tenants.by_key("k0").name == DEFAULT_TENANT
    assert tenants.by_key("k3") is None
    with pytest.raises(ConfigError, match="NOPE is not set"):
        parse_config({"tenants": {"acme": {"api_key_env": "NOPE"}}})
    monkeypatch.setenv("SAME_KEYS", "k1")
    with pytest.raises(ConfigError, match="also a key of the tenant 'acme'"):
        parse_config({"tenants": {"acme": {"api_key_env": "ACME_KEYS"},
                                  "other": {"api_key_env": "SAME_KEYS"}}})
    with pytest.raises(ConfigError, match=r"tenants\.default"):
        parse_config({"server": {"api_keys_env": "OLD_KEYS"},
                      "tenants": {"default": {"api_key_env": "ACME_KEYS"}}})
    with pytest.raises(ConfigError, match="tenant name"):
        parse_config({"tenants": {"a/b": {"api_key_env": "ACME_KEYS"}}})
    with pytest.raises(ConfigError, match="requests_per_s"):
        parse_config({"tenants": {"acme": {"api_key_env": "ACME_KEYS", "requests_per_s": 0}}})


def test_an_older_store_gains_the_tenant_column_and_its_runs_are_the_default_tenants(
        tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE runs (run_id TEXT PRIMARY KEY, graph TEXT NOT NULL,
        status TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE TABLE events (run_id TEXT NOT NULL, seq INTEGER NOT NULL, name TEXT NOT NULL,
        data TEXT NOT NULL, PRIMARY KEY (run_id, seq));
        INSERT INTO runs VALUES ('before', '{"nodes": []}', 'succeeded', 1.0, 2.0);""")
    db.commit()
    db.close()
    store = RunStore(path)
    store.create("after", {"nodes": []}, tenant="acme")
    assert store.load("before").tenant is None and store.load("after").tenant == "acme"
    assert [r.run_id for r in store.recent(tenant=DEFAULT_TENANT)[0]] == ["before"]
    assert [r.run_id for r in store.recent(tenant="acme")[0]] == ["after"]
    assert {r.run_id for r in store.recent()[0]} == {"before", "after"}
    assert visible(None, DEFAULT_TENANT) and not visible(None, "acme")
    assert visible("acme", None)
    RunStore(path).close()  # opening it again migrates nothing twice

