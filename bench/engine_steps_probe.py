"""Engine characterization (a probe, not a benchmark): vLLM's own per-iteration timings
(:mod:`flowlift.local_engine.step_log`) on this machine.

Decode-only steps at batch sizes 1..16; prefill steps of one prompt of N tokens, and of
three prompts together, alone and beside 8 decoding requests, each twice. Prints the
medians of the engine's per-step times.

    flock /tmp/bench.lock .venv/bin/python bench/engine_steps_probe.py [--max-batched N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.harness  # noqa: F401  (sets FLOWLIFT_CACHE_DIR)
from flowlift.local_engine.base import GenerationRequest, SamplingOptions
from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine, engine_kwargs

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
         "kappa"]


async def probe(max_batched: int | None) -> dict[str, Any]:
    if max_batched:  # the probe's own knob: vLLM's per-step token budget
        import flowlift.local_engine.vllm_engine as ve
        base = ve.engine_kwargs
        ve.engine_kwargs = lambda cfg: {**base(cfg), "max_num_batched_tokens": max_batched}
    eng = VLLMEngine(VLLMConfig.for_model(step_timings=True))
    await eng.start()
    log = eng.step_log()
    assert log is not None
    n = 0

    async def one(prompt: str, max_tokens: int) -> None:
        nonlocal n
        n += 1
        req = GenerationRequest(f"r{n}", eng.model_names[0], prompt=prompt,
                                sampling=SamplingOptions(max_tokens=max_tokens,
                                                         temperature=0.0))
        async for _ in eng.generate(req):
            pass

    await one("warm up", 8)
    out: dict[str, Any] = {}
    for b in (1, 2, 4, 8, 12, 16):
        mark = log.recorded
        await asyncio.gather(*(one(f"{b} {i} Count upwards from {i}:", 40)
                               for i in range(b)))
        dec = [s.elapsed_ms for s in list(log)[-(log.recorded - mark):]
               if s.decode_only and s.decode_requests == b]
        out[f"decode b={b}"] = (round(statistics.median(dec), 1), len(dec))
    for p in (64, 128, 256, 450, 900, 1350):
        for together in (1, 3):
            if together == 3 and p > 450:
                continue
            for beside in (0, 8):
                got = []
                for rep in range(2):
                    mark = log.recorded
                    bg = [asyncio.create_task(one(f"bg{rep}{beside}{p}{i} Count from {i}:",
                                                  60)) for i in range(beside)]
                    await asyncio.sleep(0.6 if beside else 0)
                    await asyncio.gather(*(one(
                        f"{rep}{p}{beside}{k} " + " ".join(
                            WORDS[(p + j + k) % 10] for j in range(int(p / 1.45))), 1)
                        for k in range(together)))
                    await asyncio.gather(*bg)
                    new = list(log)[-(log.recorded - mark):]
                    got.append([(s.prefill_tokens, s.decode_requests, round(s.elapsed_ms))
                                for s in new if s.prefill_tokens > 16])
                out[f"prefill {together}x{p} beside {beside}"] = got
    await eng.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-batched", type=int, default=None,
                        help="vLLM max_num_batched_tokens (default: vLLM's)")
    args = parser.parse_args()
    print("engine kwargs:", {k: v for k, v in engine_kwargs(
        VLLMConfig.for_model()).items() if k != "model"})
    for key, value in asyncio.run(probe(args.max_batched)).items():
        print(key, value, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
