"""Durable runs in PostgreSQL: the run store several proxies can share (``--state-db
postgresql://user@host/db``).

The same event-sourced log as :class:`~flowlift.proxy.store.sqlite.SQLiteRunStore`,
in tables prefixed ``flowlift_`` (so the database may hold other things)::

    flowlift_meta(key PRIMARY KEY, value)            -- ('schema_version', '2')
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

**Handover.** Each write another replica waits on announces itself on the channel
:data:`CHANNEL` in its own transaction (``pg_notify``, delivered at commit, so a woken
reader sees the write): ``event <run>`` (an event appended), ``posted <run>`` (a tool
result or request kept), ``released <run>`` (a lease released unfinished), ``claimed
<run>`` (a lease taken from another owner). Each proxy listens on one connection of its
own (:mod:`~flowlift.proxy.store.postgres_listen`) and wakes the waiters concerned;
polling stays as the fallback.

Synchronous psycopg 3, as the SQLite store is synchronous; the proxy calls both from
one worker thread in order (:mod:`~flowlift.proxy.store.worker`), never from
its event loop, and a follower gets an event only once its ``append`` returned. Connections
come from a :class:`psycopg_pool.ConnectionPool` (autocommit), and every write commits
before it returns (``synchronous_commit`` as the server sets it: on by default, so
committed means on disk).

**Faults.** A database that restarts, runs out of connections or drops off the network
is waited out, not failed: every call retries its transient failures
(``OperationalError``: a broken or refused connection, the pool's wait, a cancelled
statement; tenacity's jittered exponential backoff, 50 ms to 1 s) until it lands, for up
to ``retry_s`` of one outage; :attr:`PostgresRunStore.trouble` says why meanwhile. Each
call is safe to repeat: events are keyed by ``(run, seq)`` and fenced, a claim by the
same owner keeps its epoch, a repeated create finds its own row, a request applied
twice is harmless. Nothing waits forever: a connection attempt gives up after
``connect_timeout`` (3 s), the pool's wait after 1 s (its bound exhausted), a statement
after ``statement_timeout`` (30 s, server side), and a connection whose peer vanished
after the TCP keepalives and ``tcp_user_timeout`` (about 20 s; libpq's parameters). The
pool drops a broken connection when it is handed back and makes a new one on demand
(``reconnect_timeout`` 1 s: a failed reconnection is given up quickly and tried again by
the next call rather than on the pool's own slower schedule). psycopg's errors are
translated here and only here: a transient failure past ``retry_s`` (or once the store
closes) is :class:`~flowlift.errors.StoreUnavailable` (HTTP 503, ``Retry-After``), any
other :class:`~flowlift.errors.EngineError`.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential_jitter

from flowlift.errors import EngineError, LeaseLost, RequestError, StoreUnavailable
from flowlift.proxy.store.base import (
    SCHEMA_VERSION,
    RunSummary,
    StoredResponse,
    StoredRun,
    per_tenant_keys,
)
from flowlift.proxy.tenants import DEFAULT_TENANT
from flowlift.tracing import get_logger

if TYPE_CHECKING:
    from flowlift.proxy.store.wakeups import Wakeups

log = get_logger("flowlift.runs")
P = ParamSpec("P")
R = TypeVar("R")
CHANNEL = "flowlift_runs"
"""The ``LISTEN``/``NOTIFY`` channel of run handovers (payload ``"<kind> <run key>"``)."""
_BACKOFF = wait_exponential_jitter(multiplier=0.05, max=1.0, jitter=0.05)
"""Between two attempts of a failing call: 50 ms doubling to 1 s, plus up to 50 ms."""
CONNECT_DEFAULTS = {"connect_timeout": "3", "keepalives": "1", "keepalives_idle": "10",
                    "keepalives_interval": "3", "keepalives_count": "3",
                    "tcp_user_timeout": "20000", "options": "-c statement_timeout=30000"}
"""libpq parameters every connection gets unless the URL sets them (see Faults)."""

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
_KEYED = ("flowlift_events", "flowlift_leases", "flowlift_tool_results", "flowlift_follows",
          "flowlift_requests")
"""The tables keyed by a run's ``run_id`` besides ``flowlift_runs``."""
_NOW = "extract(epoch from clock_timestamp())"  # the database's clock, epoch s
_CLAIM = f"""
WITH before AS (SELECT owner FROM flowlift_leases WHERE run_id = %(run)s),
granted AS (INSERT INTO flowlift_leases AS held (run_id, owner, expires_at, epoch)
    VALUES (%(run)s, %(owner)s, {_NOW} + %(ttl)s, nextval('flowlift_lease_epochs'))
    ON CONFLICT (run_id) DO UPDATE SET owner = excluded.owner,
        expires_at = excluded.expires_at,
        epoch = CASE WHEN held.owner = excluded.owner THEN held.epoch ELSE excluded.epoch END
    WHERE held.owner = excluded.owner OR held.expires_at < {_NOW}
    RETURNING epoch),
told AS (SELECT pg_notify(%(channel)s, %(note)s) FROM granted, before
         WHERE before.owner <> %(owner)s)
SELECT epoch, (SELECT count(*) FROM told) FROM granted
"""
"""A claim; one that takes the lease from another owner announces ``claimed <run>``."""
_APPEND = """
WITH written AS (INSERT INTO flowlift_events SELECT %(run)s, %(seq)s, %(name)s, %(data)s
    WHERE %(epoch)s::bigint IS NULL OR EXISTS (SELECT 1 FROM flowlift_leases
        WHERE run_id = %(run)s AND epoch = %(epoch)s FOR SHARE)
    ON CONFLICT (run_id, seq) DO UPDATE SET name = excluded.name, data = excluded.data
    RETURNING 1)
SELECT pg_notify(%(channel)s, %(note)s) FROM written
"""
_TOLD = "SELECT pg_notify(%s, %s) FROM {}"
"""``_TOLD.format(cte)``: announce a change once per row the CTE ``cte`` returned."""


