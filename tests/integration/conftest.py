"""One real vLLM engine per test session, in this process, shared by every real-engine test.

The engine and an in-process proxy on a real port (``real_proxy``: the same base URL,
trace dir, log and model keys as ``flowlift serve`` in a subprocess had) run on one event
loop in a background thread, so synchronous HTTP tests can call the proxy while the loop
keeps serving, and async contract checks run on that loop through
:meth:`EngineHost.call` (vLLM's ``AsyncLLM`` is bound to the loop that started it).
``FLOWLIFT_REQUIRE_ENGINE=1`` turns "vLLM is not installed" from a skip into a failure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

T = TypeVar("T")
MAX_NUM_SEQS = 8


class EngineHost:
    """An event loop in a daemon thread running the proxy app and its vLLM engine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine-loop",
                                       daemon=True)
        self.thread.start()
        self.engine: Any = None
        self.runner: Any = None
        self.base_url = ""

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 600.0) -> T:
        """Run ``coro`` on the engine's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self, trace_dir: Path, state_db: Path) -> None:
        from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine
        from flowlift.proxy import ProxyConfig, create_app
        from flowlift.testing import free_port

        config = VLLMConfig.for_model(None, max_num_seqs=MAX_NUM_SEQS)
        self.engine = VLLMEngine(config)
        app = create_app({config.served_model_name: self.engine},
                         ProxyConfig(max_concurrency=MAX_NUM_SEQS, trace_dir=trace_dir,
                                     state_path=state_db))
        port = free_port()

        async def serve() -> Any:
            from aiohttp import web

            runner = web.AppRunner(app, shutdown_timeout=30)
            await runner.setup()  # starts loading the engine in the background
            await web.TCPSite(runner, "127.0.0.1", port).start()
            return runner

        # the engine loads on this loop and blocks it while it does (20-100 s)
        self.runner = self.call(serve(), 900)
        self.base_url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout_s: float = 900.0) -> dict[str, Any]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                r = httpx.get(f"{self.base_url}/readyz", timeout=5)
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 200:
                return dict(r.json())
            if r is not None and r.json().get("error"):
                raise RuntimeError(f"engine failed to load: {r.json()['error']}")
            time.sleep(0.2)
        raise RuntimeError(f"proxy not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.runner is not None:
            self.call(self.runner.cleanup(), 120)  # closes the engine too
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        if not self.thread.is_alive():
            self.loop.close()


@pytest.fixture(scope="session")
def engine_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The session's one real engine and proxy (see the module docstring)."""
    if importlib.util.find_spec("vllm") is None:
        msg = "vLLM is not installed: run `bash scripts/install.sh`"
        if os.environ.get("FLOWLIFT_REQUIRE_ENGINE"):
            pytest.fail(msg)
        pytest.skip(msg)
    trace_dir = tmp_path_factory.mktemp("traces")
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    handler = logging.FileHandler(log)
    logging.getLogger().addHandler(handler)
    host = EngineHost()
    try:
        host.start(trace_dir, tmp_path_factory.mktemp("state") / "state.sqlite")
        ready = host.wait_ready()
        yield {"host": host, "base_url": host.base_url, "trace_dir": trace_dir, "log": log,
               "model": ready["models"][0]}
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"the real engine did not start: {type(exc).__name__}: {exc}")
    finally:
        host.stop()
        logging.getLogger().removeHandler(handler)
        handler.close()


@pytest.fixture(scope="session")
def real_proxy(engine_host: dict[str, Any]) -> dict[str, Any]:
    """Base URL, trace dir, log path and model of the proxy on the real engine."""
    return {k: engine_host[k] for k in ("base_url", "trace_dir", "log", "model")}
