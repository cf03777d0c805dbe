"""Learned failure rates per (step name, model), persisted next to the run store.

Every llm step reports, for each model it tried, whether that model delivered the
output and how many attempts it took (:func:`flowlift.proxy.workflows.cascade.run_step`). The
counts live in one small SQLite table in the state database (``--state-db``), so they
survive restarts and the compiler's cascade estimate
(:mod:`flowlift.escalation`) gets better with every run::

    step_outcomes(step TEXT, model TEXT, items INTEGER, failures INTEGER,
                  attempts INTEGER, updated_at REAL, PRIMARY KEY (step, model))

Output lengths per (step, model) live beside them: the completion tokens of the last
:data:`KEEP_LENGTHS` outputs each step delivered (a JSON list), from which the compiler
takes the median (p50) as the step's expected output length (p90 is reported too)::

    step_output_tokens(step TEXT, model TEXT, tokens TEXT, updated_at REAL,
                       PRIMARY KEY (step, model))

Steps are keyed by their name (``@step`` function name, e.g. ``extract``), not their
id, so all items of a batch pool their counts; models by the name the graph uses
(``small``, ``large``), so two aliases of one served model keep separate rates.

On a PostgreSQL state database (``--state-db postgresql://...``) the same two tables,
prefixed ``flowlift_``, live in it: every proxy on the database adds to the counts (each
increment is atomic), so they learn together; each proxy reads them once at start, and
the output lengths are a last-writer-wins list (a proxy writes back the lengths it
holds). Outcome writes are advisory: one that fails is logged, never fails a step. They
run on a writer thread of their own, never on the proxy's event loop (the counts in
memory are updated at once): a database that restarts or drops off the network delays
them, not the proxy. What waits is coalesced, one row per (step, model): the increments
since the last write summed, the newest output lengths, so a burst of a thousand steps
is a few upserts and a slow database holds at most one pending row per key -- nothing is
dropped (a write that fails is kept and goes with the next one).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import sqlite3
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from flowlift.compiler import OutputLengths
from flowlift.errors import EngineError
from flowlift.escalation import OutcomeCounts
from flowlift.proxy.store.location import is_database_url
from flowlift.tracing import get_logger

log = get_logger("flowlift.outcomes")

KEEP_LENGTHS = 200


class _Dialect(NamedTuple):
    """The SQL of one database: ``{t}`` is the table prefix, ``?`` a parameter."""

    schema: str
    prefix: str
    real: str

    def sql(self, text: str) -> str:
        out = text.replace("{t}", self.prefix).replace("REAL", self.real)
        return out if self.prefix == "" else out.replace("?", "%s")


_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t}step_outcomes (step TEXT NOT NULL, model TEXT NOT NULL,
    items INTEGER NOT NULL, failures INTEGER NOT NULL, attempts INTEGER NOT NULL,
    updated_at REAL NOT NULL, PRIMARY KEY (step, model));
CREATE TABLE IF NOT EXISTS {t}step_output_tokens (step TEXT NOT NULL, model TEXT NOT NULL,
    tokens TEXT NOT NULL, updated_at REAL NOT NULL, PRIMARY KEY (step, model));
"""
_SQLITE = _Dialect(_SCHEMA, "", "REAL")
_POSTGRES = _Dialect(_SCHEMA, "flowlift_", "DOUBLE PRECISION")
_UPSERT = """
INSERT INTO {t}step_outcomes VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (step, model) DO UPDATE SET items = {t}step_outcomes.items + excluded.items,
    failures = {t}step_outcomes.failures + excluded.failures,
    attempts = {t}step_outcomes.attempts + excluded.attempts,
    updated_at = excluded.updated_at
"""
_UPSERT_TOKENS = """
INSERT INTO {t}step_output_tokens VALUES (?, ?, ?, ?)
ON CONFLICT (step, model) DO UPDATE SET tokens = excluded.tokens,
    updated_at = excluded.updated_at
"""


