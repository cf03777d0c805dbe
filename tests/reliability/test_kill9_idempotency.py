"""Case N11 with a real kill -9: A -> B -> C on an upstream model, the proxy killed
while B's upstream request is in flight, restarted on the same state database. B is
re-sent once, with the same ``Idempotency-Key`` (``run:step:attempt``), so a provider
that honours the key bills it once; A (durable before the kill) is not re-sent; C runs
once with B's output."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from aiohttp import web

from flowlift.testing import free_port, running_proxy
from tests.upstream_fake import chunk, sse_bytes

RUN_ID = "wf-n11-kill"


class CountingUpstream:
    """An OpenAI-compatible upstream in a thread of its own (it must outlive the
    proxy's process): records each request's ``Idempotency-Key`` and prompt; the first
    request for step B never answers (the proxy is killed while it waits)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.calls: list[tuple[str | None, str]] = []
        self.b_in_flight = threading.Event()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        self.calls.append((request.headers.get("Idempotency-Key"), prompt))
        if prompt.startswith("B") and not self.b_in_flight.is_set():
            self.b_in_flight.set()
            await asyncio.sleep(60)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in sse_bytes(chunk({"content": f"out({prompt})"}), chunk({}, "stop")):
            await resp.write(piece)
        return resp

    @contextmanager
    def running(self) -> Iterator[None]:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)


def _config(tmp_path: Path, upstream_port: int) -> Path:
    path = tmp_path / "flowlift.toml"
    path.write_text(f'[backends.up]\nkind = "openai"\n'
                    f'base_url = "http://127.0.0.1:{upstream_port}/v1"\n'
                    '[models.up]\nbackends = ["up"]\n')
    return path


def _step(node_id: str, text: str, after: str | None = None) -> dict[str, object]:
    content: list[dict[str, object]] = [{"text": text}]
    if after is not None:
        content.append({"ref": after, "path": []})
    return {"kind": "llm", "id": node_id, "model": "up",
            "messages": [{"role": "user", "content": content}]}


def _follow(base: str, path: str, body: dict[str, object] | None = None) -> None:
    """Read a run's event stream until it ends or the proxy dies (errors ignored)."""
    try:
        with httpx.Client(timeout=30) as client:
            method = "POST" if body is not None else "GET"
            with client.stream(method, base + path, json=body) as resp:
                for _ in resp.iter_bytes():
                    pass
    except httpx.HTTPError:
        pass


def test_N11_a_step_resent_after_kill_9_carries_the_same_idempotency_key(tmp_path):
    upstream = CountingUpstream()
    port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
    serve = ("--engine", "none", "--config", str(_config(tmp_path, upstream.port)),
             "--state-db", str(db))
    graph = {"id": RUN_ID, "nodes": [_step("a", "A"), _step("b", "B ", "a"),
                                     _step("c", "C ", "b")]}
    with upstream.running():
        with running_proxy(*serve, log_path=log, port=port, ready_timeout_s=60) as (base, proc):
            client = threading.Thread(target=_follow, args=(base, "/v1/workflows", graph),
                                      daemon=True)
            client.start()
            assert upstream.b_in_flight.wait(30), "B was never sent"
            time.sleep(0.2)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        with running_proxy(*serve, log_path=log, port=port, ready_timeout_s=60) as (base, _):
            _follow(base, f"/v1/workflows/{RUN_ID}/events")  # the client comes back
            status = httpx.get(f"{base}/v1/workflows/{RUN_ID}", timeout=10).json()
    assert status["status"] == "succeeded", json.dumps(status)[:2000]
    keys = [key for key, _ in upstream.calls]
    assert keys == [f"{RUN_ID}:a:1", f"{RUN_ID}:b:1", f"{RUN_ID}:b:1", f"{RUN_ID}:c:1"], \
        upstream.calls
    assert status["outputs"]["c"] == "out(C out(B out(A)))"
