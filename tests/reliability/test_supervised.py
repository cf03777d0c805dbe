"""The proxy dies, and somebody notices: no engine process outlives a ``kill -9``ed
proxy, and ``flowlift run`` reports a killed proxy at once, restarts it on the same state
database, and the script's workflow finishes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from flowlift.proxy.store.sqlite import RunStore
from flowlift.testing import free_port, running_proxy


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for kid in _children(todo.pop()):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_no_engine_process_outlives_a_killed_proxy(tmp_path):
    with running_proxy("--engine", "fake", "--fake-core-process", "--state-db", ":memory:",
                       log_path=tmp_path / "proxy.log", ready_timeout_s=60) as (_, proc):
        deadline = time.monotonic() + 20
        cores: set[int] = set()
        while not cores and time.monotonic() < deadline:
            cores = {p for p in _descendants(proc.pid) if "spawn_main" in _cmdline(p)}
            time.sleep(0.1)
        assert cores, "the fake engine started no core process"
        everything = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 15
        while any(map(_alive, everything)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p: _cmdline(p) for p in everything if _alive(p)}
        for pid in left:  # do not leak them into the next test
            os.kill(pid, signal.SIGKILL)
        assert not left, f"outlived the proxy: {left}"


SCRIPT = textwrap.dedent("""
    from flowlift import step, workflow

    @step(max_tokens=30)
    def grow(text):
        return f"Say more about {text} in many more words than before please"

    if __name__ == "__main__":
        with workflow("supervised", reconnect_s=120) as wf:
            x = grow("rivers")
            for _ in range(5):
                x = grow(x)
        print("RESULT", wf.run_id, wf.status, flush=True)
""")


def _proxy_pid(parent: int) -> int | None:
    return next((p for p in _children(parent) if " serve " in _cmdline(p)), None)


def test_flowlift_run_restarts_a_killed_proxy_and_the_run_finishes(tmp_path):
    script = tmp_path / "flow.py"
    script.write_text(SCRIPT)
    log_dir = tmp_path / "runs"
    port = free_port()
    run = subprocess.Popen(
        [sys.executable, "-m", "flowlift.cli", "run", "--engine", "fake", "--no-progress",
         "--base-url", f"http://127.0.0.1:{port}", "--log-dir", str(log_dir), str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, killed = time.monotonic() + 60, None
        while killed is None and time.monotonic() < deadline and run.poll() is None:
            db = log_dir / "state.sqlite"
            if db.exists():
                runs = RunStore(db).recent(limit=1)[0]
                stored = RunStore(db).load(runs[0].run_id) if runs else None
                done = [n for _, n, _ in stored.events if n == "step.finished"] if stored else []
                proxy = _proxy_pid(run.pid)
                if len(done) >= 2 and proxy is not None:  # mid-workflow
                    os.kill(proxy, signal.SIGKILL)
                    killed = proxy
            time.sleep(0.05)
        assert killed is not None, "the workflow did not get going"
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err
    assert f"the proxy (pid {killed}) was killed by SIGKILL" in err
    assert "restarting the proxy" in err and "proxy restarted after" in err
    (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT")]
    _, run_id, status = line.split()
    assert status == "succeeded"
    assert f"flowlift: run {run_id} (supervised) succeeded" in err
    assert str(log_dir / "traces" / f"{run_id}.jsonl") in err
    # the proxy flowlift run started is stopped by now: no page URL, the command to read it
    assert f"read: `flowlift show {run_id}`" in err and "/ui/workflows/" not in err
    events = [n for _, n, _ in RunStore(log_dir / "state.sqlite").load(run_id).events]
    assert events.count("run.resumed") == 1 and events.count("step.finished") == 6


def test_proxy_unavailable_says_a_restart_resumes_the_run():
    from flowlift.errors import ProxyUnavailable

    message = str(ProxyUnavailable("http://127.0.0.1:1", "ConnectError: refused"))
    assert "restarting the proxy with the same --state-db resumes it" in message
