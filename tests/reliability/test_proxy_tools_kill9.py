"""A proxy tool is durable across kill -9 (issue 24 part 1): its result is the step's
``tool.result`` event, so the restarted proxy replays it and never calls the tool again.

The proxy runs in a subprocess (``flowlift serve --engine fake``) with a scripted model
(tests/tools_callables.py ``kill9_responder``): turn 1 calls the configured callable
``side.counted`` (it appends a line to a file), turn 2 streams a long answer; the proxy
is killed during turn 2 and started again on the same state database."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from flowlift import proxy_tool, step, workflow
from flowlift.testing import free_port, running_proxy


@step(tools=[proxy_tool("side.counted")], max_turns=3, max_tokens=400)
def agent(q):
    return q


def _serve(port: int, db: Path, cfg: Path, log: Path):  # type: ignore[no-untyped-def]
    return running_proxy("--engine", "fake", "--state-db", str(db), "--config", str(cfg),
                         "--fake-delay-s", "0.02",
                         "--fake-responder", "tests.tools_callables:kill9_responder",
                         log_path=log, port=port, ready_timeout_s=60)


def test_proxy_tool_result_replays_after_kill_9(tmp_path, monkeypatch):
    count = tmp_path / "count.txt"
    monkeypatch.setenv("COUNT_FILE", str(count))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]))  # `tests.` importable
    cfg = tmp_path / "flowlift.toml"
    cfg.write_text('[tools.side]\ncallables = ["tests.tools_callables:counted"]\n')
    port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
    flow = workflow("kill9-tools", base_url=f"http://127.0.0.1:{port}", reconnect_s=90)
    outs: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with flow:
                outs.append(agent("note it once"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    with _serve(port, db, cfg, log) as (_, proc):
        thread.start()
        deadline = time.monotonic() + 30
        while not (count.exists() and count.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert count.read_text() == "once\n", "the proxy tool never ran"
        time.sleep(0.5)  # turn 2 streams (~4 s): the tool's result is in the log
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with _serve(port, db, cfg, log):
        thread.join(90)
    assert not thread.is_alive() and not errors, errors
    assert outs[0].value.strip().startswith("done")  # type: ignore[attr-defined]
    assert count.read_text() == "once\n"  # replayed, not called again
    assert "run_resumed" in log.read_text()
