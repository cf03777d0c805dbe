"""Kill -9 under load, beyond ``tests/proxy/test_durable.py`` (one run, killed between steps):
eight runs at once, killed while their ``@tool`` steps are *running in the client*, so
results are posted to a dead proxy and must be re-posted to the restarted one; then
killed again in the next wave. Every run resumes and succeeds, finished steps keep their
values and never run again, and each tool's side effect happens exactly once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from flowlift import step, tool, workflow
from flowlift.proxy.store.sqlite import RunStore
from flowlift.testing import free_port, running_proxy

RUNS = 8
EFFECTS: Counter[str] = Counter()
_LOCK = threading.Lock()
TOOL_STARTED = threading.Event()


@step(max_tokens=24)
def draft(topic, tag):
    return f"Draft note {tag} on {topic} in a few words"


@tool
def publish(text):
    """The side effect: counted once per call (a real tool would write somewhere)."""
    TOOL_STARTED.set()
    time.sleep(0.8)  # long enough that the proxy dies while it runs
    with _LOCK:
        EFFECTS[text] += 1
    return f"published {len(text)} chars"


def _serve(port: int, db: Path, log: Path):  # type: ignore[no-untyped-def]
    return running_proxy("--engine", "fake", "--state-db", str(db), "--fake-delay-s", "0.02",
                         log_path=log, port=port, ready_timeout_s=60)


def _kill(proc) -> None:  # type: ignore[no-untyped-def]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_kill_9_while_tools_run_in_the_client_twice(tmp_path):
    port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
    flows = [workflow(f"kill9-{i}", base_url=f"http://127.0.0.1:{port}", reconnect_s=90)
             for i in range(RUNS)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with flows[i]:
                a = draft(f"topic {i}", i)
                b = draft(publish(a), i)
                c = draft(b, i)
                draft(publish(c), i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(RUNS)]
    with _serve(port, db, log) as (_, proc):
        for t in threads:
            t.start()
        assert TOOL_STARTED.wait(30), "no tool step started"
        time.sleep(0.2)
        _kill(proc)  # first kill: the first tools are running in the client
    before = [dict(f._outputs) for f in flows]
    TOOL_STARTED.clear()
    with _serve(port, db, log) as (_, proc):
        deadline = time.monotonic() + 60
        while sum(len(f._outputs) for f in flows) < 3 * RUNS and time.monotonic() < deadline:
            time.sleep(0.02)
        assert TOOL_STARTED.wait(30)
        _kill(proc)  # second kill: the second wave of tools is out
    with _serve(port, db, log):
        for t in threads:
            t.join(timeout=90)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert [f.status for f in flows] == ["succeeded"] * RUNS
    assert sum(EFFECTS.values()) == 2 * RUNS and set(EFFECTS.values()) == {1}, EFFECTS
    store = RunStore(db)
    for flow, seen in zip(flows, before, strict=True):
        assert len(flow._outputs) == 6
        for step_id, value in seen.items():  # nothing finished was lost or changed
            assert flow._outputs[step_id] == value
        stored = store.load(flow.run_id)
        finished = [d["step_id"] for _, n, d in stored.events if n == "step.finished"]
        assert len(finished) == len(set(finished)) == 6, "a finished step ran again"
        assert [n for _, n, _ in stored.events].count("run.resumed") >= 1
        assert stored.status == "succeeded"
