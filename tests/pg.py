"""A real PostgreSQL server for the tests (fixture ``postgres_url``, session-scoped).

``initdb`` into a temporary folder, ``pg_ctl start`` on a free port of 127.0.0.1 (its unix
socket in the same folder), one database ``flowlift_test``; stopped and removed at the
end of the session. As root (CI) the server runs as the ``postgres`` user (else
``nobody``): PostgreSQL refuses to run as root. Without the server binaries the tests
are skipped, unless ``FLOWLIFT_REQUIRE_POSTGRES=1`` (scripts/test.sh sets it): then they
fail. ``scripts/install.sh --test`` installs the binaries (Debian's ``postgresql``).

``pg_url`` (function-scoped) is the same database emptied of flowlift's tables.

Faults (issue 28 item 3): ``pg_server`` is the server itself (:class:`PgServer`: stop,
start, restart it mid-test), and :class:`Relay` is a TCP relay to put between a proxy
and the server that can black-hole the traffic for N seconds (both ways: nothing is
lost, it is held, as TCP holds what a dropped network did not deliver) or refuse new
connections (``relay`` fixture).
"""

from __future__ import annotations

import asyncio
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

DATABASE = "flowlift_test"
TABLES = ("flowlift_events", "flowlift_runs", "flowlift_leases", "flowlift_meta",
          "flowlift_tool_results", "flowlift_follows", "flowlift_requests",
          "flowlift_step_outcomes", "flowlift_step_output_tokens")


def server_bin() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: PATH's, else Debian's newest."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    found_bins = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    numbered = [(int(b.parent.name), b) for b in found_bins if b.parent.name.isdigit()]
    return max(numbered)[1] if numbered else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_user() -> tuple[list[str], pwd.struct_passwd | None]:
    """The command prefix that runs a server binary unprivileged, and that user."""
    if os.geteuid() != 0:
        return [], None
    for name in ("postgres", "nobody"):
        try:
            user = pwd.getpwnam(name)
        except KeyError:
            continue
        return ["runuser", "-u", name, "--"], user
    raise RuntimeError("running as root and there is no postgres or nobody user to run "
                       "the PostgreSQL server as")


@dataclass
class PgServer:
    """The suite's PostgreSQL server: its URL and control (stop, start, restart)."""

    url: str
    port: int
    data: Path
    bindir: Path
    prefix: list[str]
    log: Path
    options: str  # the server's own (pg_ctl -o): address, port, socket folder

    def pg_ctl(self, *args: str) -> None:
        done = subprocess.run([*self.prefix, str(self.bindir / "pg_ctl"), "-D", str(self.data),
                               "-l", str(self.log), "-w", "-t", "60", *args],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl {' '.join(args)} failed:\n{done.stdout}{done.stderr}")

    def restart(self, down_s: float = 0.0) -> None:
        """``pg_ctl stop -m fast`` (every backend terminated, connections cut), ``down_s``
        seconds with no server, then ``pg_ctl start`` (the same options)."""
        if not down_s:
            self.pg_ctl("-m", "fast", "restart")
            return
        self.pg_ctl("-m", "fast", "stop")
        time.sleep(down_s)
        self.pg_ctl("-o", self.options, "start")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bindir = server_bin()
    if bindir is None:
        message = ("no PostgreSQL server binaries (initdb, pg_ctl): run "
                   "`bash scripts/install.sh --test` (Debian's postgresql package)")
        if os.environ.get("FLOWLIFT_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"FLOWLIFT_REQUIRE_POSTGRES=1 but {message}")
        pytest.skip(message)
    prefix, user = _as_user()
    # under /tmp, not pytest's root-only folders: the server's user must reach it
    root = Path(tempfile.mkdtemp(prefix="flowlift-pg-", dir="/tmp" if user else None))
    if user is not None:
        os.chown(root, user.pw_uid, user.pw_gid)
    data, port = root / "data", _free_port()
    options = f"-h 127.0.0.1 -p {port} -k {root} -F"

    def run(*cmd: str) -> None:
        done = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}{log}")

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "flowlift", "--auth=trust",
            "-E", "UTF8", "--no-sync")
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w",
            "-t", "60", "-o", options, "start")
        base = f"postgresql://flowlift@127.0.0.1:{port}"
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        yield PgServer(f"{base}/{DATABASE}", port, data, bindir, prefix, root / "server.log",
                       options)
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast",
                            "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url(pg_server: PgServer) -> str:
    return pg_server.url


class Relay:
    """A TCP relay on 127.0.0.1 to ``port`` (the server), on a thread of its own.

    :meth:`hold` black-holes it: no byte moves either way and new connections get no
    answer, until :meth:`flow` (what was sent meanwhile is delivered then, as after a
    network drop TCP's retransmissions deliver it); :attr:`refusing`: new connections
    are closed at once (a server that refuses them); :meth:`cut` closes every
    connection open now.
    """

    def __init__(self, port: int) -> None:
        self.target = port
        self.refusing = False
        self.connections = 0  # connections accepted so far
        self._loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def url(self, base: str) -> str:
        """``base`` (the server's URL) pointed at the relay instead."""
        return base.replace(f":{self.target}/", f":{self.port}/")

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._flowing.set()
        server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()
        server.close()
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.run_until_complete(asyncio.sleep(0))
        self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.refusing:
            writer.close()
            return
        await self._flowing.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    def _do(self, fn: object, *args: object) -> None:
        self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]

    def hold(self, seconds: float | None = None) -> None:
        """Black-hole the relay (for ``seconds``, then :meth:`flow` by itself)."""
        self._do(self._flowing.clear)
        if seconds is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, seconds, self._flowing.set)

    def flow(self) -> None:
        self._do(self._flowing.set)

    def cut(self) -> None:
        """Close every connection through the relay now."""
        def close_all() -> None:
            for writer in list(self._writers):
                writer.close()
        self._do(close_all)

    def close(self) -> None:
        self.flow()
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture
def relay(pg_server: PgServer) -> Iterator[Relay]:
    """A :class:`Relay` to the suite's server (closed after the test)."""
    relayed = Relay(pg_server.port)
    yield relayed
    relayed.close()


@pytest.fixture
def pg_url(postgres_url: str) -> str:
    """The test database without flowlift's tables (each test starts from nothing)."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {', '.join(TABLES)}")
    return postgres_url
