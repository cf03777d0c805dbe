"""The CUDA extra's vLLM pin (flowlift.local_engine.vllm_pin): read from flowlift's
metadata, checked by the GPU image's build (tests/project/test_deploy.py checks the Dockerfile
runs it and that its base image is inside the pin)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

from flowlift.local_engine import vllm_pin

ROOT = Path(__file__).resolve().parents[2]
REQUIRES = ['aiohttp>=3.9', 'vllm<0.35,>=0.33; extra == "cuda"',
            'gguf>=0.17; extra == "convert"']


def test_the_pin_is_read_from_the_cuda_extra():
    spec = vllm_pin.pinned_range(REQUIRES)
    assert spec.contains("0.33.0") and spec.contains("0.34.1")
    assert not spec.contains("0.32.0") and not spec.contains("0.35.0")
    with pytest.raises(LookupError):
        vllm_pin.pinned_range(['gguf>=0.17; extra == "convert"'])


def test_pyproject_pins_the_range_docs_gpu_names():
    cuda = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["cuda"]
    spec = vllm_pin.pinned_range([f'{r}; extra == "cuda"' for r in cuda])
    assert str(spec) in ("<0.35,>=0.33", ">=0.33,<0.35")
    assert "vllm>=0.33,<0.35" in (ROOT / "docs" / "gpu.md").read_text()


def test_outside_and_main(monkeypatch, capsys):
    spec = vllm_pin.pinned_range(REQUIRES)
    assert vllm_pin.outside("0.34.0", spec) is None
    assert "0.36.0 is outside" in (vllm_pin.outside("0.36.0", spec) or "")
    monkeypatch.setattr(vllm_pin, "pinned_range", lambda: spec)
    monkeypatch.setattr(importlib.metadata, "version", lambda _name: "0.36.0")
    assert vllm_pin.main() == 1
    assert "outside" in capsys.readouterr().err
    monkeypatch.setattr(importlib.metadata, "version", lambda _name: "0.33.0")
    assert vllm_pin.main() == 0
