"""Real routers on loopback for the suite (issue 37 item 4): start vllm-router (the
PyPI wheel, a Rust binary) in front of the suite's fake upstreams.

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
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import aiohttp
import pytest

VLLM_ROUTER_VERSION = "0.1.17"
STARTUP_S = 60.0


def require(module: str, package: str) -> None:
    """Skip the calling test when ``module`` is not importable, or fail it under
    ``FLOWLIFT_REQUIRE_ROUTERS=1``."""
    if importlib.util.find_spec(module) is not None:
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
    with tempfile.TemporaryFile() as log:  # (a pipe nobody drains would block its logs)
        proc = await asyncio.create_subprocess_exec(*args, stdout=log,
                                                    stderr=asyncio.subprocess.STDOUT)
        try:
            if not await _healthy(url, proc):
                log.seek(0)
                out = log.read().decode(errors="replace")
                pytest.fail(f"vllm-router did not become healthy at {url}: {out[-2000:]}")
            yield url
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


async def _healthy(url: str, proc: asyncio.subprocess.Process) -> bool:
    loop = asyncio.get_running_loop()
    until = loop.time() + STARTUP_S
    async with aiohttp.ClientSession() as session:
        while loop.time() < until:
            if proc.returncode is not None:
                break
            try:
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    return False
