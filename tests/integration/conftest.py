"""One real proxy with the real vLLM engine and model, started once per test session."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

READY_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def real_proxy(tmp_path_factory: pytest.TempPathFactory):
    """Base URL of ``flowlift serve`` on the embedded vLLM engine (default model)."""
    if importlib.util.find_spec("vllm") is None:
        msg = "vLLM is not installed: run `bash scripts/install.sh`"
        if os.environ.get("FLOWLIFT_REQUIRE_ENGINE"):
            pytest.fail(msg)
        pytest.skip(msg)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    trace_dir = tmp_path_factory.mktemp("traces")
    log_path = Path(tmp_path_factory.mktemp("logs")) / "proxy.log"
    cmd = [sys.executable, "-m", "flowlift.cli", "serve", "--port", str(port),
           "--trace-dir", str(trace_dir), "--max-concurrency", "8"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"proxy exited ({proc.returncode}): {log_path.read_text()[-4000:]}")
            try:
                r = httpx.get(f"{base}/readyz", timeout=2)
                if r.status_code == 200:
                    break
                if r.json().get("error"):
                    pytest.fail(f"engine failed to load: {r.json()['error']}")
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                pytest.fail(f"engine not ready in {READY_TIMEOUT_S} s: "
                            f"{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield {"base_url": base, "trace_dir": trace_dir, "log": log_path,
               "model": r.json()["models"][0]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