def note(kind: str, run_id: str) -> str:
    """The payload announcing ``kind`` for ``run_id`` (``"<kind> "``: any run, when the
    key would pass PostgreSQL's 8000-byte payload limit)."""
    text = f"{kind} {run_id}"
    return text if len(text.encode()) < 7900 else f"{kind} "


def _transient(exc: BaseException) -> bool:
    """A failure that waiting can cure: the connection (broken, refused, the pool's wait
    for one), a cancelled statement, a serialization conflict; not a closed store."""
    return isinstance(exc, psycopg.OperationalError) and not isinstance(exc, PoolClosed)


def _retried(method: Callable[Concatenate[PostgresRunStore, P], R]
             ) -> Callable[Concatenate[PostgresRunStore, P], R]:
    """The store's ``method``, its transient failures retried and psycopg's errors
    translated (:meth:`PostgresRunStore._retry`)."""
    @functools.wraps(method)
    def retried(self: PostgresRunStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._retry(method.__name__, functools.partial(method, self, *args, **kwargs))
    return retried


def redact(url: str) -> str:
    """``url`` without its password (for messages and ``path``): ``postgresql://u:pw@h/db``
    -> ``postgresql://u@h/db``; a conninfo's ``password=...`` -> ``password=***``."""
    url = re.sub(r"(://[^/@:]*):[^/@]*@", r"\1@", url)
    url = re.sub(r"([?&]password=)[^&]*", r"\1***", url)
    return re.sub(r"(password\s*=\s*)\S+", r"\1***", url)


def with_defaults(url: str) -> str:
    """``url`` with each of :data:`CONNECT_DEFAULTS` it does not set itself.

    Raises:
        psycopg.ProgrammingError: not a libpq URL or conninfo.
    """
    given = conninfo_to_dict(url)
    return make_conninfo(url, **{k: v for k, v in CONNECT_DEFAULTS.items() if k not in given})


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
        url: a libpq URL or conninfo (``postgresql://user:pw@host:5432/db``); its own
            parameters win over :data:`CONNECT_DEFAULTS`.
        connect_timeout_s: how long opening waits for the first connection.
        max_connections: the pool's bound (the proxy's worker uses one at a time).
        retry_s: how long one outage is waited out before calls fail
            (:class:`~flowlift.errors.StoreUnavailable`).
        pool_timeout_s: how long a call waits for a connection of the pool.

    Raises:
        EngineError: the server cannot be reached, refuses us, or holds a newer schema
            (the message names the URL without its password).
    """

    def __init__(self, url: str, *, connect_timeout_s: float = 10.0,
                 max_connections: int = 4, retry_s: float = 60.0,
                 pool_timeout_s: float = 1.0) -> None:
        self.path = redact(url)
        self.retry_s = retry_s
        self.pids: set[int] = set()  # backend pids of our connections (our own notices)
        self._failing_since: float | None = None  # monotonic start of an outage
        self._trouble: str | None = None
        self._closing = False
        try:
            self._conninfo = with_defaults(url)
            check_reachable(self._conninfo, connect_timeout_s)
            self._pool: ConnectionPool[psycopg.Connection[tuple[Any, ...]]] = ConnectionPool(
                self._conninfo, min_size=1, max_size=max_connections, open=False,
                kwargs={"autocommit": True}, name="flowlift-runs", timeout=pool_timeout_s,
                reconnect_timeout=1.0, configure=self._configured)
        except psycopg.Error as exc:  # unreachable, refused, a malformed URL
            raise EngineError(f"cannot open the run store {self.path}: {exc}") from exc
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
            self._create_schema()
        except (psycopg.Error, PoolTimeout) as exc:
            self._pool.close()
            raise EngineError(f"cannot open the run store {self.path}: {exc}") from exc

    def _configured(self, conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        self.pids.add(conn.info.backend_pid)

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
        with self._pool.connection() as conn:
            yield conn

    # -- faults: retried, translated (see the module docstring) --------------------------
    @property
    def trouble(self) -> str | None:
        return self._trouble

    def _retry(self, what: str, call: Callable[[], R]) -> R:
        """``call()``, its transient failures retried for up to :attr:`retry_s` of the
        outage (or until the store closes).

        Raises:
            StoreUnavailable: still failing after that.
            EngineError: any other database error.
        """
        try:
            for attempt in Retrying(retry=retry_if_exception(_transient),
                                    wait=_BACKOFF,
                                    stop=self._give_up, reraise=True):
                with attempt:
                    result = call()
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"the run store {self.path} is unavailable ({what}: "
                                   f"{exc}); retry shortly") from exc
        except psycopg.Error as exc:
            raise EngineError(f"the run store {self.path} failed ({what}): {exc}") from exc
        if self._failing_since is not None:
            log.warning("run_store_recovered", store=self.path,
                        down_s=round(time.monotonic() - self._failing_since, 2))
        self._failing_since, self._trouble = None, None
        return result

    def _give_up(self, state: RetryCallState) -> bool:
        """Tenacity's stop: after each failed attempt (noted as :attr:`trouble`), whether
        to stop retrying (the outage is older than ``retry_s``, or the store closes)."""
        exc = state.outcome.exception() if state.outcome is not None else None
        now = time.monotonic()
        if exc is not None and _transient(exc):
            if self._failing_since is None:
                self._failing_since = now
                log.warning("run_store_unavailable", store=self.path, error=str(exc))
            self._trouble = " ".join(f"{type(exc).__name__}: {exc}".split())  # (one line)
        return self._closing or (self._failing_since is not None
                                 and now - self._failing_since > self.retry_s)

    def _create_schema(self) -> None:
        with self._conn() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
            conn.execute(_SCHEMA)
            conn.execute("INSERT INTO flowlift_meta VALUES ('schema_version', %s) "
                         "ON CONFLICT (key) DO NOTHING", (str(SCHEMA_VERSION),))
            row = conn.execute("SELECT value FROM flowlift_meta "
                               "WHERE key = 'schema_version'").fetchone()
            if row is not None and int(row[0]) < 2:  # (run ids per tenant)
                for statement in per_tenant_keys("flowlift_runs", _KEYED, "%s"):
                    conn.execute(statement, (DEFAULT_TENANT,))
                conn.execute("UPDATE flowlift_meta SET value = %s "
                             "WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
                row = (str(SCHEMA_VERSION),)
        if row is None or int(row[0]) > SCHEMA_VERSION:
            raise EngineError(f"the run store {self.path} has schema version "
                              f"{row and row[0]}, newer than this flowlift's {SCHEMA_VERSION}")

    def create(self, run_id: str, graph: dict[str, Any], tenant: str | None = None,
               owner: str | None = None, ttl_s: float = 0.0) -> None:
        """Store a new run (see :meth:`RunStoreProtocol.create`) and, given ``owner``, its
        lease in the same transaction: between two statements another replica's
        heartbeat found the run unowned, claimed it as an orphan and ran it, and its
        creator lost it (two runs of ``tests/test_shared_store.py`` in ten failed from
        it). Safe to retry after a failure that may have committed: the row this call
        wrote (its creation time to the microsecond) counts as written.

        Raises:
            RequestError: another run has the key ``run_id`` (``param: id``).
        """
        row = (run_id, json.dumps(graph), str(graph.get("name") or ""), time.time(), tenant)
        self._retry("create", functools.partial(self._create, row, owner, ttl_s))

    def _create(self, row: tuple[str, str, str, float, str | None], owner: str | None,
                ttl_s: float) -> None:
        run_id, text, name, now, tenant = row
        with self._conn() as conn:
            with conn.transaction():
                if conn.execute("INSERT INTO flowlift_runs (run_id, graph, name, status, "
                                "created_at, updated_at, tenant) VALUES (%s, %s, %s, "
                                "'running', %s, %s, %s) ON CONFLICT (run_id) DO NOTHING",
                                (run_id, text, name, now, now, tenant)).rowcount == 1:
                    if owner is not None:
                        conn.execute("INSERT INTO flowlift_leases (run_id, owner, "
                                     f"expires_at) VALUES (%s, %s, {_NOW} + %s) "
                                     "ON CONFLICT (run_id) DO NOTHING",
                                     (run_id, owner, ttl_s))
                    return
            held = conn.execute("SELECT graph, created_at, tenant FROM flowlift_runs "
                                "WHERE run_id = %s", (run_id,)).fetchone()
        if held is None or tuple(held) != (text, now, tenant):  # (else: our own, retried)
            raise RequestError(f"a run with key {run_id!r} exists", param="id")

    @_retried
    def append(self, run_id: str, seq: int, name: str, data: dict[str, Any],
               epoch: int | None = None) -> None:
        """Store event ``seq`` (see :meth:`RunStoreProtocol.append`), fenced by ``epoch``,
        and announce it (``event <run>``). Safe to repeat (keyed by ``(run, seq)``).

        Raises:
            LeaseLost: ``epoch`` is not the run's lease's any more (nothing was written).
        """
        with self._conn() as conn, conn.transaction():
            if conn.execute(_APPEND, {"run": run_id, "seq": seq, "name": name,
                                      "data": json.dumps(data), "epoch": epoch,
                                      "channel": CHANNEL,
                                      "note": note("event", run_id)}).rowcount != 1:
                raise LeaseLost(f"run {run_id}: its lease is no longer epoch {epoch} (another "
                                f"proxy took the run over); event {seq} was not written")
            if name == "run.finished":  # (its lease goes with it: nothing left to own)
                conn.execute("UPDATE flowlift_runs SET status = %s, updated_at = %s "
                             "WHERE run_id = %s",
                             (data.get("status", "finished"), time.time(), run_id))
                conn.execute("DELETE FROM flowlift_leases WHERE run_id = %s", (run_id,))

    @_retried
    def exists(self, run_id: str) -> bool:
        with self._conn() as conn:
            return conn.execute("SELECT 1 FROM flowlift_runs WHERE run_id = %s",
                                (run_id,)).fetchone() is not None

    @_retried
    def load(self, run_id: str) -> StoredRun | None:
        return self._load(run_id)

    def _load(self, run_id: str) -> StoredRun | None:
        with self._conn() as conn:
            row = conn.execute("SELECT graph, status, tenant FROM flowlift_runs "
                               "WHERE run_id = %s", (run_id,)).fetchone()
            if row is None:
                return None
            events = [(seq, name, json.loads(data)) for seq, name, data in conn.execute(
                "SELECT seq, name, data FROM flowlift_events WHERE run_id = %s ORDER BY seq",
                (run_id,))]
        return StoredRun(run_id, json.loads(row[0]), row[1], events, row[2])

    @_retried
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

    @_retried
    def unfinished(self) -> list[StoredRun]:
        with self._conn() as conn:
            ids = [r[0] for r in conn.execute(
                "SELECT run_id FROM flowlift_runs WHERE status = 'running' "
                "ORDER BY created_at, run_id")]
        return [run for rid in ids if (run := self._load(rid)) is not None]

    @_retried
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
        """Why the store cannot take writes now (closed, unreachable, failing: one
        attempt, no retries), or None."""
        try:
            with self._pool.connection(timeout=2.0) as conn:
                conn.execute("SELECT 1 FROM flowlift_runs LIMIT 1").fetchall()
        except psycopg.Error as exc:  # (PoolClosed, PoolTimeout are psycopg errors too)
            return f"{self.path}: {exc}"
        return None if self._trouble is None else f"{self.path}: {self._trouble}"

    def listener(self) -> Wakeups:
        """A ``LISTEN`` on :data:`CHANNEL` of its own connection, ignoring this store's
        own announcements (:class:`~flowlift.proxy.store.postgres_listen.PgWakeups`)."""
        from flowlift.proxy.store.postgres_listen import PgWakeups

        return PgWakeups(self._conninfo, ignore=self.pids, name=self.path)

    def close(self) -> None:
        """Close the pool; calls still retrying give up at their next attempt."""
        self._closing = True
        self._pool.close()

    # -- ownership (see the module docstring) -----------------------------------------
    shared = True

    @_retried
    def claim(self, run_id: str, owner: str, ttl_s: float) -> int | None:
        with self._conn() as conn:
            row = conn.execute(_CLAIM, {"run": run_id, "owner": owner, "ttl": ttl_s,
                                        "channel": CHANNEL,
                                        "note": note("claimed", run_id)}).fetchone()
        return None if row is None else int(row[0])

    @_retried
    def renew(self, owner: str, run_ids: Collection[str], ttl_s: float) -> set[str]:
        if not run_ids:
            return set()
        with self._conn() as conn:
            return {r[0] for r in conn.execute(
                f"UPDATE flowlift_leases SET expires_at = {_NOW} + %s "
                "WHERE owner = %s AND run_id = ANY(%s) RETURNING run_id",
                (ttl_s, owner, list(run_ids)))}

    def release(self, run_id: str, owner: str) -> None:
        """Give up ``owner``'s lease of ``run_id``, announcing ``released <run>`` (another
        replica may take the run at once). Best effort: a lease this cannot release (the
        store closed, the database away past ``retry_s``) expires by itself."""
        try:
            self._release(run_id, owner)
        except (StoreUnavailable, EngineError) as exc:
            log.warning("run_lease_not_released", workflow_id=run_id, error=str(exc))

    @_retried
    def _release(self, run_id: str, owner: str) -> None:
        with self._conn() as conn:
            conn.execute("WITH gone AS (DELETE FROM flowlift_leases WHERE run_id = %s AND "
                         "owner = %s RETURNING 1) " + _TOLD.format("gone"),
                         (run_id, owner, CHANNEL, note("released", run_id)))

    @_retried
    def orphans(self, owner: str) -> list[str]:
        with self._conn() as conn:
            return [r[0] for r in conn.execute(
                "SELECT r.run_id FROM flowlift_runs r LEFT JOIN flowlift_leases l "
                "ON l.run_id = r.run_id WHERE r.status = 'running' AND (l.run_id IS NULL "
                f"OR l.owner = %s OR l.expires_at < {_NOW}) ORDER BY r.created_at, r.run_id",
                (owner,))]

    # -- tool results posted to any replica; follows from other replicas ---------------
    @_retried
    def put_tool_result(self, run_id: str, step_id: str, body: dict[str, Any]) -> bool:
        with self._conn() as conn:
            return conn.execute(
                "WITH kept AS (INSERT INTO flowlift_tool_results VALUES (%s, %s, %s) "
                "ON CONFLICT (run_id, step_id) DO NOTHING RETURNING 1) "
                + _TOLD.format("kept"),
                (run_id, step_id, json.dumps(body), CHANNEL,
                 note("posted", run_id))).rowcount == 1

    @_retried
    def tool_results(self, run_id: str, step_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        if not step_ids:
            return {}
        with self._conn() as conn:
            return {r[0]: json.loads(r[1]) for r in conn.execute(
                "SELECT step_id, body FROM flowlift_tool_results WHERE run_id = %s "
                "AND step_id = ANY(%s)", (run_id, list(step_ids)))}

    @_retried
    def mark_followed(self, run_ids: Collection[str]) -> None:
        if not run_ids:
            return
        with self._conn() as conn:
            conn.execute(f"INSERT INTO flowlift_follows SELECT unnest(%s::text[]), {_NOW} "
                         "ON CONFLICT (run_id) DO UPDATE SET at = excluded.at",
                         (sorted(run_ids),))

    @_retried
    def followed(self, run_ids: Collection[str], within_s: float) -> set[str]:
        if not run_ids:
            return set()
        with self._conn() as conn:
            return {r[0] for r in conn.execute(
                "SELECT run_id FROM flowlift_follows WHERE run_id = ANY(%s) "
                f"AND at >= {_NOW} - %s", (list(run_ids), within_s))}

    @_retried
    def put_request(self, run_id: str, kind: str, body: dict[str, Any]) -> int:
        with self._conn() as conn:
            row = conn.execute("WITH kept AS (INSERT INTO flowlift_requests (run_id, kind, "
                               "body) VALUES (%s, %s, %s) RETURNING id) SELECT id, "
                               "pg_notify(%s, %s)::text FROM kept",
                               (run_id, kind, json.dumps(body), CHANNEL,
                                note("posted", run_id))).fetchone()
        assert row is not None  # (RETURNING of an insert)
        return int(row[0])

    @_retried
    def requests(self, run_ids: Collection[str]) -> list[tuple[int, str, str, dict[str, Any]]]:
        if not run_ids:
            return []
        with self._conn() as conn:
            return [(int(i), run, kind, json.loads(body)) for i, run, kind, body in conn.execute(
                "SELECT id, run_id, kind, body FROM flowlift_requests WHERE run_id = ANY(%s) "
                "ORDER BY id", (list(run_ids),))]

    @_retried
    def drop_requests(self, ids: Collection[int]) -> None:
        if ids:
            with self._conn() as conn:
                conn.execute("DELETE FROM flowlift_requests WHERE id = ANY(%s)", (list(ids),))

    @_retried
    def put_response(self, response_id: str, row: StoredResponse) -> None:
        with self._conn() as conn:
            conn.execute(
                "INSERT INTO flowlift_responses VALUES (%s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (id) DO UPDATE SET tenant = excluded.tenant, "
                "conversation = excluded.conversation, body = excluded.body, "
                "created_at = excluded.created_at, expires_at = excluded.expires_at",
                (response_id, row.tenant, row.conversation, json.dumps(row.body),
                 row.created_at, row.expires_at))

    @_retried
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

    @_retried
    def delete_response(self, response_id: str) -> bool:
        with self._conn() as conn:
            return conn.execute("DELETE FROM flowlift_responses WHERE id = %s",
                                (response_id,)).rowcount == 1

    @_retried
    def prune_responses(self, keep: int) -> int:
        with self._conn() as conn:
            gone = conn.execute("DELETE FROM flowlift_responses WHERE expires_at <= %s",
                                (time.time(),)).rowcount
            return gone + conn.execute(
                "DELETE FROM flowlift_responses WHERE id IN (SELECT id FROM "
                "flowlift_responses ORDER BY created_at DESC OFFSET %s)", (keep,)).rowcount
