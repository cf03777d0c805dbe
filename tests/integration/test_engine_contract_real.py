"""The engine contract (tests/engine_contract.py) on the embedded vLLM engine: the same
checks FakeEngine passes, run on the session's one engine (tests/integration/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_contract import CHECKS, Target

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def target(engine_host: dict[str, Any]) -> Target:
    engine = engine_host["host"].engine
    eos = engine._tokenizer.eos_token_id  # counting prompts must run to max_tokens
    return Target(engine=engine, model=engine_host["model"], slots=engine.config.max_num_seqs,
                  ban_tokens=() if eos is None else (int(eos),))


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_vllm_engine_meets_the_contract(name: str, target: Target,
                                        engine_host: dict[str, Any]) -> None:
    host = engine_host["host"]
    host.call(CHECKS[name](target), 600)
    assert host.engine.running() == 0
