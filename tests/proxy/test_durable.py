"""Durable runs: kill -9 the proxy mid-run, start it again; the run resumes, the SDK
reconnects, nothing finished is lost or re-run, no @tool step runs twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from flowlift import step, tool, workflow
from flowlift.costs import CostTracker
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.workflows.registry import RunRegistry
from flowlift.testing import FakeEngine, free_port, parse_sse, running_proxy


def _serve(port: int, db: Path, log: Path):  # type: ignore[no-untyped-def]
    return running_proxy("--engine", "fake", "--state-db", str(db), "--fake-delay-s", "0.05",
                         log_path=log, port=port, ready_timeout_s=60)


TOOL_CALLS: list[str] = []


@step(max_tokens=40)
def write(topic):
    return f"Write about {topic} in some words please"


@tool
def lookup(text):
    TOOL_CALLS.append(text)
    return "looked up"


def test_kill_9_mid_run_then_restart_resumes(tmp_path):
    port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
    wf = workflow("durable", base_url=f"http://127.0.0.1:{port}", reconnect_s=60)
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
    with _serve(port, db, log) as (_, proc):
        thread.start()
        deadline = time.monotonic() + 30
        while len(wf._outputs) < 2 and time.monotonic() < deadline:  # a and the tool done
            time.sleep(0.02)
        assert len(wf._outputs) >= 2, "the run did not get going"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    done_before = set(wf._outputs)
    with _serve(port, db, log):  # same port, same state
        thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
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
    with _serve(free_port(), tmp_path / "s.sqlite", tmp_path / "p.log") as (base, _):
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


async def test_resumed_run_is_parked_until_its_client_returns():
    store = RunStore(":memory:")
    graph = Graph.model_validate({"nodes": [{"kind": "llm", "id": "a", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]})
    store.create("wf-old", graph.to_wire())
    engine = FakeEngine(["m"])
    registry = RunRegistry(store, detached_timeout_s=0.0)
    (run,) = await registry.resume_all(Backends({"m": engine}), CostTracker())
    await asyncio.sleep(0.05)
    assert not engine.requests, "an orphaned run took engine capacity"
    await registry.sweep()  # notes it is detached
    await registry.sweep()  # past the (zero) timeout: cancelled
    await asyncio.wait([run.task])
    await registry.io.flush()  # (the store trails the run by its last writes)
    assert store.load("wf-old").status == "cancelled"
