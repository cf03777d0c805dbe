"""One real proxy with the real vLLM engine and model, started once per test session."""

from __future__ import annotations

import importlib.util
import os

import pytest

from flowlift.testing import running_proxy


@pytest.fixture(scope="session")
def real_proxy(tmp_path_factory: pytest.TempPathFactory):
    """Base URL etc. of ``flowlift serve`` on the embedded vLLM engine (default model)."""
    if importlib.util.find_spec("vllm") is None:
        msg = "vLLM is not installed: run `bash scripts/install.sh`"
        if os.environ.get("FLOWLIFT_REQUIRE_ENGINE"):
            pytest.fail(msg)
        pytest.skip(msg)
    trace_dir = tmp_path_factory.mktemp("traces")
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    args = ("--trace-dir", str(trace_dir), "--max-concurrency", "8", "--state-db",
            str(tmp_path_factory.mktemp("state") / "state.sqlite"))
    try:
        with running_proxy(*args, log_path=log) as (base, _):
            import httpx

            model = httpx.get(f"{base}/readyz").json()["models"][0]
            yield {"base_url": base, "trace_dir": trace_dir, "log": log, "model": model}
    except RuntimeError as exc:
        pytest.fail(str(exc))
