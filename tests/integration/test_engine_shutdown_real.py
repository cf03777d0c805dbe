"""A stream on the real vLLM engine fails with EngineError, promptly, when the engine is
closed (a residency unload, a shutdown) under it, instead of hanging: vLLM's shutdown
stops the task that feeds the request's output queue (tests/local_engine/test_vllm_engine_close.py
has the same check on a stand-in). Starts its own engine (not the session's shared one,
which this test would close)."""

from __future__ import annotations

import asyncio
import time

import pytest

from flowlift.errors import EngineError
from flowlift.local_engine.base import ChatMessage, GenerationRequest, SamplingOptions

pytestmark = pytest.mark.engine


async def _close_under_running_streams() -> float:
    from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine

    engine = VLLMEngine(VLLMConfig.for_model(None, max_num_seqs=4, kv_cache_space_gib=1))
    await engine.start()
    eos = engine._tokenizer.eos_token_id
    sampling = SamplingOptions(max_tokens=1000, temperature=0.0,
                               logit_bias=() if eos is None else ((int(eos), -100.0),))
    streams = [engine.generate(GenerationRequest(
        f"long-{i}", engine.config.served_model_name,
        (ChatMessage("user", "Count from 1 to 1000."),), sampling)) for i in range(3)]
    for stream in streams:
        await anext(stream)
    t0 = time.monotonic()
    await engine.close()
    for stream in streams:
        with pytest.raises(EngineError, match="shut down"):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
    return time.monotonic() - t0


def test_streams_fail_when_the_engine_is_closed_under_them() -> None:
    pytest.importorskip("vllm")
    took_s = asyncio.run(_close_under_running_streams())
    assert took_s < 30  # the close itself blocks up to ~6 s
