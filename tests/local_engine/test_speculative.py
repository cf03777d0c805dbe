"""n-gram (prompt-lookup) speculative decoding: ``flowlift serve --speculative-ngram K``
reaches vLLM's engine arguments as ``speculative_config`` (method ``ngram``)."""

from __future__ import annotations

import argparse

import pytest

from flowlift.cli import build_parser
from flowlift.errors import EngineError
from flowlift.local_engine.vllm_engine import VLLMConfig, engine_kwargs, speculative_config


def _config(**kw: object) -> VLLMConfig:
    return VLLMConfig(model="/models/m", served_model_name="m", **kw)  # type: ignore[arg-type]


def test_off_by_default_and_ngram_with_k():
    assert speculative_config(_config()) is None
    assert engine_kwargs(_config())["speculative_config"] is None
    spec = engine_kwargs(_config(speculative_ngram=4))["speculative_config"]
    assert spec == {"method": "ngram", "num_speculative_tokens": 4,
                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def test_speculation_only_up_to_a_batch_size():
    spec = speculative_config(_config(speculative_ngram=4, speculative_max_batch=1,
                                      max_num_seqs=8))
    assert spec is not None
    assert spec["num_speculative_tokens_per_batch_size"] == [(1, 1, 4), (2, 8, 0)]
    whole = speculative_config(_config(speculative_ngram=3, speculative_max_batch=16,
                                       max_num_seqs=16))
    assert whole is not None and whole["num_speculative_tokens_per_batch_size"] == [(1, 16, 3)]
    with pytest.raises(EngineError, match="speculative_max_batch must be at least 1"):
        speculative_config(_config(speculative_ngram=3, speculative_max_batch=0))


def test_k_below_one_is_refused():
    with pytest.raises(EngineError, match="at least 1 token"):
        speculative_config(_config(speculative_ngram=0))


def test_the_serve_flag_reaches_the_engine_config(engine_configs):
    from flowlift import cli

    args = build_parser().parse_args(["serve", "--speculative-ngram", "3",
                                      "--speculative-max-batch", "2"])
    assert isinstance(args, argparse.Namespace)
    engines, _ = cli._engines(args)
    config = engine_configs[-1]
    assert (config.speculative_ngram, config.speculative_max_batch) == (3, 2)
    assert engine_kwargs(config)["speculative_config"]["num_speculative_tokens"] == 3
    assert list(engines) == ["m"]


@pytest.mark.engine
def test_vllm_takes_it_as_an_ngram_speculative_config():
    """vLLM's own config validation accepts the arguments (no engine is started)."""
    from flowlift.local_engine.vllm_engine import set_env_defaults

    cfg = VLLMConfig.for_model(None, speculative_ngram=4, speculative_max_batch=1,
                               max_num_seqs=8)
    set_env_defaults(cfg)
    from vllm import AsyncEngineArgs

    spec = AsyncEngineArgs(**engine_kwargs(cfg)).create_engine_config().speculative_config
    assert spec is not None and spec.method == "ngram"
    assert spec.num_speculative_tokens == 4
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 4)
    assert spec.num_speculative_tokens_per_batch_size == [(1, 1, 4), (2, 8, 0)]
