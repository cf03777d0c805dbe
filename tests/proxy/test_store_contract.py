"""One contract for every run store: SQLite (a file) and PostgreSQL (a real server, see
tests/pg.py) pass the same suite (RunStoreProtocol's guarantees)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flowlift.errors import EngineError, LeaseLost
from flowlift.proxy.store.base import RunStoreProtocol
from flowlift.proxy.store.location import is_database_url, open_store
from flowlift.proxy.store.postgres import PostgresRunStore, redact
from flowlift.proxy.store.sqlite import SQLiteRunStore

Opener = Callable[[], RunStoreProtocol]


@pytest.fixture(params=["sqlite", "postgres"])
def open_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens a new store object on one database per test (each call: another object)."""
    where: str | Path = (tmp_path / "state.sqlite" if request.param == "sqlite"
                         else request.getfixturevalue("pg_url"))
    opened: list[RunStoreProtocol] = []

    def opener() -> RunStoreProtocol:
        opened.append(open_store(where))
        return opened[-1]

    yield opener
    for store in opened:
        store.close()


def graph(name: str = "wf", run_id: str | None = None) -> dict[str, object]:
    return {"name": name, "id": run_id, "nodes": [{"id": "a", "kind": "llm"}]}


def test_open_store_picks_the_store_from_the_location(open_db: Opener, request) -> None:
    store = open_db()
    kind = request.node.callspec.params["open_db"]
    assert isinstance(store, SQLiteRunStore if kind == "sqlite" else PostgresRunStore)
    assert is_database_url("postgresql://u@h/db") and is_database_url("postgres://h/db")
    assert not is_database_url("state.sqlite") and not is_database_url(Path("/x/y"))


def test_create_append_load_round_trip_in_seq_order(open_db: Opener) -> None:
    store = open_db()
    store.create("r1", graph("extract", "r1"))
    assert store.exists("r1") and not store.exists("r2") and store.load("r2") is None
    for seq, name, data in [(2, "step.finished", {"step_id": "a", "value": {"x": [1, 2]}}),
                            (0, "run.started", {"n": 1}),
                            (1, "step.prompt", {"step_id": "a", "messages": [
                                {"role": "user", "content": "héllo ✓"}]})]:
        store.append("r1", seq, name, data)
    store.append("r1", 3, "step.failed", {"step_id": "b", "error": "boom"})
    store.append("r1", 3, "step.failed", {"step_id": "b", "error": "boom again"})  # replaces
    run = store.load("r1")
    assert run is not None
    assert run.graph == graph("extract", "r1") and run.status == "running"
    assert [(s, n) for s, n, _ in run.events] == [
        (0, "run.started"), (1, "step.prompt"), (2, "step.finished"), (3, "step.failed")]
    assert run.outputs() == {"a": {"x": [1, 2]}} and run.failures() == {"b": "boom again"}
    assert run.prompts() == {"a": [{"role": "user", "content": "héllo ✓"}]}


def test_a_run_id_is_created_once(open_db: Opener) -> None:
    store = open_db()
    store.create("r1", graph())
    with pytest.raises(Exception):  # the database's own unique violation  # noqa: B017
        store.create("r1", graph())
    assert store.problem() is None  # the failed insert leaves the store usable
    store.append("r1", 0, "run.started", {})
    assert [n for _, n, _ in store.load("r1").events] == ["run.started"]  # type: ignore[union-attr]


def test_run_finished_sets_the_status_and_unfinished_lists_running_runs(
        open_db: Opener) -> None:
    store = open_db()
    for rid in ("r1", "r2", "r3"):
        store.create(rid, graph())
        store.append(rid, 0, "run.started", {})
    store.append("r2", 1, "run.finished", {"status": "succeeded"})
    store.append("r3", 1, "run.finished", {})
    assert store.load("r2").status == "succeeded"  # type: ignore[union-attr]
    assert store.load("r3").status == "finished"  # type: ignore[union-attr]
    unfinished = store.unfinished()
    assert [r.run_id for r in unfinished] == ["r1"]
    assert [n for _, n, _ in unfinished[0].events] == ["run.started"]


