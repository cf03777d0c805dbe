"""A real PostgreSQL server for the tests (fixture ``postgres_url``, session-scoped).

``initdb`` into a temporary folder, ``pg_ctl start`` on a free port of 127.0.0.1 (its unix
socket in the same folder), one database ``flowlift_test``; stopped and removed at the
end of the session. As root (CI) the server runs as the ``postgres`` user (else
``nobody``): PostgreSQL refuses to run as root. Without the server binaries the tests
are skipped, unless ``FLOWLIFT_REQUIRE_POSTGRES=1`` (scripts/test.sh sets it): then they
fail. ``scripts/install.sh --test`` installs the binaries (Debian's ``postgresql``).

``pg_url`` (function-scoped) is the same database emptied of flowlift's tables.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
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


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
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

    def run(*cmd: str) -> None:
        done = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}{log}")

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "flowlift", "--auth=trust",
            "-E", "UTF8", "--no-sync")
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w",
            "-t", "60", "-o", f"-h 127.0.0.1 -p {port} -k {root} -F", "start")
        base = f"postgresql://flowlift@127.0.0.1:{port}"
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        yield f"{base}/{DATABASE}"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast",
                            "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_url: str) -> str:
    """The test database without flowlift's tables (each test starts from nothing)."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {', '.join(TABLES)}")
    return postgres_url
