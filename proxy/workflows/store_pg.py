"""Durable runs in PostgreSQL: the run store several proxies can share (``--state-db
postgresql://user@host/db``).

The same event-sourced log as :class:`~flowlift.proxy.workflows.store.SQLiteRunStore`,
in tables prefixed ``flowlift_`` (so the database may hold other things)::

    flowlift_meta(key PRIMARY KEY, value)            -- ('schema_version', '1')
    flowlift_runs(run_id PRIMARY KEY, graph TEXT, name TEXT, status TEXT,
                  created_at DOUBLE PRECISION, updated_at DOUBLE PRECISION)
    flowlift_events(run_id, seq, name, data TEXT, PRIMARY KEY (run_id, seq))
    flowlift_leases(run_id PRIMARY KEY, owner TEXT, expires_at DOUBLE PRECISION,
                    epoch BIGINT)                   -- the fencing token
    flowlift_tool_results(run_id, step_id, body TEXT, PRIMARY KEY (run_id, step_id))
    flowlift_follows(run_id PRIMARY KEY, at DOUBLE PRECISION)  -- a replica tails it
    flowlift_requests(id BIGSERIAL PRIMARY KEY, run_id, kind TEXT, body TEXT)

**Ownership.** A run is executed by one proxy at a time: the one holding its lease
(``flowlift_leases``: owner, expiry in epoch s of the *database's* clock, so proxies'
clocks need not agree). The proxy claims a run as it creates or resumes it and renews
all its leases every third of the lease's time (the heartbeat,
:meth:`~flowlift.proxy.workflows.registry.RunRegistry.heartbeat`); a proxy that dies
stops renewing, and once its leases expire another proxy claims the runs and resumes
them from the log (nothing finished runs again). A claim is one ``INSERT ... ON CONFLICT
DO UPDATE ... WHERE`` (the holder's lease expired, or it is the claimer's): the row lock
makes two claimers of one expired lease agree on one winner.

**Fencing.** Each grant of a lease to a new owner draws a new ``epoch`` from the sequence
``flowlift_lease_epochs`` (a renewal by the same owner keeps it); ``claim`` returns it and
the owner passes it with every ``append``. An append inserts only while the lease row
still carries that epoch, reading the row ``FOR SHARE`` so a concurrent claim waits for
the append's commit (a taker-over that loads the run after its claim sees every event
the old owner wrote, and the old owner can write none after). A proxy that stalled past
its lease's expiry and wakes up after another took the run gets
:class:`~flowlift.errors.LeaseLost` from its first write, before any client sees the
event, and stops the run. This is Kleppmann's fencing token ("How to do distributed
locking", 2016) with the database as the resource that checks it.

**Tool results.** ``POST .../steps/{step}/result`` may reach any replica: it is stored
in ``flowlift_tool_results`` (the first post wins; a second is a no-op) and the run's
owner, or whoever takes the run over, consumes it once: the step's ``step.finished``
(a tool step) or ``tool.result`` (an agent's call) event, fenced as above, is the record
that it was consumed. **Follows.** A replica that streams a run it does not execute
(events tailed from the store) marks it in ``flowlift_follows``; the owner counts such a
follow as a listener (a parked run starts, the sweep leaves it alone). **Requests.** An
open run's appends and close posted to a replica that does not execute it wait in
``flowlift_requests`` for the owner, which applies them in order (an append of nodes the
run holds already is skipped, a second close is a no-op, so applying one twice is
harmless) and then drops them.

Graphs and events are stored as the JSON text the proxy wrote (not ``jsonb``), so a run
reads back byte for byte as it went in. The schema is created on first use under an
advisory lock (two proxies starting together do not race).

Synchronous psycopg 3, as the SQLite store is synchronous: the run's event sink
(:class:`~flowlift.proxy.workflows.runs.Run`) calls ``append`` from the event loop and
the event must be committed before the run goes on, so each call blocks the loop for one
round trip to the database (a fraction of a millisecond on a local network). Connections
come from a :class:`psycopg_pool.ConnectionPool` (autocommit; a connection broken by a
database restart is dropped and replaced), and every write commits before it returns
(``synchronous_commit`` as the server sets it: on by default, so committed means on disk).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from flowlift.errors import EngineError, LeaseLost
from flowlift.proxy.tenants import DEFAULT_TENANT
from flowlift.proxy.workflows.store import SCHEMA_VERSION, RunSummary, StoredResponse, StoredRun
from flowlift.tracing import get_logger

log = get_logger("flowlift.runs")

SCHEMA_LOCK_KEY = 0x666C6F77  # pg_advisory_xact_lock key of the schema creation ("flow")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS flowlift_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS flowlift_runs (run_id TEXT PRIMARY KEY, graph TEXT NOT NULL,
    name TEXT NOT NULL, status TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL, tenant TEXT);
ALTER TABLE flowlift_runs ADD COLUMN IF NOT EXISTS tenant TEXT;
CREATE TABLE IF NOT EXISTS flowlift_events (run_id TEXT NOT NULL, seq INTEGER NOT NULL,
    name TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (run_id, seq));
CREATE INDEX IF NOT EXISTS flowlift_runs_by_status ON flowlift_runs (status, updated_at);
CREATE INDEX IF NOT EXISTS flowlift_runs_by_created ON flowlift_runs (created_at, run_id);
CREATE TABLE IF NOT EXISTS flowlift_leases (run_id TEXT PRIMARY KEY, owner TEXT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL);
CREATE SEQUENCE IF NOT EXISTS flowlift_lease_epochs;
ALTER TABLE flowlift_leases ADD COLUMN IF NOT EXISTS epoch BIGINT NOT NULL
    DEFAULT nextval('flowlift_lease_epochs');  -- (leases of an older schema get theirs)
CREATE TABLE IF NOT EXISTS flowlift_tool_results (run_id TEXT NOT NULL,
    step_id TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, step_id));
CREATE TABLE IF NOT EXISTS flowlift_follows (run_id TEXT PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS flowlift_requests (id BIGSERIAL PRIMARY KEY,
    run_id TEXT NOT NULL, kind TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS flowlift_responses (id TEXT PRIMARY KEY, tenant TEXT,
    conversation TEXT NOT NULL, body TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL);
CREATE INDEX IF NOT EXISTS flowlift_responses_by_created ON flowlift_responses (created_at);
"""
_NOW = "extract(epoch from clock_timestamp())"  # the database's clock, epoch s
_CLAIM = f"""
INSERT INTO flowlift_leases AS held (run_id, owner, expires_at, epoch)
VALUES (%s, %s, {_NOW} + %s, nextval('flowlift_lease_epochs'))
ON CONFLICT (run_id) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at,
    epoch = CASE WHEN held.owner = excluded.owner THEN held.epoch ELSE excluded.epoch END
WHERE held.owner = excluded.owner OR held.expires_at < {_NOW}
RETURNING epoch
"""
_APPEND = """
INSERT INTO flowlift_events SELECT %(run)s, %(seq)s, %(name)s, %(data)s
WHERE %(epoch)s::bigint IS NULL OR EXISTS (SELECT 1 FROM flowlift_leases
    WHERE run_id = %(run)s AND epoch = %(epoch)s FOR SHARE)
ON CONFLICT (run_id, seq) DO UPDATE SET name = excluded.name, data = excluded.data
"""


