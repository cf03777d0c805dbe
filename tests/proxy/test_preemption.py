"""Preemption for interactive work: batch requests aborted and resumed as continuations.

The policy (who is preempted) and the continuation helpers are pure code; the rest runs
on the fake engine, which resumes from token ids like a greedy model (a piece lost or
repeated by whoever resumes shows in its output).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from flowlift.local_engine.base import (
    GenerationChunk,
    GenerationRequest,
    OutputConstraint,
    SamplingOptions,
    Usage,
)
from flowlift.local_engine.continuation import (
    ContinuationText,
    merge_usage,
    not_resumable,
)
from flowlift.proxy.dispatch.slots.policy import SlotPolicy
from flowlift.proxy.dispatch.slots.preemption import Candidate, choose_victims
from flowlift.proxy.dispatch.slots.resumable import ResumableGeneration
from flowlift.proxy.dispatch.slots.scheduler import Priority, PrioritySlots
from flowlift.testing import FakeEngine

BATCH = Priority.of("batch", remaining_ms=1_000)

# -- the policy ------------------------------------------------------------------------


def test_least_urgent_goes_first_then_least_progress():
    cands = [
        Candidate("long-path", Priority.of("batch", 9_000), 1, 100),
        Candidate("short-path-far", Priority.of("batch", 10), 50, 100),
        Candidate("short-path-new", Priority.of("batch", 10), 2, 100),
        Candidate("idle", Priority.of("idle"), 80, 100),
        Candidate("tight-slack", Priority.of("batch", 10, slack_ms=5), 1, 100),
    ]
    order = [c.key for c in choose_victims(cands, 5)]
    assert order == ["idle", "short-path-new", "short-path-far", "tight-slack", "long-path"]


def test_nearly_done_requests_are_left_to_finish():
    cands = [Candidate("done-soon", BATCH, 97, 100), Candidate("young", BATCH, 90, None),
             Candidate("mid", BATCH, 10, 100)]
    assert [c.key for c in choose_victims(cands, 3, min_remaining_tokens=4)] == [
        "mid", "young"]
    assert choose_victims(cands, 0) == [] and choose_victims(cands, -2) == []
    assert [c.key for c in choose_victims(cands, 1)] == ["mid"]


def test_equal_progress_prefers_the_one_with_most_left():
    cands = [Candidate("short", BATCH, 5, 20), Candidate("long", BATCH, 5, 500)]
    assert choose_victims(cands, 1)[0].key == "long"


# -- continuation helpers --------------------------------------------------------------


def test_constrained_and_stop_requests_are_never_resumed():
    plain = GenerationRequest("r", "m")
    assert not_resumable(plain) is None
    assert not_resumable(GenerationRequest(
        "r", "m", constraint=OutputConstraint(choices=("a",)))) == "constrained"
    assert not_resumable(GenerationRequest(
        "r", "m", sampling=SamplingOptions(stop=("\n",)))) == "stop strings"
    assert not_resumable(GenerationRequest(
        "r", "m", sampling=SamplingOptions(frequency_penalty=0.5))) == "penalties"
    assert not_resumable(GenerationRequest(
        "r", "m", sampling=SamplingOptions(seed=1, temperature=0.7))) == "seeded sampling"
    assert not_resumable(GenerationRequest(
        "r", "m", sampling=SamplingOptions(seed=1, temperature=0.0))) is None


def _bytes_decode(ids: list[int] | tuple[int, ...]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_a_character_cut_by_the_preemption_is_not_lost():
    word = "né!".encode()  # 'é' is two bytes: the cut falls inside it
    first = list(word[:2])  # what the first part generated: 'n' sent, half of 'é' held
    assert _bytes_decode(first).rstrip("\ufffd") == "n"
    text = ContinuationText(_bytes_decode, first)
    assert text.feed([word[2]]) == "é"
    assert text.feed([word[3]], final=True) == "!"


def test_usage_of_a_resumed_answer_counts_the_prompt_once():
    first = Usage(prompt_tokens=100, completion_tokens=7, cached_tokens=64)
    second = Usage(prompt_tokens=107, completion_tokens=5, cached_tokens=100)
    third = Usage(prompt_tokens=112, completion_tokens=3, cached_tokens=110)
    assert merge_usage([first, second, third], resumed_tokens=12) == Usage(100, 15, 64)


# -- on the fake engine ----------------------------------------------------------------

LONG = "one two three four five six seven eight nine ten eleven twelve " * 3


def _engine(**kw: object) -> FakeEngine:
    return FakeEngine(responder=lambda r: f"{r.prompt}: {LONG}", chunk_chars=5,
                      **kw)  # type: ignore[arg-type]


async def _read(stream: ResumableGeneration) -> tuple[list[GenerationChunk], float]:
    chunks = []
    async with contextlib.aclosing(stream.stream()) as it:
        async for chunk in it:
            chunks.append(chunk)
    return chunks, time.monotonic()


async def _alone(request: GenerationRequest) -> list[GenerationChunk]:
    engine = _engine()
    async with contextlib.aclosing(engine.generate(request)) as it:
        return [c async for c in it]


async def test_preempted_batch_resumes_with_identical_output_and_usage_counted_once():
    engine = _engine(delay_s=0.005)
    slots = PrioritySlots(capacity=4,
                          policy=SlotPolicy(reserved_interactive=1, batch_cap_when_interactive=1,
                                            preempt=True, linger_s=0.05))
    requests = [GenerationRequest(f"b{i}", "fake-model",
                                  messages=(), prompt=f"document {i}",
                                  sampling=SamplingOptions(max_tokens=None))
                for i in range(3)]
    runs = [ResumableGeneration(engine, slots, r, BATCH) for r in requests]
    readers = [asyncio.create_task(_read(run)) for run in runs]
    await asyncio.sleep(0.05)  # all three decoding
    assert slots.batch_in_use == 3
    interactive = ResumableGeneration(
        engine, slots, GenerationRequest("i0", "fake-model", prompt="quick question",
                                         sampling=SamplingOptions(max_tokens=4)),
        Priority.of("interactive"))
    _, interactive_done = await _read(interactive)
    results = await asyncio.gather(*readers)

    assert slots.preemptions == 2, "two batch requests stop: the batch cap is one"
    preempted = [i for i, run in enumerate(runs) if run.resumptions]
    assert len(preempted) == 2
    for i, (chunks, done) in enumerate(results):
        want = await _alone(requests[i])
        assert "".join(c.text for c in chunks) == "".join(c.text for c in want)
        assert [c.finish_reason for c in chunks].count(None) == len(chunks) - 1
        assert chunks[-1].finish_reason == want[-1].finish_reason == "stop"
        got, alone = chunks[-1].usage, want[-1].usage
        assert got is not None and alone is not None
        # prompt once, completion = all generated (cached: the shared engine's own hits)
        assert (got.prompt_tokens, got.completion_tokens) == (
            alone.prompt_tokens, alone.completion_tokens)
        ids = [t for c in chunks for t in (c.token_ids or ())]
        assert ids == [t for c in want for t in (c.token_ids or ())], \
            "no token lost or repeated"
        if i in preempted:
            assert interactive_done < done, "the interactive request ends first"
    assert engine.running() == 0 and slots.in_use == 0


async def test_without_preemption_batch_keeps_running():
    engine = _engine(delay_s=0.005)
    slots = PrioritySlots(capacity=4,
                          policy=SlotPolicy(reserved_interactive=1, batch_cap_when_interactive=1,
                                            linger_s=0.05))
    runs = [ResumableGeneration(engine, slots, GenerationRequest(
        f"b{i}", "fake-model", prompt=f"doc {i}", sampling=SamplingOptions(max_tokens=None)),
        BATCH) for i in range(3)]
    readers = [asyncio.create_task(_read(run)) for run in runs]
    await asyncio.sleep(0.05)
    await _read(ResumableGeneration(engine, slots, GenerationRequest(
        "i0", "fake-model", prompt="q", sampling=SamplingOptions(max_tokens=4)),
        Priority.of("interactive")))
    await asyncio.gather(*readers)
    assert slots.preemptions == 0 and not any(run.resumptions for run in runs)


async def test_closing_a_preempted_stream_while_it_waits_leaks_nothing():
    engine = _engine(delay_s=0.005)
    slots = PrioritySlots(capacity=3,
                          policy=SlotPolicy(reserved_interactive=1, batch_cap_when_interactive=1,
                                            preempt=True, linger_s=10.0))
    runs = [ResumableGeneration(engine, slots, GenerationRequest(
        f"b{i}", "fake-model", prompt=f"doc {i}", sampling=SamplingOptions(max_tokens=None)),
        BATCH) for i in range(2)]
    readers = [asyncio.create_task(_read(run)) for run in runs]
    await asyncio.sleep(0.05)
    await _read(ResumableGeneration(engine, slots, GenerationRequest(
        "i0", "fake-model", prompt="q", sampling=SamplingOptions(max_tokens=2)),
        Priority.of("interactive")))
    await asyncio.sleep(0.05)  # one batch request now waits (the linger holds the cap)
    assert slots.queued == 1
    for reader in readers:
        reader.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    assert slots.in_use == 0 and slots.queued == 0 and engine.running() == 0


# -- through the proxy -----------------------------------------------------------------


async def test_workflow_batch_steps_preempted_for_interactive_keep_their_answers(
        aiohttp_client):
    from flowlift.proxy import ProxyConfig, create_app
    from flowlift.proxy.state import STATE
    from flowlift.testing import parse_sse

    engine = FakeEngine(responder=lambda r: f"{r.messages[-1].content}: {LONG}",
                        delay_s=0.004, chunk_chars=5)
    app = create_app({"fake-model": engine}, ProxyConfig(
        scheduling="preempt", max_concurrency=4, batch_cap_when_interactive=1))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()

    def graph(name: str, cls: str, n: int) -> dict[str, object]:
        return {"name": name, "class": cls, "nodes": [
            {"kind": "llm", "id": f"s{i}", "params": {"max_tokens": 500},
             "messages": [{"role": "user", "content": [{"text": f"{name} {i}"}]}]}
            for i in range(n)]}

    async def run(g: dict[str, object]) -> list[tuple[str, object]]:
        resp = await client.post("/v1/workflows", json=g)
        assert resp.status == 200, await resp.text()
        return parse_sse(await resp.text())

    batch = asyncio.create_task(run(graph("docs", "batch", 3)))
    await asyncio.sleep(0.1)
    quick = await run(graph("ask", "interactive", 1))
    events = await batch
    assert quick[-1][1]["status"] == "succeeded"  # type: ignore[index]
    values = {d["step_id"]: d["value"] for e, d in events  # type: ignore[index]
              if e == "step.finished"}
    assert values == {f"s{i}": f"docs {i}: {LONG}" for i in range(3)}
    records = events[-1][1]["trace"]  # type: ignore[index]
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 3
    for record in steps:  # one attempt each: the prompt once, every word generated
        assert [(a["prompt_tokens"], a["completion_tokens"]) for a in record["attempts"]] \
            == [(3, len(values[record["step_id"]].split()))], record
    assert app[STATE].backends.backends[0].slots.preemptions == 2
    metrics = await (await client.get("/metrics")).text()
    assert 'flowlift_preemptions_total{backend="engine-0"} 2.0' in metrics
