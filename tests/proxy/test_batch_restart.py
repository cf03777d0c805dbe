"""kill -9 the proxy while it polls a batch, start it again: the run waits for the batch
it submitted before and nothing is submitted twice (flowlift.proxy.workflows.tiering)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from flowlift.testing import FakeBatchAPI, free_port, parse_sse, running_proxy


class ServedFake:
    """The fake Batch API on a real port, in a thread of its own."""

    def __init__(self, api: FakeBatchAPI) -> None:
        self.api, self.port = api, free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.api.app())
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> ServedFake:
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_kill_9_while_polling_a_batch_then_restart_submits_nothing_twice(
        tmp_path: Path) -> None:
    api = FakeBatchAPI(turnaround=lambda rng: 4.0)
    with ServedFake(api) as fake:
        config = tmp_path / "flowlift.toml"
        config.write_text(f"""
[backends.std]
kind = "openai"
base_url = "http://127.0.0.1:9/v1"

[backends.b]
kind = "openai-batch"
base_url = "http://127.0.0.1:{fake.port}/v1"
poll_initial_s = 0.1
poll_max_s = 0.2

[models.up]
backends = ["std"]
batch = "b"
price_per_1k_tokens = 1.0
""")
        port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
        graph = {"id": "wf-kill9", "deadline_s": 86400, "nodes": [{
            "kind": "llm", "id": "s0", "model": "up", "params": {"max_tokens": 16},
            "messages": [{"role": "user", "content": [{"text": "survive"}]}]}]}
        args = ("--engine", "none", "--config", str(config), "--state-db", str(db))

        def start() -> None:
            try:
                httpx.post(f"http://127.0.0.1:{port}/v1/workflows", json=graph, timeout=60)
            except httpx.HTTPError:
                return  # the proxy was killed under it
        with running_proxy(*args, log_path=log, port=port, ready_timeout_s=60) as (_, proc):
            client = threading.Thread(target=start, daemon=True)
            client.start()
            deadline = time.monotonic() + 20
            while not api.batches and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(api.batches) == 1, "the step was not submitted"
            time.sleep(0.5)  # polling now
            (batch,) = api.batches.values()
            assert not batch.finished
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        posts = [r for r in api.requests if r[0] == "POST"]
        with running_proxy(*args, log_path=log, port=port, ready_timeout_s=60) as (base, _):
            text = httpx.get(f"{base}/v1/workflows/wf-kill9/events", timeout=60).text
        events = parse_sse(text)
        assert [d["value"] for e, d in events if e == "step.finished"] == ["echo: survive"]
        assert len(api.batches) == 1, "the line was submitted twice"
        assert [r for r in api.requests if r[0] == "POST"] == posts  # nothing uploaded again
        states = [d["state"] for e, d in events if e == "step.batch"]
        assert states == ["uploaded", "submitted", "finished"]
