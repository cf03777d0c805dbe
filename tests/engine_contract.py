"""The engine contract: one suite of checks every :class:`Engine` must pass.

Each check is ``async def check_x(target)`` over a :class:`Target` (an engine, one of its
models, and what it takes to saturate it).
``tests/local_engine/test_engine_contract_fake.py`` runs the
suite on :class:`flowlift.testing.FakeEngine`, ``tests/integration/
test_engine_contract_real.py`` on the embedded vLLM engine (one engine per session).
Checks assert shapes and behaviour, never exact text.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import jsonschema

from flowlift.local_engine.base import (
    ChatMessage,
    Engine,
    GenerationChunk,
    GenerationRequest,
    OutputConstraint,
    SamplingOptions,
)


@dataclass(frozen=True)
class Target:
    """An engine under test.

    Attributes:
        engine: started engine.
        model: one of its model names.
        slots: requests it decodes at once (vLLM's ``max_num_seqs``); the priority check
            fills them all.
        ban_tokens: token ids to ban (e.g. EOS) so long generations run to ``max_tokens``.
    """

    engine: Engine
    model: str
    slots: int
    ban_tokens: tuple[int, ...] = ()


COUNTING = "Count: " + ", ".join(str(i) for i in range(1, 121)) + ","
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "year": {"type": "integer"}},
          "required": ["name", "year"]}
LABELS = ("positive", "negative", "neutral")


def _request(t: Target, text: str = "Say hello.", *, max_tokens: int = 16,
             raw: bool = False, **kw: object) -> GenerationRequest:
    bias = tuple((tok, -100.0) for tok in t.ban_tokens)
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0, logit_bias=bias)
    msgs = () if raw else (ChatMessage("user", text),)
    return GenerationRequest(request_id=f"contract-{uuid.uuid4().hex[:12]}", model=t.model,
                             messages=msgs, prompt=text if raw else None, sampling=sampling,
                             **kw)  # type: ignore[arg-type]


async def _collect(t: Target, req: GenerationRequest) -> list[GenerationChunk]:
    return [c async for c in t.engine.generate(req)]


def _text(chunks: list[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


async def _settled(t: Target, timeout_s: float = 10.0) -> int | None:
    """The engine's running count once it drops to 0 (or whatever it is at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while t.engine.running() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return t.engine.running()


async def check_streaming_and_usage(t: Target) -> None:
    chunks = await _collect(t, _request(t, "Name three colours.", max_tokens=24))
    assert chunks, "no chunks"
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length")
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert last.usage is not None and last.usage.prompt_tokens > 0
    assert 0 < last.usage.completion_tokens <= 24
    assert _text(chunks).strip(), "the pieces join to an empty output"


async def check_max_tokens_length(t: Target) -> None:
    chunks = await _collect(t, _request(t, COUNTING, max_tokens=3, raw=True))
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def check_json_schema(t: Target) -> None:
    req = _request(t, "Give a programming language and the year it appeared, as JSON.",
                   max_tokens=48, constraint=OutputConstraint(json_schema=SCHEMA))
    chunks = await _collect(t, req)
    assert chunks[-1].finish_reason == "stop", chunks[-1]
    jsonschema.validate(json.loads(_text(chunks)), SCHEMA)


async def check_choices(t: Target) -> None:
    req = _request(t, "I love this! Sentiment?", max_tokens=8,
                   constraint=OutputConstraint(choices=LABELS))
    assert _text(await _collect(t, req)) in LABELS


async def check_abort_running(t: Target) -> None:
    req = _request(t, COUNTING, max_tokens=400, raw=True)
    stream = t.engine.generate(req)
    chunks = [await anext(stream)]
    await t.engine.abort(req.request_id)
    async with asyncio.timeout(30):
        chunks += [c async for c in stream]
    assert chunks[-1].finish_reason in (None, "abort"), chunks[-1]
    completion = len(_text(chunks).split())
    assert completion < 300, "abort did not stop the generation"
    assert await _settled(t) in (0, None)


async def check_close_aborts(t: Target) -> None:
    req = _request(t, COUNTING, max_tokens=400, raw=True)
    stream = t.engine.generate(req)
    await anext(stream)
    assert t.engine.running() in (1, None)
    await stream.aclose()  # type: ignore[attr-defined]
    assert await _settled(t) in (0, None), "closing the stream left the request running"


async def check_cancel_aborts(t: Target) -> None:
    req = _request(t, COUNTING, max_tokens=400, raw=True)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in t.engine.generate(req):
            started.set()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(30):
        await started.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert await _settled(t) in (0, None), "a cancelled consumer left the request running"


async def check_priority(t: Target) -> None:
    """Saturated engine: a priority-0 request queued after two priority-5 ones finishes
    first (the first freed slot goes to it)."""
    if not t.engine.capabilities.priorities:
        return
    done: dict[str, float] = {}

    async def run(name: str, req: GenerationRequest) -> None:
        chunks = await _collect(t, req)
        assert chunks[-1].finish_reason == "length", (name, chunks[-1])
        done[name] = time.monotonic()

    async def started(req: GenerationRequest) -> asyncio.Task[None]:
        task = asyncio.create_task(run(req.request_id, req))
        await asyncio.sleep(0.01)  # arrival order is part of the contract
        return task

    prompt = COUNTING[:120]  # short prompts, short outputs: slots free 4 steps apart
    fillers = [await started(_request(t, prompt, max_tokens=12 + 4 * i, raw=True,
                                      priority=5)) for i in range(t.slots)]
    late = [_request(t, prompt, max_tokens=12, raw=True, priority=p) for p in (5, 5, 0)]
    tasks = [await started(r) for r in late]
    async with asyncio.timeout(300):
        await asyncio.gather(*fillers, *tasks)
    first_a, first_b, urgent = (r.request_id for r in late)
    assert done[urgent] < done[first_a] and done[urgent] < done[first_b], done


async def check_prefix_cache(t: Target) -> None:
    if not t.engine.capabilities.prefix_caching:
        return
    prompt = "Background: " + " ".join(f"fact {i} is about topic {i % 7}." for i in range(80))
    await _collect(t, _request(t, prompt + " Question A?", max_tokens=2))
    last = (await _collect(t, _request(t, prompt + " Question B?", max_tokens=2)))[-1]
    assert last.usage is not None and last.usage.cached_tokens > 0, last.usage


async def check_prefill_ahead(t: Target) -> None:
    """``prefill`` leaves a prompt's known start in the prefix cache (the later, whole
    prompt finds it cached) and generates nothing for the caller; ``kv_cache_usage`` is
    a share or unknown."""
    usage = t.engine.kv_cache_usage()
    assert usage is None or 0.0 <= usage <= 1.0, usage
    known = "Notes: " + " ".join(f"item {i} belongs to group {i % 5}." for i in range(90))
    hole = "\ue000HOLE\ue000"
    ahead = _request(t, f"{known}\nLookup: {hole}", max_tokens=1)
    got = await t.engine.prefill(ahead, hole)
    if got is None:  # an engine without a prefix cache
        assert not t.engine.capabilities.prefix_caching
        return
    assert got.prompt_tokens > 0 and got.cached_tokens == 0, got
    last = (await _collect(t, _request(t, f"{known}\nLookup: 42 found.", max_tokens=2)))[-1]
    assert last.usage is not None and last.usage.cached_tokens > 0, last.usage
    assert last.usage.cached_tokens <= got.prompt_tokens + 1 < last.usage.prompt_tokens
    assert await _settled(t) in (0, None)


async def check_tokenize(t: Target) -> None:
    ids = t.engine.tokenize(t.model, "hello world, hello again")
    if ids is None:
        assert t.engine.count_tokens(t.model, "hello") is None
        return
    assert ids and all(isinstance(i, int) for i in ids)
    assert ids == t.engine.tokenize(t.model, "hello world, hello again")
    assert t.engine.count_tokens(t.model, "hello world, hello again") == len(ids)
    longer = t.engine.tokenize(t.model, "hello world, hello again and again and again")
    assert longer is not None and len(longer) > len(ids)


async def check_health(t: Target) -> None:
    assert await t.engine.healthy()
    assert t.model in t.engine.model_names


CHECKS: dict[str, Callable[[Target], Awaitable[None]]] = {
    f.__name__.removeprefix("check_"): f for f in (
        check_streaming_and_usage, check_max_tokens_length, check_json_schema, check_choices,
        check_abort_running, check_close_aborts, check_cancel_aborts, check_priority,
        check_prefix_cache, check_prefill_ahead, check_tokenize, check_health)
}