def test_recent_filters_and_pages_newest_first(open_db: Opener) -> None:
    store = open_db()
    for i in range(5):
        store.create(f"r{i}", graph("odd" if i % 2 else "even"))
    time.sleep(0.02)
    since = time.time()
    time.sleep(0.02)
    store.create("r5", graph("odd"))
    store.append("r4", 0, "run.finished", {"status": "failed"})

    page, more = store.recent(limit=2)
    assert [r.run_id for r in page] == ["r5", "r4"] and more
    page, more = store.recent(limit=2, after="r4")
    assert [r.run_id for r in page] == ["r3", "r2"] and more
    page, more = store.recent(limit=2, after="r2")
    assert [r.run_id for r in page] == ["r1", "r0"] and not more
    assert [r.run_id for r in store.recent(after="unknown")[0]] == [
        "r5", "r4", "r3", "r2", "r1", "r0"]
    assert [r.run_id for r in store.recent(name="odd")[0]] == ["r5", "r3", "r1"]
    assert [r.run_id for r in store.recent(status="failed")[0]] == ["r4"]
    assert [r.run_id for r in store.recent(status="running", name="even")[0]] == ["r2", "r0"]
    assert [r.run_id for r in store.recent(since=since)[0]] == ["r5"]
    row = store.recent(limit=1)[0][0]
    assert row.to_json() == {"object": "workflow.run", "id": "r5", "name": "odd",
                             "status": "running", "created_at": row.created_at,
                             "updated_at": row.updated_at}
    assert since < row.created_at <= row.updated_at <= time.time()


def test_runs_keep_their_tenant_and_listings_show_only_its_runs(open_db: Opener) -> None:
    store = open_db()
    store.create("a1", graph("wf"), "acme")
    store.create("b1", graph("wf"), "beta")
    store.create("old", graph("wf"))  # stored before tenants: the default tenant's
    store.create("a2", graph("wf"), "acme")
    loaded = store.load("a1")
    assert loaded is not None and loaded.tenant == "acme"
    again = open_db().load("old")  # another store object: it was committed with the run
    assert again is not None and again.tenant is None
    assert [r.run_id for r in store.recent(tenant="acme")[0]] == ["a2", "a1"]
    assert [r.run_id for r in store.recent(tenant="default")[0]] == ["old"]
    assert [r.run_id for r in store.recent()[0]] == ["a2", "old", "b1", "a1"]
    # a cursor naming another tenant's run starts from the top: it confirms nothing
    assert [r.run_id for r in store.recent(tenant="acme", after="b1")[0]] == ["a2", "a1"]
    assert [r.run_id for r in store.recent(tenant="acme", after="a2")[0]] == ["a1"]


def test_prune_forgets_old_and_surplus_finished_runs_never_running_ones(
        open_db: Opener) -> None:
    store = open_db()
    for rid in ("f1", "f2", "f3", "live"):
        store.create(rid, graph())
        store.append(rid, 0, "run.started", {})
    for rid in ("f1", "f2", "f3"):
        store.append(rid, 1, "run.finished", {"status": "succeeded"})
        time.sleep(0.01)
    assert store.prune(older_than_s=3600, keep=1) == 2  # f1, f2: all but the newest
    assert [r.run_id for r in store.recent()[0]] == ["live", "f3"]
    assert store.load("f1") is None and not store.exists("f2")
    assert store.prune(older_than_s=3600, keep=1) == 0
    assert store.prune(older_than_s=0) == 1  # f3 is older than now
    assert [r.run_id for r in store.recent()[0]] == ["live"]
    assert store.prune(older_than_s=0, keep=0) == 0  # running runs stay, whatever the age
    assert [n for _, n, _ in store.load("live").events] == ["run.started"]  # type: ignore[union-attr]


def test_writes_are_durable_when_they_return(open_db: Opener) -> None:
    writer = open_db()
    writer.create("r1", graph())
    reader = open_db()  # another object (another connection), the writer left open
    assert reader.exists("r1")
    for seq in range(3):
        writer.append("r1", seq, "step.finished", {"step_id": f"s{seq}", "value": seq})
        assert len(reader.load("r1").events) == seq + 1  # type: ignore[union-attr]
    writer.append("r1", 3, "run.finished", {"status": "succeeded"})
    assert reader.load("r1").status == "succeeded"  # type: ignore[union-attr]
    writer.close()
    assert open_db().load("r1").outputs() == {"s0": 0, "s1": 1, "s2": 2}  # type: ignore[union-attr]


