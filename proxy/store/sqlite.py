"""Durable runs: every run's graph and event log, in SQLite or PostgreSQL.

The event log is the run's state (event sourcing): finished outputs are its
``step.finished`` events, failures its ``step.failed`` events. A proxy that restarts
reads the runs that never finished, rebuilds their state from the log and resumes
them; nothing that finished is run again.

Tables::

    runs(run_id PRIMARY KEY, graph TEXT, status TEXT, created_at REAL, updated_at REAL,
         tenant TEXT)   -- NULL: recorded without a tenant (see flowlift.proxy.tenants);
                        -- run_id: the run's key, tenants.run_key ("<tenant>/<id>")
    events(run_id, seq, name, data TEXT, PRIMARY KEY (run_id, seq))
    tool_results(run_id, step_id, body TEXT, PRIMARY KEY (run_id, step_id))
    requests(id INTEGER PRIMARY KEY, run_id, kind TEXT, body TEXT)  -- for its owner
    responses(id PRIMARY KEY, tenant TEXT, conversation TEXT, body TEXT, created_at REAL,
              expires_at REAL)  -- stored Responses API turns (flowlift.proxy.openai.responses)

The contract every store keeps is
:class:`~flowlift.proxy.store.base.RunStoreProtocol` (tests/test_store_contract.py runs
one suite over both); :func:`~flowlift.proxy.store.location.open_store` picks the store
from ``--state-db``: a ``postgresql://`` (or ``postgres://``) URL opens a
:class:`~flowlift.proxy.store.postgres.PostgresRunStore` (several proxies on one
database), anything else a :class:`SQLiteRunStore` file (``":memory:"``: none).

SQLite: one connection, WAL journal, autocommit; writes are small and synchronous (each
``create`` and ``append`` is committed before it returns, so an event is in the
database before any client hears of it; ``synchronous=NORMAL``: it survives the proxy's
crash, the OS's crash may lose the last commits). Schema version: ``PRAGMA user_version``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from flowlift.errors import EngineError
from flowlift.proxy.store.base import (
    SCHEMA_VERSION,
    RunSummary,
    StoredResponse,
    StoredRun,
    per_tenant_keys,
)
from flowlift.proxy.store.wakeups import Wakeups
from flowlift.proxy.tenants import DEFAULT_TENANT

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, graph TEXT NOT NULL,
    status TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (run_id TEXT NOT NULL, seq INTEGER NOT NULL,
    name TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (run_id, seq));
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status, updated_at);
CREATE TABLE IF NOT EXISTS tool_results (run_id TEXT NOT NULL, step_id TEXT NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (run_id, step_id));
CREATE TABLE IF NOT EXISTS requests (id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL, kind TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, tenant TEXT,
    conversation TEXT NOT NULL, body TEXT NOT NULL, created_at REAL NOT NULL,
    expires_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS responses_by_created ON responses (created_at);
"""
_MIGRATIONS = (("tenant", "ALTER TABLE runs ADD COLUMN tenant TEXT"),)
"""Columns added since the first schema: (column, statement adding it to an older file)."""
class SQLiteRunStore:
    """SQLite persistence of runs (``path=":memory:"`` for a store that dies with the
    process).

    Raises:
        EngineError: when the database cannot be opened (the message names the path).
    """

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None,
                                       check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(runs)")}
            for column, statement in _MIGRATIONS:
                if column not in columns:
                    self._db.execute(statement)
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema version {version} is newer than this "
                                            f"flowlift's {SCHEMA_VERSION}")
            if version < 2:
                self._per_tenant_keys()
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except (sqlite3.Error, OSError) as exc:  # OSError: its folder cannot be made
            raise EngineError(f"cannot open the run store {self.path}: {exc}") from exc

    def _per_tenant_keys(self) -> None:
        """Migration 1 -> 2 (:func:`per_tenant_keys`), in one transaction."""
        self._db.create_function("strpos", 2, lambda s, sub: s.find(sub) + 1,
                                 deterministic=True)
        with self._db:
            self._db.execute("BEGIN")
            for statement in per_tenant_keys("runs", ("events", "tool_results", "requests"),
                                             "?"):
                self._db.execute(statement, (DEFAULT_TENANT,))

    def create(self, run_id: str, graph: dict[str, Any], tenant: str | None = None,
               owner: str | None = None, ttl_s: float = 0.0) -> None:
        """Store a new run (``owner``, ``ttl_s``: unused; one proxy owns the file)."""
        now = time.time()
        self._db.execute("INSERT INTO runs (run_id, graph, status, created_at, updated_at, "
                         "tenant) VALUES (?, ?, 'running', ?, ?, ?)",
                         (run_id, json.dumps(graph), now, now, tenant))

    def append(self, run_id: str, seq: int, name: str, data: dict[str, Any],
               epoch: int | None = None) -> None:
        """Store event ``seq`` (``epoch``: unused; one proxy owns the file)."""
        self._db.execute("INSERT OR REPLACE INTO events VALUES (?, ?, ?, ?)",
                         (run_id, seq, name, json.dumps(data)))
        if name == "run.finished":
            self._db.execute("UPDATE runs SET status = ?, updated_at = ? WHERE run_id = ?",
                             (data.get("status", "finished"), time.time(), run_id))

    def exists(self, run_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM runs WHERE run_id = ?",
                                (run_id,)).fetchone() is not None

    def load(self, run_id: str) -> StoredRun | None:
        row = self._db.execute("SELECT graph, status, tenant FROM runs WHERE run_id = ?",
                               (run_id,)).fetchone()
        if row is None:
            return None
        events = [(seq, name, json.loads(data)) for seq, name, data in self._db.execute(
            "SELECT seq, name, data FROM events WHERE run_id = ? ORDER BY seq", (run_id,))]
        return StoredRun(run_id, json.loads(row[0]), row[1], events, row[2])

    def recent(self, *, status: str | None = None, name: str | None = None, limit: int = 20,
             after: str | None = None, since: float | None = None,
             tenant: str | None = None) -> tuple[list[RunSummary], bool]:
        """Runs, newest first, with ``status`` and ``name`` (the graph's) when given,
        created at or after ``since`` (epoch s); ``after``: the id of the last run of the
        previous page (an id the store does not hold starts from the newest);
        ``tenant``: only the runs it may see (:func:`flowlift.proxy.tenants.visible`;
        None: every run).

        Returns:
            Up to ``limit`` runs and whether more follow.
        """
        where: list[str] = ["1 = 1"]
        params: list[Any] = []
        if status is not None:
            where.append("status = ?")
            params.append(status)
        if name is not None:
            where.append("json_extract(graph, '$.name') = ?")
            params.append(name)
        if since is not None:
            where.append("created_at >= ?")
            params.append(since)
        if tenant is not None:
            where.append("coalesce(tenant, ?) = ?")
            params += [DEFAULT_TENANT, tenant]
        cursor = None if after is None else self._db.execute(  # (a run it may see)
            "SELECT created_at, run_id FROM runs WHERE run_id = ? AND (? IS NULL OR "
            "coalesce(tenant, ?) = ?)", (after, tenant, DEFAULT_TENANT, tenant)).fetchone()
        if cursor is not None:
            where.append("(created_at < ? OR (created_at = ? AND run_id < ?))")
            params += [cursor[0], cursor[0], cursor[1]]
        rows = self._db.execute(
            "SELECT run_id, coalesce(json_extract(graph, '$.name'), ''), status, created_at, "
            f"updated_at FROM runs WHERE {' AND '.join(where)} "
            "ORDER BY created_at DESC, run_id DESC LIMIT ?", (*params, limit + 1)).fetchall()
        return [RunSummary(*row) for row in rows[:limit]], len(rows) > limit

    def unfinished(self) -> list[StoredRun]:
        ids = [r[0] for r in self._db.execute(
            "SELECT run_id FROM runs WHERE status = 'running' ORDER BY created_at")]
        return [run for rid in ids if (run := self.load(rid)) is not None]

    def prune(self, older_than_s: float, keep: int | None = None) -> int:
        """Forget finished runs last updated more than ``older_than_s`` ago and, with
        ``keep``, all but the ``keep`` most recently finished (so a stream of unique runs
        cannot grow the store without bound). Runs still running are never pruned.

        Returns:
            How many runs were forgotten.
        """
        cutoff = time.time() - older_than_s
        ids = [r[0] for r in self._db.execute(
            "SELECT run_id FROM runs WHERE status != 'running' AND updated_at < ?", (cutoff,))]
        if keep is not None:
            ids += [r[0] for r in self._db.execute(
                "SELECT run_id FROM runs WHERE status != 'running' AND updated_at >= ? "
                "ORDER BY updated_at DESC LIMIT -1 OFFSET ?", (cutoff, keep))]
        for rid in ids:
            self._db.execute("DELETE FROM events WHERE run_id = ?", (rid,))
            self._db.execute("DELETE FROM tool_results WHERE run_id = ?", (rid,))
            self._db.execute("DELETE FROM requests WHERE run_id = ?", (rid,))
            self._db.execute("DELETE FROM runs WHERE run_id = ?", (rid,))
        return len(ids)

    def problem(self) -> str | None:
        """Why the store cannot take writes now (closed, unreadable), or None."""
        try:
            self._db.execute("SELECT 1 FROM runs LIMIT 1").fetchall()
        except sqlite3.Error as exc:
            return f"{self.path}: {exc}"
        return None

    def close(self) -> None:
        self._db.close()

    trouble = None  # (one file on this machine: a failure is no outage to wait out)

    def listener(self) -> Wakeups:
        return Wakeups()  # one proxy: nobody else writes, polling as before

    # -- ownership: one proxy owns a SQLite file, so every claim is granted ---------------
    shared = False

    def claim(self, run_id: str, owner: str, ttl_s: float) -> int | None:
        return 1  # one owner, one epoch: nothing to fence

    def renew(self, owner: str, run_ids: Collection[str], ttl_s: float) -> set[str]:
        return set(run_ids)

    def release(self, run_id: str, owner: str) -> None:
        return None

    def orphans(self, owner: str) -> list[str]:
        return [r[0] for r in self._db.execute(
            "SELECT run_id FROM runs WHERE status = 'running' ORDER BY created_at")]

    def put_tool_result(self, run_id: str, step_id: str, body: dict[str, Any]) -> bool:
        return self._db.execute("INSERT OR IGNORE INTO tool_results VALUES (?, ?, ?)",
                                (run_id, step_id, json.dumps(body))).rowcount == 1

    def tool_results(self, run_id: str, step_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        wanted = set(step_ids)
        if not wanted:
            return {}
        return {step: json.loads(body) for step, body in self._db.execute(
            "SELECT step_id, body FROM tool_results WHERE run_id = ?", (run_id,))
            if step in wanted}

    def mark_followed(self, run_ids: Collection[str]) -> None:
        return None  # one proxy: its own listeners are all there are

    def followed(self, run_ids: Collection[str], within_s: float) -> set[str]:
        return set()

    def put_request(self, run_id: str, kind: str, body: dict[str, Any]) -> int:
        cursor = self._db.execute("INSERT INTO requests (run_id, kind, body) VALUES (?, ?, ?)",
                                  (run_id, kind, json.dumps(body)))
        return int(cursor.lastrowid or 0)

    def requests(self, run_ids: Collection[str]) -> list[tuple[int, str, str, dict[str, Any]]]:
        wanted = set(run_ids)
        if not wanted:
            return []
        return [(rid, run, kind, json.loads(body)) for rid, run, kind, body in self._db.execute(
            "SELECT id, run_id, kind, body FROM requests ORDER BY id") if run in wanted]

    def drop_requests(self, ids: Collection[int]) -> None:
        self._db.executemany("DELETE FROM requests WHERE id = ?", [(i,) for i in ids])

    def put_response(self, response_id: str, row: StoredResponse) -> None:
        self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                         (response_id, row.tenant, row.conversation, json.dumps(row.body),
                          row.created_at, row.expires_at))

    def get_response(self, response_id: str) -> StoredResponse | None:
        found = self._db.execute(
            "SELECT tenant, conversation, body, created_at, expires_at FROM responses "
            "WHERE id = ? AND expires_at > ?", (response_id, time.time())).fetchone()
        if found is None:
            return None
        tenant, conversation, body, created, expires = found
        return StoredResponse(tenant, conversation, json.loads(body), created, expires)

    def delete_response(self, response_id: str) -> bool:
        return self._db.execute("DELETE FROM responses WHERE id = ?",
                                (response_id,)).rowcount == 1

    def prune_responses(self, keep: int) -> int:
        gone = self._db.execute("DELETE FROM responses WHERE expires_at <= ?",
                                (time.time(),)).rowcount
        return gone + self._db.execute(
            "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
            "ORDER BY created_at DESC LIMIT -1 OFFSET ?)", (keep,)).rowcount


RunStore = SQLiteRunStore
"""The SQLite store under its former name (callers that construct one)."""
