"""Shared benchmark plumbing: start a real proxy (embedded vLLM engine) once, measure
the engine's ceiling, write results as JSON next to RESULTS.md.

Every benchmark also has a ``--smoke`` mode (``proxy(..., engine="fake")``, results in a
temporary folder) that tests/project/test_bench_smoke.py runs, so a benchmark that stops
running fails the test suite."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from flowlift.testing import free_port, running_proxy

__all__ = ["EXAMPLE_CONFIG", "RESULTS", "engine_ceiling", "free_port", "pct", "proxy", "save"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# the checkout's model cache (the default is the user's ~/.cache/flowlift): benchmarks
# measure the model converted there, as scripts/demo.sh and scripts/test.sh do
os.environ.setdefault("FLOWLIFT_CACHE_DIR", str(ROOT / ".cache" / "flowlift"))


EXAMPLE_CONFIG = ROOT / "examples" / "stdlib_docs" / "flowlift.toml"


@contextlib.contextmanager
def proxy(*extra: str, name: str = "proxy", engine: str = "vllm") -> Iterator[str]:
    """A ``flowlift serve``; yields its base URL.

    Args:
        extra: more ``flowlift serve`` flags.
        name: the log's name (``bench/results/<name>.log`` with the real engine).
        engine: ``"vllm"`` (the real engine; log in bench/results) or ``"fake"``
            (``--engine fake`` for smoke runs: log in a temporary folder, nothing is
            written into bench/results).

    Raises:
        RuntimeError: the proxy did not become ready (from ``running_proxy``).
    """
    t0 = time.monotonic()
    chosen = ("--engine", "fake") if engine == "fake" else ()  # else serve's own default
    args = (*chosen, "--state-db", ":memory:", "--log-level", "warning", *extra)
    with contextlib.ExitStack() as stack:
        if engine == "fake":
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / f"{name}.log"
        else:
            RESULTS.mkdir(parents=True, exist_ok=True)
            log = RESULTS / f"{name}.log"
            log.unlink(missing_ok=True)
        base, _ = stack.enter_context(running_proxy(
            *args, log_path=log, ready_timeout_s=120 if engine == "fake" else 900))
        print(f"[{name}] proxy ({engine}) ready in {time.monotonic() - t0:.0f} s "
              f"({' '.join(extra)})", flush=True)
        yield base


def save(name: str, data: dict[str, Any], *, smoke: bool = False) -> Path | None:
    """Write ``bench/results/<name>.json`` (with a ``when`` stamp); a smoke run writes
    nothing and returns None."""
    if smoke:
        print(f"smoke: {name} results not saved", flush=True)
        return None
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), **data}
    path.write_text(json.dumps(data, indent=2))
    print(f"results: {path}")
    return path


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


def pct(values: list[float], q: float) -> float:
    vs = sorted(values)
    if not vs:
        return float("nan")
    k = min(len(vs) - 1, max(0, round(q / 100 * (len(vs) - 1))))
    return vs[k]
