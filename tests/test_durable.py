"""Durable runs: kill -9 the proxy mid-run, start it again; the run resumes, the SDK
reconnects, nothing finished is lost or re-run, no @tool step runs twice."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from flowlift import step, tool, workflow
from flowlift.proxy.store import RunStore
from flowlift.testing import parse_sse


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, db: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "flowlift.cli", "serve", "--engine", "fake", "--port",
           str(port), "--state-db", str(db), "--fake-delay-s", "0.05"]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(log.read_text()[-2000:])


TOOL_CALLS: list[str] = []


@step(max_tokens=40)
def write(topic):
    return f"Write about {topic} in some words please"


@tool
def lookup(text):
    TOOL_CALLS.append(text)
    return "looked up"


def test_kill_9_mid_run_then_restart_resumes(tmp_path):
    port, db, log = _port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
    proc = _serve(port, db, log)
    base = f"http://127.0.0.1:{port}"
    wf = workflow("durable", base_url=base, reconnect_s=60)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with wf:
                a = write("alpha")
                b = write(lookup(a))
                c = write(b)
                write(c)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(wf._outputs) < 2 and time.monotonic() < deadline:  # a and the tool done
            time.sleep(0.02)
        assert len(wf._outputs) >= 2, "the run did not get going"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done_before = set(wf._outputs)
        proc = _serve(port, db, log)  # same port, same state
        thread.join(timeout=60)
        assert not thread.is_alive() and not errors, errors
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert wf.status == "succeeded"
    assert len(TOOL_CALLS) == 1, "the @tool step ran twice"
    assert len(wf._outputs) == 5 and done_before <= set(wf._outputs)
    stored = RunStore(db).load(wf.run_id)
    finished = [d["step_id"] for _, n, d in stored.events if n == "step.finished"]
    assert sorted(finished) == sorted(set(finished)), "a finished step ran again"
    assert [n for _, n, _ in stored.events].count("run.resumed") == 1
    assert stored.status == "succeeded"


@pytest.mark.parametrize("after", ["0", "3"])
def test_events_replay_from_last_event_id(tmp_path, after):
    port = _port()
    proc = _serve(port, tmp_path / "s.sqlite", tmp_path / "p.log")
    try:
        base = f"http://127.0.0.1:{port}"
        graph = {"nodes": [{"kind": "llm", "id": f"n{i}", "messages": [
            {"role": "user", "content": [{"text": f"hi {i}"}]}]} for i in range(3)]}
        first = httpx.post(f"{base}/v1/workflows", json=graph, timeout=30).text
        run_id = parse_sse(first)[0][1]["run_id"]
        again = httpx.get(f"{base}/v1/workflows/{run_id}/events",
                          headers={"Last-Event-ID": after}, timeout=30).text
        ids = [int(line[3:]) for line in again.splitlines() if line.startswith("id:")]
        assert ids[0] == int(after) + 1 and ids[-1] == len(parse_sse(first))
        assert json.loads(httpx.get(f"{base}/v1/workflows/{run_id}").text)["status"] == \
            "succeeded"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
