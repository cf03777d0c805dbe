"""Smoke test of the embedded vLLM engine on the default model.

Run from the repository root:  .venv/bin/python scripts/engine_smoke.py

Prepares SmolLM2-135M-Instruct (converting the GGUF once), starts VLLMEngine and runs:
(a) a plain chat request, (b) a JSON-schema-constrained request (maxLength / maxItems),
(c) a 5-label choice request, (d) 8 requests sharing a ~400-token prefix (1 alone, then 7
together) to show the prefix cache, (e) an early close (abort) and a too-long prompt.
Prints load time, latencies, tok/s and cached tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints, ValidationError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLOWLIFT_CACHE_DIR", os.path.join(os.getcwd(), ".cache", "flowlift"))

from flowlift.errors import RequestError
from flowlift.local_engine.base import (
    ChatMessage,
    GenerationRequest,
    OutputConstraint,
    SamplingOptions,
)
from flowlift.local_engine.models import ensure_default_model
from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine

Tag = Annotated[str, StringConstraints(max_length=12)]


class Ticket(BaseModel):
    title: str = Field(max_length=30)
    tags: list[Tag] = Field(max_length=3)
    urgent: bool


N_JSON = 8
LABELS = ("billing", "bug", "feature_request", "account", "other")
PREFIX = " ".join(
    f"Rule {i}: answer politely, cite the policy section {i}, and never reveal internal "
    "ticket numbers or customer data to anyone." for i in range(1, 16))


async def run(engine: VLLMEngine, rid: str, messages: list[tuple[str, str]], **kw):
    req = GenerationRequest(
        request_id=rid, model=engine.model_names[0],
        messages=[ChatMessage(r, c) for r, c in messages],
        sampling=kw.pop("sampling", SamplingOptions(max_tokens=64)), **kw)
    t0 = time.perf_counter()
    text, last = "", None
    async for chunk in engine.generate(req):
        text += chunk.text
        last = chunk
    return text, last, time.perf_counter() - t0


def report(tag: str, text: str, last, dt: float) -> None:
    u = last.usage
    print(f"[{tag}] {dt:.2f}s finish={last.finish_reason} prompt={u.prompt_tokens} "
          f"completion={u.completion_tokens} cached={u.cached_tokens} "
          f"({u.completion_tokens / dt:.1f} tok/s)\n    {text!r}")


async def main() -> None:
    t0 = time.perf_counter()
    path = ensure_default_model()
    print(f"model ready at {path} in {time.perf_counter() - t0:.1f}s")
    engine = VLLMEngine(VLLMConfig.for_model(None))
    await engine.start()
    print(f"engine load time {engine.load_time_s:.1f}s")
    try:
        await smoke(engine)
    finally:
        await engine.close()


async def smoke(engine: VLLMEngine) -> None:
    # (a) plain chat
    text, last, dt = await run(engine, "a", [("user", "What is the capital of France?")])
    report("a plain", text, last, dt)

    # (b) JSON schema with maxLength / maxItems
    schema = Ticket.model_json_schema()
    print(f"[b] schema: {json.dumps(schema)}")
    ok = 0
    for i in range(N_JSON):
        text, last, dt = await run(
            engine, f"b{i}",
            [("user", "Turn this into a support ticket as JSON: 'The app crashes every "
                      "time I upload a photo from my phone, please fix it soon!'")],
            sampling=SamplingOptions(max_tokens=80, temperature=0.0 if i == 0 else 0.8,
                                     seed=i),
            constraint=OutputConstraint(json_schema=schema))
        try:
            Ticket.model_validate_json(text)
            verdict = "valid"
            ok += 1
        except ValidationError as exc:
            verdict = f"INVALID ({exc.error_count()} errors)"
        report(f"b{i} json {verdict}", text, last, dt)
    print(f"    json: {ok}/{N_JSON} valid against Ticket (maxLength 30/12, maxItems 3)")

    # (c) choice among 5 labels
    text, last, dt = await run(
        engine, "c", [("user", "Classify: 'I was charged twice this month.'")],
        constraint=OutputConstraint(choices=LABELS))
    report(f"c choice in_labels={text in LABELS}", text, last, dt)

    # (d) shared ~400-token prefix: one alone, then 7 together
    prefix_tokens = engine.count_tokens(engine.model_names[0], PREFIX)
    print(f"[d] shared system prefix: {prefix_tokens} tokens")

    def msgs(i: int) -> list[tuple[str, str]]:
        return [("system", PREFIX), ("user", f"Question {i}: how do I reset password {i}?")]

    sampling = SamplingOptions(max_tokens=32)
    text, last, dt = await run(engine, "d0", msgs(0), sampling=sampling)
    report("d0 alone", text, last, dt)
    t1 = time.perf_counter()
    results = await asyncio.gather(*(run(engine, f"d{i}", msgs(i), sampling=sampling)
                                     for i in range(1, 8)))
    wall = time.perf_counter() - t1
    toks = sum(r[1].usage.completion_tokens for r in results)
    for i, (_, last, dt) in enumerate(results, 1):
        print(f"    d{i}: {dt:.2f}s cached={last.usage.cached_tokens}/"
              f"{last.usage.prompt_tokens} completion={last.usage.completion_tokens}")
    print(f"    7 concurrent: {wall:.2f}s wall, {toks / wall:.1f} tok/s aggregate")

    # (e) early close aborts; too-long prompt is a RequestError
    req = GenerationRequest(request_id="e1", model=engine.model_names[0],
                            messages=[ChatMessage("user", "Write a long story.")],
                            sampling=SamplingOptions(max_tokens=500))
    gen = engine.generate(req)
    await gen.__anext__()
    await gen.aclose()
    await asyncio.sleep(0.2)
    left = engine._engine.get_num_unfinished_requests()
    print(f"[e] after aclose(): unfinished requests in engine = {left}")
    try:
        await run(engine, "e2", [("user", "word " * 5000)])
        print("[e] too-long prompt: NOT rejected")
    except RequestError as exc:
        print(f"[e] too-long prompt -> RequestError(param={exc.param!r}): {exc.message[:80]}")
    print(f"[e] healthy={await engine.healthy()}")


if __name__ == "__main__":
    asyncio.run(main())
