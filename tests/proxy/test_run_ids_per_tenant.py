"""Run ids are per tenant (issue 28 item 1): the same client-chosen id in two tenants
makes two runs (no 409, nothing learned about the other), every answer, event and trace
shows the client's own id, and stores written before (schema 1) are migrated -- on
SQLite and on the suite's real PostgreSQL (tests/pg.py)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.state import STATE
from flowlift.proxy.store.location import open_store
from flowlift.proxy.store.sqlite import SQLiteRunStore
from flowlift.proxy.tenants import DEFAULT_TENANT, client_run_id, run_key
from flowlift.testing import FakeEngine, parse_sse
from tests.proxy.test_tenants import ACME, GLOBEX, TWO, _llm, auth


def test_run_keys_prefix_named_tenants_only_and_invert() -> None:
    assert run_key(None, "r") == "r" and run_key(DEFAULT_TENANT, "r") == "r"
    assert run_key("acme", "r") == "acme/r"
    assert client_run_id("acme/r", "acme") == "r"
    assert client_run_id("r", DEFAULT_TENANT) == "r"
    assert client_run_id("acme/r", None) == "acme/r"  # the anonymous one sees whole keys


@pytest.fixture(params=["sqlite", "postgres"])
def state_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return (str(tmp_path / "state.sqlite") if request.param == "sqlite"
            else request.getfixturevalue("pg_url"))


async def _proxy(aiohttp_client: Any, state_path: str, trace_dir: Path) -> Any:
    app = create_app({"fake-model": FakeEngine(["fake-model"])},
                     ProxyConfig(tenants=TWO, state_path=state_path, trace_dir=trace_dir))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def _start(client: Any, key: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    resp = await client.post("/v1/workflows", headers=auth(key), json=body)
    text = await resp.text()
    return resp.status, (parse_sse(text) if resp.status == 200 else [("", json.loads(text))])


async def test_the_same_id_in_two_tenants_is_two_runs_each_shown_by_its_own_id(
        aiohttp_client: Any, state_path: str, tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    client = await _proxy(aiohttp_client, state_path, traces)
    for key, name in ((ACME, "acme-flow"), (GLOBEX, "globex-flow")):
        status, events = await _start(client, key, {"id": "shared-id", "name": name,
                                                    "nodes": [_llm("a", name)]})
        assert status == 200, events  # (no 409 for GLOBEX: ACME's id is not its)
        ids = {d["run_id"] for _, d in events if isinstance(d, dict) and "run_id" in d}
        assert ids == {"shared-id"}
    runs = client.server.app[STATE].runs
    runs.finished.clear()  # (what follows reads the store)
    for key, name in ((ACME, "acme-flow"), (GLOBEX, "globex-flow")):
        doc = await (await client.get("/v1/workflows/shared-id", headers=auth(key))).json()
        assert doc["run_id"] == "shared-id" and doc["status"] == "succeeded"
        assert doc["name"] == name and doc["trace"][0]["run_id"] == "shared-id"
        listed = await (await client.get("/v1/workflows", headers=auth(key))).json()
        assert [r["id"] for r in listed["data"]] == ["shared-id"]
        assert listed["last_id"] == "shared-id"
        after = await (await client.get("/v1/workflows?after=shared-id",
                                        headers=auth(key))).json()
        assert after["data"] == []  # (the cursor is the tenant's own id)
    # a tenant's own id twice is still refused, naming the field
    status, body = await _start(client, ACME, {"id": "shared-id", "nodes": [_llm("a", "x")]})
    assert status == 400 and body[0][1]["error"]["param"] == "id"
    # each trace file under its tenant's folder, with the client's id inside
    for tenant in ("acme", "globex"):
        lines = (traces / tenant / "shared-id.jsonl").read_text()
        assert f"{tenant}-flow" in lines and '"shared-id"' in lines and f"{tenant}/" not in lines


async def test_another_tenants_id_answers_exactly_what_an_unknown_id_answers_when_posted(
        aiohttp_client: Any, tmp_path: Path) -> None:
    """Posting an id that another tenant holds takes the same path as a fresh id."""
    client = await _proxy(aiohttp_client, str(tmp_path / "s.sqlite"), tmp_path / "t")
    assert (await _start(client, ACME, {"id": "taken", "nodes": [_llm("a", "1")]}))[0] == 200
    store = client.server.app[STATE].runs.store
    asked: list[str] = []
    exists = store.exists
    store.exists = lambda key: asked.append(key) or exists(key)  # type: ignore[method-assign]
    for run_id in ("taken", "fresh"):
        status, _ = await _start(client, GLOBEX, {"id": run_id, "nodes": [_llm("a", "2")]})
        assert status == 200
    assert asked == ["globex/taken", "globex/fresh"]  # (ACME's key is never looked at)


def _old_sqlite(path: Path) -> None:
    """A schema-1 file: tenant acme's run ``x`` (events, a tool result, a request) and
    the default tenant's ``x`` can not both exist there, so the default's is ``y``."""
    store = SQLiteRunStore(path)
    store.create("x", {"name": "acme-wf", "nodes": []}, tenant="acme")
    store.append("x", 1, "run.started", {"run_id": "x"})
    store.put_tool_result("x", "t", {"value": 1})
    store.put_request("x", "close", {})
    store.create("y", {"name": "old", "nodes": []})
    store.append("y", 1, "run.started", {"run_id": "y"})
    store.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()


def _assert_migrated(where: str | Path) -> None:
    store = open_store(where)
    try:
        assert store.load("x") is None
        acme = store.load("acme/x")
        assert acme is not None and acme.tenant == "acme" and len(acme.events) == 1
        assert store.tool_results("acme/x", ["t"]) == {"t": {"value": 1}}
        assert [r[1:3] for r in store.requests(["acme/x"])] == [("acme/x", "close")]
        old = store.load("y")
        assert old is not None and old.tenant is None and len(old.events) == 1
        assert [r.run_id for r in store.recent(tenant="acme")[0]] == ["acme/x"]
        store.create("x", {"nodes": []}, tenant=None)  # the default's "x" is free now
    finally:
        store.close()
    open_store(where).close()  # opening it again migrates nothing twice


def test_an_older_sqlite_store_moves_named_tenants_runs_to_their_keys(tmp_path: Path) -> None:
    _old_sqlite(tmp_path / "old.sqlite")
    _assert_migrated(tmp_path / "old.sqlite")


def test_an_older_postgres_store_moves_named_tenants_runs_to_their_keys(pg_url: str) -> None:
    store = open_store(pg_url)
    store.create("x", {"name": "acme-wf", "nodes": []}, tenant="acme")
    store.append("x", 1, "run.started", {"run_id": "x"})
    store.claim("x", "proxy-1", 30.0)
    store.put_tool_result("x", "t", {"value": 1})
    store.put_request("x", "close", {})
    store.mark_followed(["x"])
    store.create("y", {"name": "old", "nodes": []})
    store.append("y", 1, "run.started", {"run_id": "y"})
    store.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE flowlift_meta SET value = '1' WHERE key = 'schema_version'")
    _assert_migrated(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for table in ("flowlift_leases", "flowlift_follows"):
            assert conn.execute(f"SELECT run_id FROM {table}").fetchall() == [("acme/x",)]
        version = conn.execute("SELECT value FROM flowlift_meta "
                               "WHERE key = 'schema_version'").fetchone()
        assert version == ("2",)
