"""Prefill-ahead on the embedded vLLM engine: the KV of a prompt's known start, computed
before the rest of the prompt exists, and how full the KV cache is.

vLLM's automatic prefix caching keeps the KV blocks of finished requests, keyed by the
hash of their tokens, until the memory is needed (least recently used blocks are
evicted first). A request that runs only the known start of a later prompt (one output
token, then it ends) leaves those blocks cached, so the later request prefills only the
rest (``Usage.cached_tokens``). Only whole blocks are cached: a prefix shorter than one
block (``block_size`` tokens, 128 on the CPU build) is not worth sending.

Sources: vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_utils.py``,
block hashes over token ids); KVFlow (2025) and NVIDIA Dynamo prefill ahead of a
*predicted* next agent step; flowlift knows the next step from the workflow graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from flowlift.errors import RequestError
from flowlift.local_engine.base import Usage


def prefix_ids(ids_of: Any, text: str, upto: str, param: str = "messages") -> list[int]:
    """Token ids of ``text`` up to the first ``upto`` (the marker left out), less its last
    token (the next piece of text may merge with it into another token).

    Args:
        ids_of: ``str -> list[int]`` (the tokenizer's encode, as ``generate`` uses it).
        text: the whole prompt text (chat template applied).
        upto: the marker.
        param: names the field in the error.

    Raises:
        RequestError: ``upto`` does not occur in ``text``.
    """
    cut = text.find(upto)
    if cut < 0:
        raise RequestError("prefill-ahead: the marker is not in the prompt", param=param)
    ids = list(ids_of(text[:cut]))
    return ids[:-1]


def capacity_tokens(engine: Any) -> int | None:
    """Tokens ``engine``'s KV cache (a vLLM ``AsyncLLM``) holds: ``num_gpu_blocks *
    block_size``; ``None`` while the block count is unknown."""
    cache = engine.vllm_config.cache_config
    if not cache.num_gpu_blocks or not cache.block_size:
        return None
    return int(cache.num_gpu_blocks) * int(cache.block_size)


def reserved_fraction(engine: Any) -> float | None:
    """How much of ``engine``'s KV cache (a vLLM ``AsyncLLM``) its unfinished requests may
    take: their prompts plus ``max_tokens`` over the cache's size in tokens
    (``num_gpu_blocks * block_size``). An upper bound (prompts that share cached blocks
    are counted once each); ``None`` when the cache size is unknown."""
    capacity = capacity_tokens(engine)
    if capacity is None:
        return None
    states: Sequence[Any] = list(engine.output_processor.request_states.values())
    held = sum(int(s.prompt_len) + int(s.max_tokens_param or 0) for s in states)
    return min(held / int(capacity), 1.0)


async def run_prefill(engine: Any, ids: list[int], request_id: str, priority: int) -> Usage:
    """Run ``ids`` through ``engine`` (a vLLM ``AsyncLLM``) for one greedy token at
    ``priority``; the request is aborted when the call is cancelled.

    Returns:
        ``Usage(len(ids), 1, tokens the cache already held)``.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=1, temperature=0.0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    stream = engine.generate({"prompt_token_ids": ids}, params, request_id, priority=priority)
    cached, finished = 0, False
    try:
        async for out in stream:
            cached = out.num_cached_tokens or cached
            finished = out.finished
    finally:
        await stream.aclose()
        if not finished:
            with contextlib.suppress(Exception):
                await engine.abort(request_id)
    return Usage(len(ids), 1, cached)
