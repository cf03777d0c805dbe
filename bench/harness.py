"""Shared benchmark plumbing: start a real proxy (embedded vLLM engine) once, measure
the engine's ceiling, write results as JSON next to RESULTS.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from flowlift.testing import free_port, running_proxy

__all__ = ["RESULTS", "engine_ceiling", "free_port", "pct", "proxy", "save"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# the checkout's model cache (the default is the user's ~/.cache/flowlift): benchmarks
# measure the model converted there, as scripts/demo.sh and scripts/test.sh do
os.environ.setdefault("FLOWLIFT_CACHE_DIR", str(ROOT / ".cache" / "flowlift"))


@contextlib.contextmanager
def proxy(*extra: str, name: str = "proxy") -> Iterator[str]:
    """A ``flowlift serve`` with the real engine; yields its base URL."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = RESULTS / f"{name}.log"
    log.unlink(missing_ok=True)
    t0 = time.monotonic()
    args = ("--state-db", ":memory:", "--log-level", "warning", *extra)
    with running_proxy(*args, log_path=log) as (base, _):
        print(f"[{name}] proxy ready in {time.monotonic() - t0:.0f} s ({' '.join(extra)})",
              flush=True)
        yield base


async def engine_ceiling(base: str, concurrency: int = 16) -> dict[str, float]:
    """The engine's measured max throughput: ``concurrency`` distinct prompts at once.

    Returns prefill tokens/s (prompt-only requests, 1 output token) and decode tokens/s
    (short prompts, 48 output tokens each), both aggregate over the batch.
    """
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)

    async def one(prompt: str, max_tokens: int) -> tuple[int, int]:
        r = await client.chat.completions.create(
            model="default", max_tokens=max_tokens, temperature=0,
            messages=[{"role": "user", "content": prompt}])
        u = r.usage
        cached = u.prompt_tokens_details.cached_tokens
        return u.prompt_tokens - cached, u.completion_tokens

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
             "kappa", "lambda", "mu"]
    long_prompts = [f"{i} " + " ".join(words[(i + j) % 12] for j in range(400))
                    for i in range(concurrency)]
    t0 = time.monotonic()
    got = await asyncio.gather(*(one(p, 1) for p in long_prompts))
    prefill_tps = sum(g[0] for g in got) / (time.monotonic() - t0)
    t0 = time.monotonic()
    got = await asyncio.gather(*(one(f"Count from {i} upwards, one number per line.", 48)
                                 for i in range(concurrency)))
    decode_tps = sum(g[1] for g in got) / (time.monotonic() - t0)
    await client.close()
    return {"prefill_tps": round(prefill_tps, 1), "decode_tps": round(decode_tps, 1),
            "concurrency": concurrency}


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), **data}
    path.write_text(json.dumps(data, indent=2))
    print(f"results: {path}")
    return path


def pct(values: list[float], q: float) -> float:
    vs = sorted(values)
    if not vs:
        return float("nan")
    k = min(len(vs) - 1, max(0, round(q / 100 * (len(vs) - 1))))
    return vs[k]
