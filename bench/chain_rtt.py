"""Round-trip-bound chain: server-side chaining vs the app driving every call.

A chain of 30 dependent calls (each prompt holds the previous answer) on the real
engine. The app reaches the proxy through a delay line that adds ``--rtt-ms`` of round
trip (half each way, on every byte, without limiting throughput), as when the app
and the proxy are not on one host:

* flowlift: one workflow submission; the proxy chains the 30 calls itself;
* app-driven: the app sends each call through ``/v1/chat/completions`` and waits.

Reported: makespan, the sum of model time (engine time per call: the trace for
flowlift, the ``Server-Timing`` header for app-driven) and their ratio.

    .venv/bin/python bench/chain_rtt.py [--steps 30] [--rtt-ms 80]
    .venv/bin/python bench/chain_rtt.py --smoke   # seconds, fake engine: plumbing only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai

from bench.harness import free_port, proxy, save
from flowlift import step, workflow


class DelayLine:
    """A TCP relay on 127.0.0.1 that delays every chunk by ``one_way_s`` per direction
    (a timestamped queue per direction, so latency is added without a bandwidth cap)."""

    def __init__(self, target_port: int, one_way_s: float) -> None:
        self.target_port, self.one_way_s = target_port, one_way_s
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", self.port))
        self._ready.set()
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(server.serve_forever())

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        while True:
            data = await reader.read(65536)
            queue.put_nowait((time.monotonic() + self.one_way_s, data))
            if not data:
                break
        with contextlib.suppress(Exception):
            await sender

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)


@step(max_tokens=6)
def hop(i: int, previous: Any):
    return [{"role": "system", "content": "You continue a word chain. Answer with one word."},
            {"role": "user", "content": f"Step {i}. The previous word was: {previous}. "
                                        "Say one new word."}]


def flowlift_chain(base: str, steps: int) -> dict[str, Any]:
    t0 = time.monotonic()
    with workflow("bench-chain", base_url=base) as wf:
        prev: Any = "start"
        for i in range(steps):
            prev = hop(i, prev)
    makespan = time.monotonic() - t0
    model_ms = sum(r["stages_ms"].get("prefill", 0) + r["stages_ms"].get("decode", 0)
                   for r in wf.trace if r["type"] == "step")
    return {"makespan_s": round(makespan, 2), "model_s": round(model_ms / 1000, 2)}


def app_chain(base: str, steps: int) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    t0 = time.monotonic()
    prev, model_ms = "start", 0.0
    for i in range(steps):
        raw = client.chat.completions.with_raw_response.create(
            model="default", max_tokens=6, temperature=0, messages=hop.fn(i, prev))
        m = re.search(r"engine;dur=([\d.]+)", raw.headers.get("server-timing", ""))
        model_ms += float(m.group(1)) if m else 0.0
        prev = raw.parse().choices[0].message.content or ""
    makespan = time.monotonic() - t0
    return {"makespan_s": round(makespan, 2), "model_s": round(model_ms / 1000, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine, 4 steps, 20 ms, nothing saved")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.rtt_ms = 4, 20.0
    results: dict[str, Any] = {"steps": args.steps, "rtt_ms": args.rtt_ms}
    with proxy(name="chain_rtt", engine="fake" if args.smoke else "vllm") as base:
        port = int(base.rsplit(":", 1)[1])
        line = DelayLine(port, args.rtt_ms / 2000.0)
        far = f"http://127.0.0.1:{line.port}"
        app_chain(base, 3)  # warm-up
        for where, url in (("local", base), ("far", far)):
            results[f"flowlift_{where}"] = flowlift_chain(url, args.steps)
            results[f"app_{where}"] = app_chain(url, args.steps)
            print(where, results[f"flowlift_{where}"], results[f"app_{where}"], flush=True)
    for v in list(results.values()):
        if isinstance(v, dict):
            v["makespan_over_model"] = round(v["makespan_s"] / max(v["model_s"], 1e-9), 2)
    results["app_over_flowlift_far"] = round(
        results["app_far"]["makespan_s"] / results["flowlift_far"]["makespan_s"], 2)
    results["upstream_connections_per_workflow"] = (
        "n/a here: the engine is in process; for upstream models the count is checked by "
        "tests/proxy/test_upstream_routing.py -k connections (0 new connections after warm-up)")
    save("chain_rtt", results, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
