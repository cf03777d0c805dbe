"""The proxy on a PostgreSQL state database (``--state-db postgresql://...``): the flag,
the runs and the learned outcomes in the database (a real server: tests/pg.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowlift.cli import build_parser, serve_flags
from flowlift.errors import EngineError
from flowlift.proxy import ProxyConfig
from flowlift.proxy.state import STATE
from flowlift.proxy.workflows.outcomes import StepOutcomes
from flowlift.proxy.workflows.store import SQLiteRunStore, open_store
from flowlift.proxy.workflows.store_pg import PostgresRunStore
from flowlift.testing import parse_sse


def llm(node_id: str, text: str) -> dict[str, object]:
    return {"kind": "llm", "id": node_id, "model": "fake-model",
            "messages": [{"role": "user", "content": [{"text": text}]}]}


def test_state_db_url_stays_a_url_and_other_schemes_are_refused(tmp_path: Path) -> None:
    url = "postgresql://flowlift:pw@db.example:5432/runs"
    args = build_parser().parse_args(["serve", "--state-db", url])
    assert serve_flags(args)["state_path"] == url  # not Path(url): that folds the //
    args = build_parser().parse_args(["serve", "--state-db", str(tmp_path / "s.db")])
    assert serve_flags(args)["state_path"] == tmp_path / "s.db"
    with pytest.raises(EngineError, match="postgresql://"):
        open_store("mysql://h/db")
    assert isinstance(open_store(tmp_path / "s.db"), SQLiteRunStore)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_outcomes_persist_and_two_proxies_add_up(kind: str, tmp_path: Path,
                                                 request: pytest.FixtureRequest) -> None:
    where = (str(tmp_path / "state.sqlite") if kind == "sqlite"
             else request.getfixturevalue("pg_url"))
    first, second = StepOutcomes(where), StepOutcomes(where)
    first.record("extract", "small", accepted=True, attempts=1)
    second.record("extract", "small", accepted=False, attempts=3)
    first.record_output("extract", "small", 40)
    first.record_output("extract", "small", 60)
    first.close()
    second.close()
    again = StepOutcomes(where)
    counts = again.counts("extract", "small")
    assert (counts.items, counts.failures, counts.attempts) == (2, 1, 4)
    lengths = again.lengths("extract", "small")
    assert lengths is not None and lengths.p50 == 50.0
    assert again.counts("extract", None).items == 0
    again.close()


def test_an_unreachable_outcome_database_is_an_engine_error() -> None:
    with pytest.raises(EngineError) as caught:
        StepOutcomes("postgresql://u:s3cret@127.0.0.1:1/db")
    assert "s3cret" not in str(caught.value)


async def test_a_proxy_on_postgres_keeps_its_runs_in_the_database(
        aiohttp_client, make_app, pg_url: str) -> None:
    app = make_app(ProxyConfig(state_path=pg_url))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    assert isinstance(app[STATE].runs.store, PostgresRunStore)
    resp = await client.post("/v1/workflows", json={
        "name": "pg", "id": "wf-pg-1", "nodes": [llm("a", "hello"), llm("b", "world")]})
    events = parse_sse(await resp.text())
    assert events[-1][0] == "run.finished" and events[-1][1]["status"] == "succeeded"
    listed = await (await client.get("/v1/workflows", params={"name": "pg"})).json()
    assert [r["id"] for r in listed["data"]] == ["wf-pg-1"]
    await client.close()  # the app's cleanup closes the store and the outcomes

    store = open_store(pg_url)  # what another proxy on the database sees
    stored = store.load("wf-pg-1")
    assert stored is not None and stored.status == "succeeded"
    assert stored.outputs() == {"a": "echo: hello", "b": "echo: world"}
    store.close()
    outcomes = StepOutcomes(pg_url, default_model="fake-model")
    assert outcomes.counts("a", "fake-model").items == 1  # learned in the database
    outcomes.close()
