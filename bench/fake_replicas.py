"""Fake OpenAI replicas of one model with different speeds, for the routing benchmark.

Each replica simulates an inference engine, enough for routing to matter:

* ``slots`` requests run at once (a batch); more wait in its queue, first come first
  served -- the wait is part of their time to first token;
* prefill: ``prefill_s_per_ktok`` per 1,000 prompt tokens (the prompt's characters / 4)
  not in its prefix cache; a request whose ``user`` field it served before finds its
  prompt cached (the prefix cache that session affinity keeps warm);
* decode: ``max_tokens`` content events (``--tokens`` when absent), ``tpot_s`` apart,
  times ``1 + batch_slowdown * (running - 1)`` (a fuller batch decodes each request
  slower);
* ``error_rate``: that share of requests is answered ``500`` after ``error_after_s``
  (a flaky replica).

``POST /v1/chat/completions`` only, streamed (``"stream": true``) or whole.

    .venv/bin/python bench/fake_replicas.py --replica fast:PORT:0.02:0.004:0 ...

``--replica NAME:PORT:PREFILL_S_PER_KTOK:TPOT_S:ERROR_RATE`` (repeatable; ``--slots``,
``--batch-slowdown``, ``--error-after-s``, ``--seed`` apply to all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Replica:
    """One simulated engine (see the module doc)."""

    name: str
    prefill_s_per_ktok: float
    tpot_s: float
    error_rate: float = 0.0
    slots: int = 8
    batch_slowdown: float = 0.1
    error_after_s: float = 0.05
    tokens: int = 32
    rng: random.Random = field(default_factory=random.Random)
    running: int = 0
    cached: set[str] = field(default_factory=set)
    _slots: asyncio.Semaphore | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    def _event(self, delta: dict[str, str], finish: str | None = None) -> bytes:
        return b"data: " + json.dumps({
            "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]},
            separators=(",", ":")).encode() + b"\n\n"

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.rng.random() < self.error_rate:
            await asyncio.sleep(self.error_after_s)
            return web.json_response({"error": {"message": "flaky replica", "type": "server"}},
                                     status=500)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.slots)
        prompt_chars = sum(len(str(m.get("content", ""))) for m in body.get("messages", []))
        user = body.get("user")
        n = int(body.get("max_tokens") or self.tokens)
        async with self._slots:
            self.running += 1
            try:
                hit = isinstance(user, str) and user in self.cached
                await asyncio.sleep(0.0 if hit else
                                    prompt_chars / 4 / 1000 * self.prefill_s_per_ktok)
                if isinstance(user, str):
                    self.cached.add(user)
                if body.get("stream") is True:
                    return await self._stream(request, n, hit)
                for _ in range(n):
                    await asyncio.sleep(self._tpot())
                return web.json_response({
                    "id": "c", "object": "chat.completion", "created": 1, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "x" * n}}],
                    "usage": {"prompt_tokens": prompt_chars // 4, "completion_tokens": n,
                              "total_tokens": prompt_chars // 4 + n}})
            finally:
                self.running -= 1

    def _tpot(self) -> float:
        return self.tpot_s * (1 + self.batch_slowdown * max(self.running - 1, 0))

    async def _stream(self, request: web.Request, n: int, hit: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Prefix-Hit": str(hit).lower()})
        await resp.prepare(request)
        for i in range(n):
            await resp.write(self._event({"content": f"t{i} "}))
            await asyncio.sleep(self._tpot())
        await resp.write(self._event({}, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def parse_replica(text: str) -> tuple[str, int, float, float, float]:
    """``NAME:PORT:PREFILL_S_PER_KTOK:TPOT_S:ERROR_RATE`` as a tuple."""
    name, port, prefill, tpot, errors = text.split(":")
    return name, int(port), float(prefill), float(tpot), float(errors)


async def serve(a: argparse.Namespace) -> None:
    runners = []
    for i, text in enumerate(a.replica):
        name, port, prefill, tpot, errors = parse_replica(text)
        replica = Replica(name, prefill, tpot, errors, a.slots, a.batch_slowdown,
                          a.error_after_s, a.tokens, random.Random(a.seed + i))
        runner = web.AppRunner(replica.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        print(f"replica {name} on http://127.0.0.1:{port}/v1", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica", action="append", required=True,
                   help="NAME:PORT:PREFILL_S_PER_KTOK:TPOT_S:ERROR_RATE")
    p.add_argument("--slots", type=int, default=8, help="requests running at once")
    p.add_argument("--batch-slowdown", type=float, default=0.1)
    p.add_argument("--error-after-s", type=float, default=0.05)
    p.add_argument("--tokens", type=int, default=32, help="output tokens without max_tokens")
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
