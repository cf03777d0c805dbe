"""A request aborted mid-way on real vLLM and resumed from its token ids
(``GenerationRequest.resume_token_ids``) continues as the unpreempted one did (greedy,
float32: the prompt and the tokens so far come from the prefix cache or a prefill of
them, where the first run decoded them one by one)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from flowlift.local_engine.base import (
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    SamplingOptions,
)

pytestmark = pytest.mark.engine

CONTEXT = ("The collections module implements specialized container datatypes "
           "providing alternatives to Python's general purpose built-in containers, dict, "
           "list, set and tuple: namedtuple, deque, ChainMap, Counter, OrderedDict, "
           "defaultdict, UserDict, UserList and UserString. ")
PROMPT = (ChatMessage("user", CONTEXT * 4 + "\n\nWrite a short paragraph about why this "
                      "module is useful, with two examples."),)  # > one KV block


async def _run(engine: Any, request: GenerationRequest,
               abort_after: int | None = None) -> list[GenerationChunk]:
    chunks: list[GenerationChunk] = []
    ids = 0
    async with contextlib.aclosing(engine.generate(request)) as stream:
        async for chunk in stream:
            chunks.append(chunk)
            ids += len(chunk.token_ids or ())
            if abort_after is not None and ids >= abort_after:
                await engine.abort(request.request_id)
                abort_after = None
    return chunks


def _ids(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in (c.token_ids or ())]


def test_aborted_and_resumed_greedy_output_matches_the_unpreempted_one(engine_host):
    host, model = engine_host["host"], engine_host["model"]
    sampling = SamplingOptions(max_tokens=48, temperature=0.0)
    base = GenerationRequest("pre-whole", model, messages=PROMPT, sampling=sampling)
    whole = host.call(_run(host.engine, base))
    first = host.call(_run(host.engine, GenerationRequest(
        "pre-part", model, messages=PROMPT, sampling=sampling), abort_after=12))
    assert first[-1].finish_reason == "abort", (
        f"{len(_ids(whole))} tokens, finish {whole[-1].finish_reason}: "
        f"{''.join(c.text for c in whole)!r}; first: {len(_ids(first))} tokens")
    done = _ids(first)
    assert 12 <= len(done) < 48
    rest = host.call(_run(host.engine, GenerationRequest(
        "pre-part~1", model, messages=PROMPT, sampling=sampling,
        resume_token_ids=tuple(done))))
    assert done + _ids(rest) == _ids(whole), "greedy continuation diverged"
    text = "".join(c.text for c in first) + "".join(c.text for c in rest)
    assert text == "".join(c.text for c in whole)
    usage, resumed = whole[-1].usage, rest[-1].usage
    assert usage is not None and resumed is not None
    assert resumed.prompt_tokens == usage.prompt_tokens + len(done)
    assert resumed.cached_tokens > 0, "the continuation's prompt comes from the prefix cache"
    assert len(done) + resumed.completion_tokens == usage.completion_tokens
