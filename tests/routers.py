"""Real routers on loopback for the suite (issue 37 item 4): vllm-router (the PyPI
wheel, a Rust binary) in front of the suite's fake upstreams, and NVIDIA Dynamo's
frontend with simulated (mocker) workers (``.venv-dynamo``: its pins conflict with
flowlift's, see scripts/install.sh).

A test whose router package is missing is skipped, unless ``FLOWLIFT_REQUIRE_ROUTERS=1``
(scripts/test.sh sets it; ``scripts/install.sh --test`` installs the routers): then it
fails, so CI never skips one silently."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

VLLM_ROUTER_VERSION = "0.1.17"
DYNAMO_VERSION = "1.6.1"
DYNAMO_PYTHON = Path(__file__).resolve().parent.parent / ".venv-dynamo" / "bin" / "python"
STARTUP_S = 60.0
DYNAMO_STARTUP_S = 120.0


def require(module: str, package: str, *, present: bool | None = None) -> None:
    """Skip the calling test when ``module`` is not importable (or ``present`` is
    False), or fail it under ``FLOWLIFT_REQUIRE_ROUTERS=1``."""
    if present if present is not None else importlib.util.find_spec(module) is not None:
        return
    message = (f"the router package {package!r} is not installed (scripts/install.sh "
               "--test installs it)")
    if os.environ.get("FLOWLIFT_REQUIRE_ROUTERS") == "1":
        pytest.fail(f"FLOWLIFT_REQUIRE_ROUTERS=1 but {message}")
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def _process(args: Sequence[str], name: str, ready: str, timeout_s: float,
                   env: dict[str, str] | None = None,
                   until: Callable[[aiohttp.ClientResponse], Awaitable[bool]] | None = None
                   ) -> AsyncIterator[None]:
    """Run ``args`` until the context exits; entered once GET ``ready`` answers 200
    (and ``until`` of that answer holds), else the test fails with the process's log."""
    with tempfile.TemporaryFile() as log:  # (a pipe nobody drains would block its logs)
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=log, stderr=asyncio.subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env})
        try:
            if not await _healthy(ready, proc, timeout_s, until):
                log.seek(0)
                out = log.read().decode(errors="replace")
                pytest.fail(f"{name} did not become ready at {ready}: {out[-3000:]}")
            yield
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


@asynccontextmanager
async def vllm_router(workers: Sequence[str], *, policy: str = "consistent_hash",
                      program_scheduling: bool = True) -> AsyncIterator[str]:
    """vllm-router on a free loopback port in front of ``workers`` (their root URLs);
    yields its root URL once ``/health`` answers, and stops it on exit.

    Raises:
        pytest.fail: it did not become healthy within :data:`STARTUP_S` (its log is in
            the message).
    """
    require("vllm_router_rs", f"vllm-router=={VLLM_ROUTER_VERSION}")
    port = free_port()
    args = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--policy", policy, "--log-level", "warning",
            "--worker-urls", *workers]
    if program_scheduling:
        args.append("--enable-program-scheduling")
    url = f"http://127.0.0.1:{port}"
    async with _process(args, "vllm-router", f"{url}/health", STARTUP_S):
        yield url


@asynccontextmanager
async def dynamo(model_path: Path, served: str, workers: int, store: Path
                 ) -> AsyncIterator[str]:
    """Dynamo's frontend (KV routing, session affinity on) and ``workers`` mocker
    workers simulating ``model_path`` (its tokenizer) under the name ``served``, found
    through a file store in ``store`` (no etcd, no NATS: TCP request plane, ZMQ events);
    yields the frontend's root URL once it lists the model.

    Raises:
        pytest.fail: it was not ready within :data:`DYNAMO_STARTUP_S`.
    """
    require("dynamo", f"ai-dynamo=={DYNAMO_VERSION} (.venv-dynamo)",
            present=DYNAMO_PYTHON.is_file())
    port = free_port()
    env = {"DYN_FILE_KV": str(store), "HF_HUB_OFFLINE": "1", "DYN_LOG": "warn"}
    common = ["--discovery-backend", "file"]
    frontend = [str(DYNAMO_PYTHON), "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                "--http-port", str(port), *common, "--request-plane", "tcp",
                "--event-plane", "zmq", "--router-mode", "kv",
                "--router-session-affinity-ttl-secs", "300"]
    mocker = [str(DYNAMO_PYTHON), "-m", "dynamo.mocker", "--model-path", str(model_path),
              "--model-name", served, "--num-workers", str(workers), *common,
              "--enable-prefix-caching", "--speedup-ratio", "10"]
    url = f"http://127.0.0.1:{port}"

    async def listed(resp: aiohttp.ClientResponse) -> bool:
        return any(m.get("id") == served for m in (await resp.json()).get("data", []))
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(_process(
            mocker, "dynamo mocker", f"{url}/health", 0.0, env))  # (started, not waited)
        await stack.enter_async_context(_process(
            frontend, "dynamo frontend", f"{url}/v1/models", DYNAMO_STARTUP_S, env,
            until=listed))
        yield url


async def _healthy(url: str, proc: asyncio.subprocess.Process, timeout_s: float,
                   until: Callable[[aiohttp.ClientResponse], Awaitable[bool]] | None = None
                   ) -> bool:
    """Whether GET ``url`` answered 200 (and ``until`` held) within ``timeout_s`` while
    ``proc`` ran; ``timeout_s`` 0: True at once (a process that needs no wait)."""
    if timeout_s <= 0:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            if proc.returncode is not None:
                break
            try:
                async with session.get(url) as resp:
                    if resp.status == 200 and (until is None or await until(resp)):
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    return False
