"""Shared fixtures: the proxy on a FakeEngine (no model)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import settings

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine

# The model cache defaults to the user's ~/.cache/flowlift; the suite keeps the checkout's
# own (.cache/flowlift, where scripts/test.sh puts it), so it never converts
# the model again wherever pytest is started from.
os.environ.setdefault("FLOWLIFT_CACHE_DIR",
                      str(Path(__file__).resolve().parent.parent / ".cache" / "flowlift"))
pytest_plugins = ("tests.pg",)  # postgres_url, pg_url: a real PostgreSQL server

# Per-example deadlines measure the machine, not the code: on a shared 2-core CI box a
# 1 ms example can take 400 ms once. Properties are checked; speed belongs to bench/.
settings.register_profile("flowlift", deadline=None)
settings.load_profile("flowlift")


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(["fake-model", "other-model"])


@pytest.fixture
def make_app(engine: FakeEngine):
    def make(config: ProxyConfig | None = None) -> web.Application:
        return create_app({"fake-model": engine, "other-model": engine}, config)
    return make


@pytest.fixture
async def client(aiohttp_client, make_app):
    app = make_app()
    c = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return c


@pytest.fixture
def engine_configs(monkeypatch, tmp_path: Path) -> list[Any]:
    """The ``VLLMConfig`` each engine ``flowlift serve`` builds gets, in order
    (``VLLMConfig.for_model`` stubbed: no model is prepared, no engine started)."""
    from flowlift.local_engine.vllm_engine import VLLMConfig

    for key in ("HF_HUB_OFFLINE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):  # VLLMEngine() sets them
        monkeypatch.setenv(key, "test")
    seen: list[VLLMConfig] = []
    monkeypatch.setattr(VLLMConfig, "for_model", classmethod(
        lambda cls, name=None, **kw: seen.append(cls(model=str(tmp_path), served_model_name="m",
                                                     **kw)) or seen[-1]))
    return seen


def _has_gpu() -> bool:
    """An NVIDIA GPU is listed by ``nvidia-smi -L``."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return False
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.returncode == 0 and "GPU" in out.stdout


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Tests marked ``gpu`` need a real CUDA GPU: skipped on machines without one."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (nvidia-smi lists none)")
        for item in gpu_items:
            item.add_marker(skip)