class _Database:
    """One SQLite connection, or a one-connection psycopg pool (reconnects after a
    database restart); ``errors``: the exceptions a failed statement raises."""

    def __init__(self, location: str) -> None:
        self.dialect = _POSTGRES if is_database_url(location) else _SQLITE
        self._sqlite: sqlite3.Connection | None = None
        if self.dialect is _POSTGRES:
            import psycopg
            from psycopg_pool import ConnectionPool

            from flowlift.proxy.store.postgres import check_reachable, with_defaults

            self.errors: tuple[type[Exception], ...] = (psycopg.Error,)  # (pool's too)
            location = with_defaults(location)  # (timeouts: no write waits forever)
            check_reachable(location, 10.0)
            self._pool: Any = ConnectionPool(location, min_size=1, max_size=1, open=False,
                                             kwargs={"autocommit": True},
                                             name="flowlift-outcomes", timeout=2.0,
                                             reconnect_timeout=1.0)
            try:
                self._pool.open(wait=True, timeout=10.0)
            except psycopg.Error:
                self._pool.close()
                raise
        else:
            self.errors = (sqlite3.Error, OSError)  # OSError: its folder cannot be made
            if location != ":memory:":
                Path(location).parent.mkdir(parents=True, exist_ok=True)
            self._sqlite = sqlite3.connect(location, isolation_level=None,
                                           check_same_thread=False, timeout=5.0)

    def _conn(self) -> AbstractContextManager[Any]:
        return self._pool.connection() if self._sqlite is None else _same(self._sqlite)

    def script(self, text: str) -> None:
        """Run a schema script; on PostgreSQL in one transaction under the run store's
        schema lock, so proxies starting together on a new database do not race on
        ``CREATE TABLE IF NOT EXISTS`` (which is not atomic there)."""
        with self._conn() as conn:
            if self._sqlite is None:
                from flowlift.proxy.store.postgres import SCHEMA_LOCK_KEY

                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
                    conn.execute(self.dialect.sql(text))
            else:
                conn.executescript(self.dialect.sql(text))

    def execute(self, text: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one statement (committed when it returns); its rows, if any."""
        with self._conn() as conn:
            cur = conn.execute(self.dialect.sql(text), params)
            return list(cur.fetchall()) if cur.description else []

    def close(self) -> None:
        if self._sqlite is None:
            self._pool.close()
        else:
            self._sqlite.close()


def _plus(counts: OutcomeCounts | None, items: int, failures: int,
          attempts: int) -> OutcomeCounts:
    """``counts`` (none: zero) with these added."""
    old = counts or OutcomeCounts()
    return OutcomeCounts(old.items + items, old.failures + failures, old.attempts + attempts)


def _shown(location: str) -> str:
    """``location`` as messages and logs show it (a URL without its password)."""
    if not is_database_url(location):
        return location
    from flowlift.proxy.store.postgres import redact

    return redact(location)


@contextmanager
def _same(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    yield conn


class StepOutcomes:
    """Counts per (step, model), read once at start and written through on each record.

    Args:
        path: the proxy's state database: a SQLite file, ``":memory:"`` or a
            ``postgresql://`` URL (the tables are then prefixed ``flowlift_``).
        default_model: the name recorded for steps that name no model.

    Raises:
        EngineError: when the database cannot be opened (the message names the path).
    """

    def __init__(self, path: str | Path = ":memory:", *, default_model: str | None = None
                 ) -> None:
        self.path = _shown(str(path))
        self.default_model = default_model or "default"
        errors: tuple[type[Exception], ...] = (sqlite3.Error, OSError)
        try:
            if is_database_url(str(path)):
                import psycopg

                errors = (psycopg.Error,)
            self._db = _Database(str(path))
        except errors as exc:
            raise EngineError(f"cannot open the outcome store {self.path}: {exc}") from exc
        try:
            self._db.script(_SCHEMA)
            rows = self._db.execute(
                "SELECT step, model, items, failures, attempts FROM {t}step_outcomes")
            lengths = self._db.execute("SELECT step, model, tokens FROM {t}step_output_tokens")
        except errors as exc:
            self._db.close()
            raise EngineError(f"cannot open the outcome store {self.path}: {exc}") from exc
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flowlift-outcomes")
        self._lock = threading.Lock()
        self._due_counts: dict[tuple[str, str], OutcomeCounts] = {}  # increments unwritten
        self._due_lengths: set[tuple[str, str]] = set()  # keys whose lengths are unwritten
        self._flush_queued = False
        self._counts = {(s, m): OutcomeCounts(i, f, a) for s, m, i, f, a in rows}
        self._lengths: dict[tuple[str, str], deque[int]] = {
            (s, m): deque(json.loads(t), maxlen=KEEP_LENGTHS) for s, m, t in lengths}
        self._turns: dict[tuple[str, str], deque[int]] = {}  # in memory only

    def record(self, step: str, model: str | None, accepted: bool, attempts: int) -> None:
        """One item of ``step`` ran on ``model``: delivered (``accepted``) or not."""
        key = (step, model or self.default_model)
        failed = 0 if accepted else 1
        self._counts[key] = _plus(self._counts.get(key), 1, failed, attempts)
        with self._lock:
            self._due_counts[key] = _plus(self._due_counts.get(key), 1, failed, attempts)
        self._queue_flush()

    def record_output(self, step: str, model: str | None, completion_tokens: int) -> None:
        """``step`` delivered an output of ``completion_tokens`` tokens on ``model``."""
        key = (step, model or self.default_model)
        kept = self._lengths.setdefault(key, deque(maxlen=KEEP_LENGTHS))
        kept.append(int(completion_tokens))
        with self._lock:
            self._due_lengths.add(key)
        self._queue_flush()

    def record_turns(self, step: str, model: str | None, turns: int) -> None:
        """Agent step ``step`` took ``turns`` model turns on ``model`` (kept in memory,
        the last :data:`KEEP_LENGTHS`: the compiler's expected turns, :meth:`turns`)."""
        key = (step, model or self.default_model)
        self._turns.setdefault(key, deque(maxlen=KEEP_LENGTHS)).append(int(turns))

    def turns(self, step: str, model: str | None) -> float | None:
        """The mean turns agent step ``step`` took on ``model`` since this proxy started,
        or None when never seen (:func:`flowlift.timing.agent_turns`)."""
        kept = self._turns.get((step, model or self.default_model))
        return statistics.fmean(kept) if kept else None

    def _queue_flush(self) -> None:
        """One write of everything due on the writer thread, unless one waits already."""
        with self._lock:
            if self._flush_queued:
                return
            self._flush_queued = True
        with contextlib.suppress(RuntimeError):  # (closed: what is due stays unwritten)
            self._writer.submit(self._flush)

    def _flush(self) -> None:
        """On the writer thread: every row due, one upsert each; a failure keeps the rows
        not written for the next flush."""
        with self._lock:
            counts, self._due_counts = self._due_counts, {}
            lengths, self._due_lengths = self._due_lengths, set()
            self._flush_queued = False
        now = time.time()
        writes = ([(_UPSERT, key, (*key, due.items, due.failures, due.attempts, now))
                   for key, due in counts.items()]
                  # (tuple() copies the deque in one step under the GIL: no append of
                  # the loop's lands mid-copy)
                  + [(_UPSERT_TOKENS, key, (*key, json.dumps(tuple(self._lengths[key])), now))
                     for key in lengths])
        for done, (statement, _key, params) in enumerate(writes):
            try:
                self._db.execute(statement, params)
            except self._db.errors as exc:  # advisory: a busy database never fails a step
                log.warning("outcome_store_write_failed", path=self.path, error=str(exc),
                            kept=len(writes) - done)
                self._keep(writes[done:])
                return

    def _keep(self, unwritten: list[tuple[str, tuple[str, str], tuple[Any, ...]]]) -> None:
        """Put rows a failed flush did not write back among those due (increments added
        to any recorded since; lengths are read anew when written)."""
        with self._lock:
            for statement, key, params in unwritten:
                if statement is _UPSERT:
                    items, failures, attempts = params[2:5]
                    self._due_counts[key] = _plus(self._due_counts.get(key), items,
                                                  failures, attempts)
                else:
                    self._due_lengths.add(key)

    def lengths(self, step: str, model: str | None) -> OutputLengths | None:
        """The output lengths ``step`` had on ``model`` (tokens), or None when never seen."""
        kept = self._lengths.get((step, model or self.default_model))
        if not kept:
            return None
        ordered = sorted(kept)
        p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
        return OutputLengths(len(ordered), float(statistics.median(ordered)), float(p90))

    def counts(self, step: str, model: str | None) -> OutcomeCounts:
        """What ``step`` did on ``model`` so far (zero counts when never seen)."""
        return self._counts.get((step, model or self.default_model), OutcomeCounts())

    def snapshot(self) -> dict[tuple[str, str], OutcomeCounts]:
        return dict(self._counts)

    def close(self, grace_s: float = 5.0) -> None:
        """Write what is due (waiting up to ``grace_s``; past it, it is not written), then
        close the database."""
        flushed = self._writer.submit(self._flush)
        concurrent.futures.wait([flushed], timeout=grace_s)
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._db.close()