def test_two_store_objects_append_to_different_runs_at_once(open_db: Opener) -> None:
    stores = [open_db(), open_db()]
    stores[0].create("a", graph())
    stores[1].create("b", graph())
    events = 100
    errors: list[BaseException] = []

    def write(store: RunStoreProtocol, run_id: str) -> None:
        try:
            for seq in range(events):
                store.append(run_id, seq, "step.finished", {"step_id": str(seq), "value": seq})
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(s, rid))
               for s, rid in zip(stores, ("a", "b"), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    for rid in ("a", "b"):
        run = open_db().load(rid)
        assert run is not None and [s for s, _, _ in run.events] == list(range(events))


def test_problem_names_a_closed_store(open_db: Opener) -> None:
    store = open_db()
    assert store.problem() is None
    store.close()
    assert store.problem() is not None


def test_an_unreachable_postgres_is_an_engine_error_without_the_password() -> None:
    t0 = time.monotonic()
    with pytest.raises(EngineError) as caught:
        PostgresRunStore("postgresql://u:s3cret@127.0.0.1:1/db")
    message = str(caught.value)
    assert "s3cret" not in message and "postgresql://u@127.0.0.1:1/db" in message
    assert "refused" in message  # the server's own reason, at once (not a pool timeout)
    assert time.monotonic() - t0 < 5
    assert redact("postgresql://u:s3cret@h:5/db?password=x") == \
        "postgresql://u@h:5/db?password=***"
    assert redact("host=h password=s3cret user=u") == "host=h password=*** user=u"


def test_a_newer_schema_is_refused(open_db: Opener) -> None:
    store = open_db()
    if isinstance(store, PostgresRunStore):
        import psycopg

        with psycopg.connect(store._conninfo, autocommit=True) as conn:
            conn.execute("UPDATE flowlift_meta SET value = '99'")
    else:
        import sqlite3

        with sqlite3.connect(store.path) as conn:
            conn.execute("PRAGMA user_version = 99")
    with pytest.raises(EngineError, match="newer"):
        open_db()


def test_leases_give_a_run_to_one_owner_until_it_expires(open_db: Opener) -> None:
    store, other = open_db(), open_db()
    for rid in ("r1", "r2", "done"):
        store.create(rid, graph())
    store.append("done", 0, "run.finished", {"status": "succeeded"})
    assert store.claim("r1", "proxy-a", ttl_s=30) and store.claim("r1", "proxy-a", ttl_s=30)
    assert store.orphans("proxy-a") == ["r1", "r2"]  # its own, and a run nobody holds
    if not store.shared:  # one proxy owns the file: every claim is granted
        assert other.claim("r1", "proxy-b", ttl_s=30) and other.orphans("proxy-b") == [
            "r1", "r2"]
        assert store.renew("proxy-a", ["r1", "r2"], ttl_s=30) == {"r1", "r2"}
        return
    assert not other.claim("r1", "proxy-b", ttl_s=30)  # held and alive
    assert other.orphans("proxy-b") == ["r2"]
    assert store.renew("proxy-a", ["r1", "r2"], ttl_s=0.2) == {"r1"}  # r2: never claimed
    time.sleep(0.4)  # proxy-a stops renewing: its lease expires
    assert other.orphans("proxy-b") == ["r1", "r2"]
    assert other.claim("r1", "proxy-b", ttl_s=30)
    assert store.renew("proxy-a", ["r1"], ttl_s=30) == set()  # proxy-a learns it lost r1
    assert not store.claim("r1", "proxy-a", ttl_s=30)
    store.release("r1", "proxy-a")  # not its lease: nothing happens
    assert not store.claim("r1", "proxy-c", ttl_s=30)
    other.append("r1", 0, "run.finished", {"status": "succeeded"})  # the lease goes too
    assert store.orphans("proxy-a") == ["r2"] and store.claim("r2", "proxy-a", ttl_s=30)
    store.release("r2", "proxy-a")
    assert other.claim("r2", "proxy-b", ttl_s=30)


def test_one_of_two_racing_claimers_wins_an_expired_lease(open_db: Opener) -> None:
    stores = [open_db() for _ in range(4)]
    stores[0].create("r1", graph())
    assert stores[0].claim("r1", "dead", ttl_s=0.05)
    time.sleep(0.2)
    won: list[str] = []
    barrier = threading.Barrier(len(stores))

    def claim(i: int) -> None:
        barrier.wait()
        if stores[i].claim("r1", f"proxy-{i}", ttl_s=30):
            won.append(f"proxy-{i}")

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == (1 if stores[0].shared else len(stores))


def test_lease_epochs_fence_the_writes_of_a_proxy_that_lost_its_run(open_db: Opener) -> None:
    store, other = open_db(), open_db()
    store.create("r1", graph())
    mine = store.claim("r1", "proxy-a", ttl_s=0.2)
    assert mine is not None and mine >= 1
    assert store.claim("r1", "proxy-a", ttl_s=0.2) == mine  # a renewal keeps the epoch
    store.append("r1", 0, "run.started", {}, epoch=mine)
    if not store.shared:  # one proxy owns the file: nothing to fence
        store.append("r1", 1, "step.finished", {"step_id": "a", "value": 1}, epoch=mine + 7)
        assert len(store.load("r1").events) == 2  # type: ignore[union-attr]
        return
    time.sleep(0.4)  # proxy-a stalls past its lease; proxy-b takes the run over
    theirs = other.claim("r1", "proxy-b", ttl_s=30)
    assert theirs is not None and theirs > mine
    with pytest.raises(LeaseLost, match="another proxy"):  # proxy-a wakes up and writes
        store.append("r1", 1, "step.finished", {"step_id": "a", "value": "stale"}, epoch=mine)
    with pytest.raises(LeaseLost):  # run.finished too: the status stays
        store.append("r1", 1, "run.finished", {"status": "succeeded"}, epoch=mine)
    assert store.problem() is None  # the refused write left the store usable
    run = other.load("r1")
    assert run is not None and run.status == "running" and run.outputs() == {}
    other.append("r1", 1, "step.finished", {"step_id": "a", "value": "fresh"}, epoch=theirs)
    other.release("r1", "proxy-b")  # no lease at all: a stale epoch is still refused
    with pytest.raises(LeaseLost):
        store.append("r1", 2, "step.finished", {"step_id": "b", "value": "x"}, epoch=theirs)
    again = store.claim("r1", "proxy-a", ttl_s=30)
    assert again is not None and again > theirs  # a new grant: a new, greater epoch
    store.append("r1", 2, "run.finished", {"status": "succeeded"}, epoch=again)
    done = other.load("r1")
    assert done is not None and done.status == "succeeded"
    assert done.outputs() == {"a": "fresh"} and len(done.events) == 3


def test_a_tool_result_is_kept_once_for_whichever_proxy_runs_the_step(
        open_db: Opener) -> None:
    store, other = open_db(), open_db()
    store.create("r1", graph())
    assert other.put_tool_result("r1", "lookup", {"value": {"n": 1}})
    assert not store.put_tool_result("r1", "lookup", {"value": "second"})  # first wins
    assert other.put_tool_result("r1", "agent:call_1", {"error": "ValueError: no"})
    assert store.tool_results("r1", ["lookup", "agent:call_1", "other"]) == {
        "lookup": {"value": {"n": 1}}, "agent:call_1": {"error": "ValueError: no"}}
    assert store.tool_results("r1", ["other"]) == {} and store.tool_results("r1", []) == {}
    store.append("r1", 0, "run.finished", {"status": "succeeded"})
    assert store.prune(older_than_s=-1) == 1
    assert store.tool_results("r1", ["lookup"]) == {}  # forgotten with the run


def test_follows_marked_by_one_proxy_are_seen_by_another(open_db: Opener) -> None:
    store, other = open_db(), open_db()
    for rid in ("r1", "r2"):
        store.create(rid, graph())
    other.mark_followed(["r1"])
    other.mark_followed([])
    seen = store.followed(["r1", "r2"], within_s=30)
    if not store.shared:  # one proxy: its own listeners are all there are
        assert seen == set()
        return
    assert seen == {"r1"}
    time.sleep(0.3)
    assert store.followed(["r1", "r2"], within_s=0.2) == set()  # an old mark
    other.mark_followed(["r1", "r2"])
    assert store.followed(["r1", "r2"], within_s=0.2) == {"r1", "r2"}


def test_requests_kept_for_a_runs_owner_come_back_in_order_until_dropped(
        open_db: Opener) -> None:
    store, other = open_db(), open_db()
    for rid in ("r1", "r2"):
        store.create(rid, graph())
    first = other.put_request("r1", "nodes", {"nodes": [{"id": "b"}]})
    store.put_request("r2", "close", {})
    second = other.put_request("r1", "close", {})
    assert second > first
    assert store.requests(["r1"]) == [(first, "r1", "nodes", {"nodes": [{"id": "b"}]}),
                                      (second, "r1", "close", {})]
    assert [k for _, _, k, _ in store.requests(["r1", "r2"])] == ["nodes", "close", "close"]
    store.drop_requests([first])
    store.drop_requests([])
    assert [i for i, _, _, _ in other.requests(["r1"])] == [second] and store.requests([]) == []
    store.append("r1", 0, "run.finished", {"status": "succeeded"})
    store.prune(older_than_s=-1)
    assert store.requests(["r1"]) == [] and len(store.requests(["r2"])) == 1


def test_stored_responses_round_trip_expire_delete_and_stay_bounded(open_db: Opener) -> None:
    from flowlift.proxy.store.base import StoredResponse

    store, now = open_db(), time.time()
    body = {"response": {"id": "resp_1"}, "messages": [{"role": "user", "content": "hé"}]}
    for i in range(4):
        store.put_response(f"resp_{i}", StoredResponse("acme", "resp_0", body, now + i,
                                                       now + 60))
    store.put_response("old", StoredResponse(None, "old", body, now - 10, now - 1))
    assert open_db().get_response("resp_1") == StoredResponse("acme", "resp_0", body,
                                                              now + 1, now + 60)
    assert store.get_response("old") is None  # expired: gone to readers at once
    assert store.delete_response("resp_3") and not store.delete_response("resp_3")
    assert store.prune_responses(keep=2) == 2  # the expired one and the oldest live one
    assert [store.get_response(f"resp_{i}") is not None for i in range(3)] == [
        False, True, True]
