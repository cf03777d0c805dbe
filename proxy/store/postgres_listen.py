"""The PostgreSQL run store's handover channel: one ``LISTEN`` connection per proxy.

Writes that another replica waits on announce themselves with ``pg_notify`` on
:data:`~flowlift.proxy.store.postgres.CHANNEL`, in the write's own transaction (so
the notice is delivered at commit: a woken reader sees the write; see
:mod:`~flowlift.proxy.store.postgres`). :class:`PgWakeups` holds one connection of
its own on a thread of its own (psycopg's blocking :meth:`psycopg.Connection.notifies`,
half a second at a time so that :meth:`PgWakeups.close` is heard), never on the event
loop and never on the store's worker, and hands each notice to the loop
(``call_soon_threadsafe``), which wakes exactly the watches that want it
(:class:`~flowlift.proxy.store.wakeups.Wakeups`).

Polling stays as the fallback: while the channel listens, watches poll every
``fallback_s`` (a missed notice costs that much at worst); whenever the connection is
down (the server restarted, the backend was terminated, the network dropped) they poll
every ``poll_s`` again by themselves, and the thread reconnects with tenacity's jittered
exponential backoff (100 ms to 5 s). On each change of state every watch is woken once,
so whatever changed while nobody listened is read at once.

Notices of this proxy's own writes (from the backend pids of its store's pool, passed as
``ignore``) are dropped: nobody here waits on them, and a proxy must not take back the
run it has just released.

The source of the technique: PostgreSQL's ``LISTEN``/``NOTIFY`` (asynchronous
notification, "NOTIFY" in the PostgreSQL manual) and psycopg 3's ``notifies()``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Container
from typing import Any

import psycopg
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential_jitter

from flowlift.proxy.store.postgres import CHANNEL, redact
from flowlift.proxy.store.wakeups import Wakeups
from flowlift.tracing import get_logger

log = get_logger("flowlift.runs")


class PgWakeups(Wakeups):
    """Wakeups fed by ``LISTEN`` on a PostgreSQL run store (see the module docstring).

    Args:
        conninfo: the store's connection string (its timeouts and keepalives included).
        ignore: backend pids whose notices are this proxy's own (the store's ``pids``,
            read live).
        poll_s: the watches' interval while the channel is down.
        fallback_s: their interval while it listens.
        backoff_max_s: the longest wait between two reconnection attempts.
        name: the store as logs name it.
    """

    def __init__(self, conninfo: str, *, ignore: Container[int] = (), poll_s: float = 0.2,
                 fallback_s: float = 2.0, backoff_max_s: float = 5.0,
                 name: str | None = None) -> None:
        super().__init__(poll_s=poll_s, fallback_s=fallback_s)
        self._conninfo = conninfo
        self.name = name or redact(conninfo)  # (logs: the store's URL without password)
        self._ignore = ignore
        self.backoff_max_s = backoff_max_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._listening = False
        self.backend_pid: int | None = None  # the listening connection's (tests, logs)
        self.connects = 0  # successful LISTENs so far (1 + reconnections)

    @property
    def listening(self) -> bool:
        return self._listening

    def start(self) -> None:
        """Listen from now on (call it on the event loop the watches run on)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="flowlift-listen", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop listening (within about half a second) and close the connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    # -- the listening thread ----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            conn = self._connect()
            if conn is None:  # (stopped while reconnecting)
                return
            try:
                self._state(True, conn)
                while not self._stop.is_set():
                    for notice in conn.notifies(timeout=0.5):
                        self._deliver(notice)
            except psycopg.Error as exc:  # the server restarted, the backend was killed...
                log.warning("run_store_listen_lost", store=self.name,
                            error=str(exc).strip())
            finally:
                self._state(False, None)
                conn.close()

    def _connect(self) -> psycopg.Connection[Any] | None:
        """A connection listening on the channel, retried with backoff until it opens
        (None: :meth:`close` came first)."""
        try:
            for attempt in Retrying(retry=retry_if_exception_type(psycopg.OperationalError),
                                    wait=wait_exponential_jitter(
                                        multiplier=0.1, max=self.backoff_max_s, jitter=0.1),
                                    stop=self._stopped, sleep=self._pause,
                                    reraise=True):
                with attempt:
                    conn = psycopg.connect(self._conninfo, autocommit=True)
                    try:
                        conn.execute(f"LISTEN {CHANNEL}")
                    except psycopg.Error:
                        conn.close()
                        raise
                    return conn
        except psycopg.Error as exc:  # (stopped, or not a connection failure)
            if not self._stop.is_set():
                log.error("run_store_listen_failed", store=self.name,
                          error=str(exc).strip())
        return None

    def _stopped(self, state: RetryCallState) -> bool:
        return self._stop.is_set()

    def _pause(self, seconds: float) -> None:
        self._stop.wait(seconds)  # (a close cuts the backoff short)

    def _state(self, listening: bool, conn: psycopg.Connection[Any] | None) -> None:
        self._listening = listening
        self.backend_pid = None if conn is None else conn.info.backend_pid
        if listening:
            self.connects += 1
            if self.connects > 1:
                log.info("run_store_listen_back", store=self.name)
        self._call(self.wake_all)

    def _deliver(self, notice: psycopg.Notify) -> None:
        if notice.pid in self._ignore:
            return
        kind, _, key = notice.payload.partition(" ")
        self._call(self.notify, kind, key)

    def _call(self, fn: Any, *args: Any) -> None:
        """``fn(*args)`` on the event loop (dropped once the loop has closed)."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            self._stop.set()