def redact(url: str) -> str:
    """``url`` without its password (for messages and ``path``): ``postgresql://u:pw@h/db``
    -> ``postgresql://u@h/db``; a conninfo's ``password=...`` -> ``password=***``."""
    url = re.sub(r"(://[^/@:]*):[^/@]*@", r"\1@", url)
    url = re.sub(r"([?&]password=)[^&]*", r"\1***", url)
    return re.sub(r"(password\s*=\s*)\S+", r"\1***", url)


def check_reachable(url: str, timeout_s: float) -> None:
    """One connection attempt, so that an unreachable server is reported with its own
    reason at once (a pool retries until its timeout and says only that it timed out).

    Raises:
        psycopg.Error: the server cannot be reached or refuses the connection.
    """
    with psycopg.connect(url, connect_timeout=max(1, round(timeout_s))):
        return


class PostgresRunStore:
    """Persistence of runs in a PostgreSQL database (see the module docstring).

    Args:
        url: a libpq URL or conninfo (``postgresql://user:pw@host:5432/db``).
        connect_timeout_s: how long opening waits for the first connection.
        max_connections: the pool's bound (the proxy's loop uses one at a time).

    Raises:
        EngineError: the server cannot be reached, refuses us, or holds a newer schema
            (the message names the URL without its password).
    """

    def __init__(self, url: str, *, connect_timeout_s: float = 10.0,
                 max_connections: int = 4) -> None:
        self._url = url
        self.path = redact(url)
        try:
            check_reachable(url, connect_timeout_s)
            self._pool: ConnectionPool[psycopg.Connection[tuple[Any, ...]]] = ConnectionPool(
                url, min_size=1, max_size=max_connections, open=False,
                kwargs={"autocommit": True}, name="flowlift-runs")
        except psycopg.Error as exc:  # unreachable, refused, a malformed URL
            raise EngineError(f"cannot open the run store {self.path}: {exc}") from exc
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
            self._create_schema()
        except (psycopg.Error, PoolTimeout) as exc:
            self._pool.close()
            raise EngineError(f"cannot open the run store {self.path}: {exc}") from exc

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
        with self._pool.connection() as conn:
            yield conn

    def _create_schema(self) -> None:
        with self._conn() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
            conn.execute(_SCHEMA)
            conn.execute("INSERT INTO flowlift_meta VALUES ('schema_version', %s) "
                         "ON CONFLICT (key) DO NOTHING", (str(SCHEMA_VERSION),))
            row = conn.execute("SELECT value FROM flowlift_meta "
                               "WHERE key = 'schema_version'").fetchone()
        if row is None or int(row[0]) > SCHEMA_VERSION:
            raise EngineError(f"the run store {self.path} has schema version "
                              f"{row and row[0]}, newer than this flowlift's {SCHEMA_VERSION}")

    def create(self, run_id: str, graph: dict[str, Any], tenant: str | None = None) -> None:
        now = time.time()
        with self._conn() as conn:
            conn.execute("INSERT INTO flowlift_runs (run_id, graph, name, status, created_at, "
                         "updated_at, tenant) VALUES (%s, %s, %s, 'running', %s, %s, %s)",
                         (run_id, json.dumps(graph), str(graph.get("name") or ""), now, now,
                          tenant))

    def append(self, run_id: str, seq: int, name: str, data: dict[str, Any],
               epoch: int | None = None) -> None:
        """Store event ``seq`` (see :meth:`RunStoreProtocol.append`), fenced by ``epoch``.

        Raises:
            LeaseLost: ``epoch`` is not the run's lease's any more (nothing was written).
        """
        with self._conn() as conn, conn.transaction():
            if conn.execute(_APPEND, {"run": run_id, "seq": seq, "name": name,
                                      "data": json.dumps(data), "epoch": epoch}).rowcount != 1:
                raise LeaseLost(f"run {run_id}: its lease is no longer epoch {epoch} (another "
                                f"proxy took the run over); event {seq} was not written")
            if name == "run.finished":  # (its lease goes with it: nothing left to own)
                conn.execute("UPDATE flowlift_runs SET status = %s, updated_at = %s "
                             "WHERE run_id = %s",
                             (data.get("status", "finished"), time.time(), run_id))
                conn.execute("DELETE FROM flowlift_leases WHERE run_id = %s", (run_id,))

    def exists(self, run_id: str) -> bool:
        with self._conn() as conn:
            return conn.execute("SELECT 1 FROM flowlift_runs WHERE run_id = %s",
                                (run_id,)).fetchone() is not None

    def load(self, run_id: str) -> StoredRun | None:
        with self._conn() as conn:
            row = conn.execute("SELECT graph, status, tenant FROM flowlift_runs "
                               "WHERE run_id = %s", (run_id,)).fetchone()
            if row is None:
                return None
            events = [(seq, name, json.loads(data)) for seq, name, data in conn.execute(
                "SELECT seq, name, data FROM flowlift_events WHERE run_id = %s ORDER BY seq",
                (run_id,))]
        return StoredRun(run_id, json.loads(row[0]), row[1], events, row[2])

    def recent(self, *, status: str | None = None, name: str | None = None, limit: int = 20,
               after: str | None = None, since: float | None = None,
               tenant: str | None = None) -> tuple[list[RunSummary], bool]:
        """Runs, newest first, with ``status`` and ``name`` (the graph's) when given,
        created at or after ``since`` (epoch s); ``after``: the id of the last run of the
        previous page (an id the store does not hold starts from the newest);
        ``tenant``: only the runs it may see (None: every run).

        Returns:
            Up to ``limit`` runs and whether more follow.
        """
        where: list[str] = ["TRUE"]
        params: list[Any] = []
        for column, value in (("status = %s", status), ("name = %s", name),
                              ("created_at >= %s", since)):
            if value is not None:
                where.append(column)
                params.append(value)
        if tenant is not None:
            where.append("coalesce(tenant, %s) = %s")
            params += [DEFAULT_TENANT, tenant]
        with self._conn() as conn:
            cursor = None if after is None else conn.execute(  # (a run it may see)
                "SELECT created_at, run_id FROM flowlift_runs WHERE run_id = %s AND "
                "(%s::text IS NULL OR coalesce(tenant, %s) = %s)",
                (after, tenant, DEFAULT_TENANT, tenant)).fetchone()
            if cursor is not None:
                where.append("(created_at, run_id) < (%s, %s)")
                params += [cursor[0], cursor[1]]
            rows = conn.execute(
                "SELECT run_id, name, status, created_at, updated_at FROM flowlift_runs "
                f"WHERE {' AND '.join(where)} ORDER BY created_at DESC, run_id DESC "
                "LIMIT %s", (*params, limit + 1)).fetchall()
        return [RunSummary(*row) for row in rows[:limit]], len(rows) > limit

    def unfinished(self) -> list[StoredRun]:
        with self._conn() as conn:
            ids = [r[0] for r in conn.execute(
                "SELECT run_id FROM flowlift_runs WHERE status = 'running' "
                "ORDER BY created_at, run_id")]
        return [run for rid in ids if (run := self.load(rid)) is not None]

    def prune(self, older_than_s: float, keep: int | None = None) -> int:
        """Forget finished runs last updated more than ``older_than_s`` ago and, with
        ``keep``, all but the ``keep`` most recently finished. Runs still running are
        never pruned.

        Returns:
            How many runs were forgotten.
        """
        cutoff = time.time() - older_than_s
        with self._conn() as conn, conn.transaction():
            ids = [r[0] for r in conn.execute(
                "SELECT run_id FROM flowlift_runs WHERE status != 'running' "
                "AND updated_at < %s", (cutoff,))]
            if keep is not None:
                ids += [r[0] for r in conn.execute(
                    "SELECT run_id FROM flowlift_runs WHERE status != 'running' "
                    "AND updated_at >= %s ORDER BY updated_at DESC, run_id DESC OFFSET %s",
                    (cutoff, keep))]
            if ids:
                for table in ("flowlift_leases", "flowlift_tool_results", "flowlift_follows",
                              "flowlift_requests"):
                    conn.execute(f"DELETE FROM {table} WHERE run_id = ANY(%s)", (ids,))
                conn.execute("DELETE FROM flowlift_events WHERE run_id = ANY(%s)", (ids,))
                conn.execute("DELETE FROM flowlift_runs WHERE run_id = ANY(%s)", (ids,))
        return len(ids)

    def problem(self) -> str | None:
        """Why the store cannot take writes now (closed, unreachable), or None."""
        try:
            with self._pool.connection(timeout=2.0) as conn:
                conn.execute("SELECT 1 FROM flowlift_runs LIMIT 1").fetchall()
        except (psycopg.Error, PoolTimeout) as exc:
            return f"{self.path}: {exc}"
        return None

    def close(self) -> None:
        self._pool.close()

    # -- ownership (see the module docstring) -----------------------------------------
    shared = True

    def claim(self, run_id: str, owner: str, ttl_s: float) -> int | None:
        with self._conn() as conn:
            row = conn.execute(_CLAIM, (run_id, owner, ttl_s)).fetchone()
        return None if row is None else int(row[0])

    def renew(self, owner: str, run_ids: Collection[str], ttl_s: float) -> set[str]:
        if not run_ids:
            return set()
        with self._conn() as conn:
            return {r[0] for r in conn.execute(
                f"UPDATE flowlift_leases SET expires_at = {_NOW} + %s "
                "WHERE owner = %s AND run_id = ANY(%s) RETURNING run_id",
                (ttl_s, owner, list(run_ids)))}

    def release(self, run_id: str, owner: str) -> None:
        """Best effort: a lease this cannot release (the store closed, the database
        away) expires by itself."""
        try:
            with self._conn() as conn:
                conn.execute("DELETE FROM flowlift_leases WHERE run_id = %s AND owner = %s",
                             (run_id, owner))
        except psycopg.Error as exc:  # (PoolClosed, PoolTimeout are psycopg errors too)
            log.warning("run_lease_not_released", workflow_id=run_id, error=str(exc))

    def orphans(self, owner: str) -> list[str]:
        with self._conn() as conn:
            return [r[0] for r in conn.execute(
                "SELECT r.run_id FROM flowlift_runs r LEFT JOIN flowlift_leases l "
                "ON l.run_id = r.run_id WHERE r.status = 'running' AND (l.run_id IS NULL "
                f"OR l.owner = %s OR l.expires_at < {_NOW}) ORDER BY r.created_at, r.run_id",
                (owner,))]

    # -- tool results posted to any replica; follows from other replicas ---------------
    def put_tool_result(self, run_id: str, step_id: str, body: dict[str, Any]) -> bool:
        with self._conn() as conn:
            return conn.execute(
                "INSERT INTO flowlift_tool_results VALUES (%s, %s, %s) "
                "ON CONFLICT (run_id, step_id) DO NOTHING",
                (run_id, step_id, json.dumps(body))).rowcount == 1

    def tool_results(self, run_id: str, step_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        if not step_ids:
            return {}
        with self._conn() as conn:
            return {r[0]: json.loads(r[1]) for r in conn.execute(
                "SELECT step_id, body FROM flowlift_tool_results WHERE run_id = %s "
                "AND step_id = ANY(%s)", (run_id, list(step_ids)))}

    def mark_followed(self, run_ids: Collection[str]) -> None:
        if not run_ids:
            return
        with self._conn() as conn:
            conn.execute(f"INSERT INTO flowlift_follows SELECT unnest(%s::text[]), {_NOW} "
                         "ON CONFLICT (run_id) DO UPDATE SET at = excluded.at",
                         (sorted(run_ids),))

    def followed(self, run_ids: Collection[str], within_s: float) -> set[str]:
        if not run_ids:
            return set()
        with self._conn() as conn:
            return {r[0] for r in conn.execute(
                "SELECT run_id FROM flowlift_follows WHERE run_id = ANY(%s) "
                f"AND at >= {_NOW} - %s", (list(run_ids), within_s))}

    def put_request(self, run_id: str, kind: str, body: dict[str, Any]) -> int:
        with self._conn() as conn:
            row = conn.execute("INSERT INTO flowlift_requests (run_id, kind, body) "
                               "VALUES (%s, %s, %s) RETURNING id",
                               (run_id, kind, json.dumps(body))).fetchone()
        assert row is not None  # (RETURNING of an insert)
        return int(row[0])

    def requests(self, run_ids: Collection[str]) -> list[tuple[int, str, str, dict[str, Any]]]:
        if not run_ids:
            return []
        with self._conn() as conn:
            return [(int(i), run, kind, json.loads(body)) for i, run, kind, body in conn.execute(
                "SELECT id, run_id, kind, body FROM flowlift_requests WHERE run_id = ANY(%s) "
                "ORDER BY id", (list(run_ids),))]

    def drop_requests(self, ids: Collection[int]) -> None:
        if ids:
            with self._conn() as conn:
                conn.execute("DELETE FROM flowlift_requests WHERE id = ANY(%s)", (list(ids),))

    def put_response(self, response_id: str, row: StoredResponse) -> None:
        with self._conn() as conn:
            conn.execute(
                "INSERT INTO flowlift_responses VALUES (%s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (id) DO UPDATE SET tenant = excluded.tenant, "
                "conversation = excluded.conversation, body = excluded.body, "
                "created_at = excluded.created_at, expires_at = excluded.expires_at",
                (response_id, row.tenant, row.conversation, json.dumps(row.body),
                 row.created_at, row.expires_at))

    def get_response(self, response_id: str) -> StoredResponse | None:
        with self._conn() as conn:
            found = conn.execute(
                "SELECT tenant, conversation, body, created_at, expires_at FROM "
                "flowlift_responses WHERE id = %s AND expires_at > %s",
                (response_id, time.time())).fetchone()
        if found is None:
            return None
        tenant, conversation, body, created, expires = found
        return StoredResponse(tenant, conversation, json.loads(body), created, expires)

    def delete_response(self, response_id: str) -> bool:
        with self._conn() as conn:
            return conn.execute("DELETE FROM flowlift_responses WHERE id = %s",
                                (response_id,)).rowcount == 1

    def prune_responses(self, keep: int) -> int:
        with self._conn() as conn:
            gone = conn.execute("DELETE FROM flowlift_responses WHERE expires_at <= %s",
                                (time.time(),)).rowcount
            return gone + conn.execute(
                "DELETE FROM flowlift_responses WHERE id IN (SELECT id FROM "
                "flowlift_responses ORDER BY created_at DESC OFFSET %s)", (keep,)).rowcount
