"""bench/peers (issue 35): both sides get the same engine arguments, the workload
plan is the same for every arm, and the token accounting of a turn."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers import servers, workload
from flowlift.local_engine.vllm_engine import VLLMConfig, engine_kwargs


def test_both_sides_get_the_same_engine_arguments():
    args = servers.EngineArgs("/m", kv_cache_gib=1, max_num_seqs=16, kv_cache_blocks=64,
                              extra_env=(("OMP_NUM_THREADS", "1"),))
    stock = servers.stock_command(args, 8000)
    ours = servers.flowlift_args(args)
    for flag, value in (("--max-num-seqs", "16"), ("--num-gpu-blocks-override", "64"),
                        ("--dtype", "float32"), ("--max-model-len", "4096")):
        assert stock[stock.index(flag) + 1] == value
    assert {"--enforce-eager", "--enable-prefix-caching"} <= set(stock)
    assert ours[ours.index("--kv-cache-blocks") + 1] == "64"
    assert ours[ours.index("--max-concurrency") + 1] == "16"
    env = args.env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    kwargs = engine_kwargs(VLLMConfig(model="/m", served_model_name="m", kv_cache_blocks=64))
    assert kwargs["num_gpu_blocks_override"] == 64  # what --kv-cache-blocks sets
    assert "num_gpu_blocks_override" not in engine_kwargs(VLLMConfig("/m", "m"))


def test_the_plan_is_seeded_and_mixed():
    a = workload.plan(32, seed=0)
    assert a == workload.plan(32, seed=0) and a != workload.plan(32, seed=1)
    assert sorted(p.turns for p in a) == sorted(workload.MIXED_TURNS * 2)
    assert all(0.2 <= w <= 3.0 for p in a for w in p.tool_waits_s)
    assert [p.arrival_s for p in a[:3]] == [0.0, 0.2, 0.4]


def test_re_prefilled_tokens_count_what_the_cache_lost_of_the_previous_turn():
    rows = [{"prompt_tokens": 300, "cached_tokens": 0, "reusable_tokens": 0},
            {"prompt_tokens": 400, "cached_tokens": 256, "reusable_tokens": 316},
            {"prompt_tokens": 500, "cached_tokens": 0, "reusable_tokens": 416}]
    t = workload.token_totals(rows)
    assert t == {"prompt_tokens": 1200, "cached_tokens": 256, "prefilled_tokens": 944,
                 "reprefilled_tokens": 60 + 416}
