"""The GPU memory split (flowlift.local_engine.gpu_memory, engine_plan.share_gpu) on a
simulated CUDA platform: estimates from config numbers, shares that sum under 1 with
headroom, and the check against vLLM's own figure. No GPU, no vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowlift.errors import ConfigError
from flowlift.local_engine import gpu_memory
from flowlift.local_engine.engine_plan import plan_engines
from flowlift.local_engine.engine_settings import GiB, PlatformInfo
from flowlift.local_engine.vllm_engine import VLLMConfig, engine_kwargs, kv_check

# meta-llama/Meta-Llama-3-8B-Instruct's config.json (the sizes that matter)
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA3_8B_PARAMETERS = 8_030_261_248  # as published (model card / safetensors index)
# HuggingFaceTB/SmolLM2-135M-Instruct's config.json
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_hidden_layers": 30, "num_key_value_heads": 3, "vocab_size": 49152,
           "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
H100 = PlatformInfo("cuda", 80 * GiB, "NVIDIA H100 80GB HBM3")


def test_parameters_from_config_match_the_published_counts():
    assert gpu_memory.ModelShape.from_config(LLAMA3_8B).parameters() == LLAMA3_8B_PARAMETERS
    assert gpu_memory.ModelShape.from_config(SMOLLM2).parameters() == 134_515_008


def test_kv_bytes_per_token_is_vllms_formula():
    # num_layers x 2 x num_kv_heads x head_dim x dtype bytes = 32 x 2 x 8 x 128 x 2
    assert gpu_memory.ModelShape.from_config(LLAMA3_8B).kv_bytes_per_token(2) == 131_072


def test_estimate_is_within_25_percent_of_a_worked_example():
    # Worked example, vLLM's accounting for Llama-3-8B in bf16 with 16 requests of
    # 8192 tokens: weights = 8,030,261,248 params x 2 bytes = 16.06 GB; KV cache =
    # 16 x 8192 tokens x (32 x 2 x 8 x 128 x 2) bytes = 17.18 GB; 33.24 GB before the
    # profiled activations (0.5-2 GiB in vLLM's logs for this model).
    worked = LLAMA3_8B_PARAMETERS * 2 + 16 * 8192 * 32 * 2 * 8 * 128 * 2
    est = gpu_memory.estimate(gpu_memory.ModelShape.from_config(LLAMA3_8B), "bfloat16",
                              max_model_len=8192, concurrency=16, max_num_seqs=1024,
                              max_num_batched_tokens=8192)
    assert est.weights == LLAMA3_8B_PARAMETERS * 2
    assert est.kv_tokens == 16 * 8192
    assert 1.0 <= est.total / worked <= 1.25, est.total / worked
    # the estimate this replaces (weights + kv_cache_space_gib 2 + 1 GiB) was 18.4 GB
    assert est.total / (LLAMA3_8B_PARAMETERS * 2 + 3 * GiB) > 1.8


def _needs(*configs: dict[str, object], len_: int = 8192) -> dict[str, int]:
    return {f"m{i}": gpu_memory.estimate(gpu_memory.ModelShape.from_config(c), "bfloat16",
                                         max_model_len=len_, concurrency=16,
                                         max_num_seqs=1024,
                                         max_num_batched_tokens=8192).total
            for i, c in enumerate(configs)}


@pytest.mark.parametrize("models", [(LLAMA3_8B, LLAMA3_8B), (LLAMA3_8B, SMOLLM2),
                                    (SMOLLM2, SMOLLM2, SMOLLM2)])
def test_two_models_shares_sum_under_1_with_headroom(models):
    shares = gpu_memory.split(H100.total_memory_bytes, _needs(*models))
    headroom = gpu_memory.headroom_bytes(H100.total_memory_bytes, len(models))
    assert sum(shares.values()) <= 1 - headroom / H100.total_memory_bytes
    assert sum(shares.values()) < 0.96
    needs = _needs(*models)
    for name, share in shares.items():  # each gets at least its estimate
        assert share * H100.total_memory_bytes >= needs[name] * 0.999


def test_with_a_budget_each_engine_gets_its_need():
    needs = _needs(LLAMA3_8B, SMOLLM2)
    shares = gpu_memory.split(H100.total_memory_bytes, needs, budget_bytes=40 * GiB)
    for name, share in shares.items():
        assert share == pytest.approx(needs[name] / H100.total_memory_bytes, abs=1e-4)


def test_what_does_not_fit_is_a_config_error_naming_the_flag():
    three = _needs(LLAMA3_8B, LLAMA3_8B, LLAMA3_8B)
    with pytest.raises(ConfigError) as err:
        gpu_memory.split(H100.total_memory_bytes, three)
    assert err.value.param == "--memory-budget-mb"
    gpu_memory.split(H100.total_memory_bytes, three, budget_bytes=70 * GiB)  # in turn
    with pytest.raises(ConfigError, match="lower it"):
        gpu_memory.split(H100.total_memory_bytes, three, budget_bytes=80 * GiB)
    with pytest.raises(ConfigError) as big:
        gpu_memory.split(24 * GiB, _needs(LLAMA3_8B))
    assert big.value.param == "--max-model-len"


def test_a_config_without_a_size_names_the_key():
    with pytest.raises(ConfigError) as err:
        gpu_memory.ModelShape.from_config({"hidden_size": 8})
    assert err.value.param == "num_attention_heads"


def _folder(root: Path, name: str, config: dict[str, object]) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_plan_engines_gives_each_engine_its_share(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIFT_CACHE_DIR", str(tmp_path / "cache"))
    models = [_folder(tmp_path, "llama", LLAMA3_8B), _folder(tmp_path, "smol", SMOLLM2)]
    plans = plan_engines(models, max_concurrency=16, platform=H100, max_model_len=8192)
    shares = [engine_kwargs(p.config)["gpu_memory_utilization"] for p in plans]
    assert all(0 < s < 1 for s in shares) and sum(shares) < 0.96
    assert shares[0] > 5 * shares[1]
    assert plans[0].config.planned_kv_tokens == 16 * 8192
    budgeted = plan_engines(models, max_concurrency=16, platform=H100, max_model_len=8192,
                            budget_mb=40 * 1024)
    assert budgeted[0].memory_mb == pytest.approx(
        budgeted[0].config.gpu_memory_utilization * 80 * 1024, rel=1e-3)


def test_check_against_vllms_figure():
    assert gpu_memory.check_kv(131072, 8192, 16).ok
    low = gpu_memory.check_kv(131072, 4000, 16)
    assert not low.ok and "LESS than planned" in low.message
    engine = SimpleNamespace(vllm_config=SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=4000, block_size=16)))
    config = VLLMConfig(model="/m", served_model_name="m", planned_kv_tokens=131072)
    check = kv_check(config, engine)
    assert check is not None and check.vllm_tokens == 64000 and not check.ok
    assert kv_check(VLLMConfig(model="/m", served_model_name="m"), engine) is None
    assert kv_check(config, SimpleNamespace()) is None


def _serve_args(models: list[str]) -> object:
    from flowlift import cli

    extra = [a for m in models[1:] for a in ("--extra-model", m)]
    return cli.build_parser().parse_args(["serve", "--engine", "vllm", "--model", models[0],
                                          "--max-model-len", "8192", *extra])


def test_serve_gives_two_models_shares_that_fit_one_gpu(tmp_path, monkeypatch):
    from flowlift import cli
    from flowlift.local_engine import engine_plan

    monkeypatch.setenv("FLOWLIFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(engine_plan, "detect_platform", lambda: H100)
    models = [_folder(tmp_path, "llama", LLAMA3_8B), _folder(tmp_path, "llama2", LLAMA3_8B)]
    engines, _ = cli._engines(_serve_args(models))
    shares = [e.config.gpu_memory_utilization for e in engines.values()]  # type: ignore[attr-defined]
    assert len(shares) == 2 and sum(shares) < 0.96  # vLLM's default: 0.92 each
    small = PlatformInfo("cuda", 40 * GiB, "NVIDIA A100-PCIE-40GB")
    monkeypatch.setattr(engine_plan, "detect_platform", lambda: small)
    with pytest.raises(ConfigError) as err:
        cli._engines(_serve_args(models))
    assert err.value.param == "--memory-budget-mb"
