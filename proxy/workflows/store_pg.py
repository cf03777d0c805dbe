"""Durable runs in PostgreSQL: the run store several proxies can share (``--state-db
postgresql://user@host/db``).

The same event-sourced log as :class:`~flowlift.proxy.workflows.store.SQLiteRunStore`,
in tables prefixed ``flowlift_`` (so the database may hold other things)::

    flowlift_meta(key PRIMARY KEY, value)            -- ('schema_version', '1')
    flowlift_runs(run_id PRIMARY KEY, graph TEXT, name TEXT, status TEXT,
                  created_at DOUBLE PRECISION, updated_at DOUBLE PRECISION)
    flowlift_events(run_id, seq, name, data TEXT, PRIMARY KEY (run_id, seq))

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
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool, PoolTimeout

from flowlift.errors import EngineError
from flowlift.proxy.workflows.store import SCHEMA_VERSION, RunSummary, StoredRun

_LOCK_KEY = 0x666C6F77  # pg_advisory_xact_lock key of the schema creation ("flow")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS flowlift_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS flowlift_runs (run_id TEXT PRIMARY KEY, graph TEXT NOT NULL,
    name TEXT NOT NULL, status TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS flowlift_events (run_id TEXT NOT NULL, seq INTEGER NOT NULL,
    name TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (run_id, seq));
CREATE INDEX IF NOT EXISTS flowlift_runs_by_status ON flowlift_runs (status, updated_at);
CREATE INDEX IF NOT EXISTS flowlift_runs_by_created ON flowlift_runs (created_at, run_id);
"""


def redact(url: str) -> str:
    """``url`` without its password (for messages and ``path``)."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return url.split("@")[-1]
    params.pop("password", None)
    return make_conninfo("", **params)


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
        self._pool: ConnectionPool[psycopg.Connection[tuple[Any, ...]]] = ConnectionPool(
            url, min_size=1, max_size=max_connections, open=False,
            kwargs={"autocommit": True}, name="flowlift-runs")
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
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            conn.execute(_SCHEMA)
            conn.execute("INSERT INTO flowlift_meta VALUES ('schema_version', %s) "
                         "ON CONFLICT (key) DO NOTHING", (str(SCHEMA_VERSION),))
            row = conn.execute("SELECT value FROM flowlift_meta "
                               "WHERE key = 'schema_version'").fetchone()
        if row is None or int(row[0]) > SCHEMA_VERSION:
            raise EngineError(f"the run store {self.path} has schema version "
                              f"{row and row[0]}, newer than this flowlift's {SCHEMA_VERSION}")

    def create(self, run_id: str, graph: dict[str, Any]) -> None:
        now = time.time()
        with self._conn() as conn:
            conn.execute("INSERT INTO flowlift_runs VALUES (%s, %s, %s, 'running', %s, %s)",
                         (run_id, json.dumps(graph), str(graph.get("name") or ""), now, now))

    def append(self, run_id: str, seq: int, name: str, data: dict[str, Any]) -> None:
        with self._conn() as conn, conn.transaction():
            conn.execute("INSERT INTO flowlift_events VALUES (%s, %s, %s, %s) "
                         "ON CONFLICT (run_id, seq) DO UPDATE SET name = excluded.name, "
                         "data = excluded.data", (run_id, seq, name, json.dumps(data)))
            if name == "run.finished":
                conn.execute("UPDATE flowlift_runs SET status = %s, updated_at = %s "
                             "WHERE run_id = %s",
                             (data.get("status", "finished"), time.time(), run_id))

    def exists(self, run_id: str) -> bool:
        with self._conn() as conn:
            return conn.execute("SELECT 1 FROM flowlift_runs WHERE run_id = %s",
                                (run_id,)).fetchone() is not None

    def load(self, run_id: str) -> StoredRun | None:
        with self._conn() as conn:
            row = conn.execute("SELECT graph, status FROM flowlift_runs WHERE run_id = %s",
                               (run_id,)).fetchone()
            if row is None:
                return None
            events = [(seq, name, json.loads(data)) for seq, name, data in conn.execute(
                "SELECT seq, name, data FROM flowlift_events WHERE run_id = %s ORDER BY seq",
                (run_id,))]
        return StoredRun(run_id, json.loads(row[0]), row[1], events)

    def recent(self, *, status: str | None = None, name: str | None = None, limit: int = 20,
               after: str | None = None, since: float | None = None
               ) -> tuple[list[RunSummary], bool]:
        """Runs, newest first, with ``status`` and ``name`` (the graph's) when given,
        created at or after ``since`` (epoch s); ``after``: the id of the last run of the
        previous page (an id the store does not hold starts from the newest).

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
        with self._conn() as conn:
            cursor = None if after is None else conn.execute(
                "SELECT created_at, run_id FROM flowlift_runs WHERE run_id = %s",
                (after,)).fetchone()
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
