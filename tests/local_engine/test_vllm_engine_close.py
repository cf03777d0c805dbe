"""A stream whose vLLM engine is closed (unloaded) under it fails at once with
EngineError instead of hanging.

vLLM's ``AsyncLLM.shutdown()`` cancels the output-handler task that feeds each request's
output queue, so a ``generate()`` still waiting on its queue waits forever (seen once in
bench/residency.py: a model unloaded under three running steps, the run hung). The
stand-in below keeps exactly that mechanism (per-request queues fed by one handler task,
``shutdown`` cancels it, ``output_processor.propagate_error`` puts a failure in every
queue) so the test runs without starting vLLM; the same check on the real engine is
tests/integration/test_engine_shutdown_real.py. Without ``fail_in_flight`` in
``VLLMEngine.close`` the first test times out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flowlift.errors import EngineError
from flowlift.local_engine.base import ChatMessage, GenerationRequest, SamplingOptions
from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine

pytest.importorskip("vllm")  # VLLMEngine builds vLLM's SamplingParams


@dataclass
class _Piece:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: Any = None


@dataclass
class _Output:
    outputs: list[_Piece]
    finished: bool
    num_cached_tokens: int = 0


class _Queue:
    """vLLM's ``RequestOutputCollector``: the latest output (DELTA outputs merge; an
    exception replaces whatever waits), handed over when ready."""

    def __init__(self) -> None:
        self.item: _Output | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, item: _Output | Exception) -> None:
        if self.item is None or isinstance(item, Exception):
            self.item = item
        elif isinstance(self.item, _Output) and isinstance(item, _Output):
            piece = self.item.outputs[0]
            piece.text += item.outputs[0].text
            piece.token_ids += item.outputs[0].token_ids
        self.ready.set()

    async def get(self) -> _Output:
        while self.item is None:
            await self.ready.wait()
        item, self.item = self.item, None
        self.ready.clear()
        if isinstance(item, Exception):
            raise item
        return item


@dataclass
class _Processor:
    request_states: dict[str, _Queue] = field(default_factory=dict)

    def propagate_error(self, e: Exception) -> None:
        for queue in self.request_states.values():
            queue.put(e)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split())))

    def apply_chat_template(self, msgs: list[dict[str, str]], **_: Any) -> str:
        return " ".join(m["content"] for m in msgs)


class StandInAsyncLLM:
    """vLLM's ``AsyncLLM`` as far as streaming and shutdown go: one handler task emits a
    token per 10 ms into every open request's queue; ``shutdown`` cancels it."""

    errored = False

    def __init__(self) -> None:
        self.output_processor = _Processor()
        self.handler: asyncio.Task[None] | None = None

    def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer()

    async def _feed(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            for queue in self.output_processor.request_states.values():
                queue.put(_Output([_Piece("tok ", [1])], finished=False))

    async def generate(self, prompt: Any, params: Any, request_id: str,
                       priority: int = 0) -> AsyncIterator[_Output]:
        if self.handler is None:
            self.handler = asyncio.create_task(self._feed())
        queue = self.output_processor.request_states[request_id] = _Queue()
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self.output_processor.request_states.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self.output_processor.request_states.pop(request_id, None)

    def shutdown(self) -> None:
        # as vLLM's (cancel_task_threadsafe): VLLMEngine.close runs it in a worker thread
        if self.handler is not None:
            self.handler.get_loop().call_soon_threadsafe(self.handler.cancel)


async def _engine(tmp_path: Path) -> tuple[VLLMEngine, StandInAsyncLLM]:
    stand_in = StandInAsyncLLM()
    engine = VLLMEngine(VLLMConfig(model=str(tmp_path), served_model_name="m"),
                        build=lambda _config: stand_in)
    await engine.start()
    return engine, stand_in


def _long(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, "m", (ChatMessage("user", "count to a thousand"),),
                             SamplingOptions(max_tokens=1000))


async def test_a_stream_fails_at_once_when_its_engine_is_closed_under_it(tmp_path):
    engine, _ = await _engine(tmp_path)
    streams = [engine.generate(_long(f"r{i}")) for i in range(3)]
    for stream in streams:
        assert (await anext(stream)).text.startswith("tok ")
    await engine.close()
    for stream in streams:
        with pytest.raises(EngineError, match=r"shut down .*while this request"):
            await asyncio.wait_for(anext(stream), 2.0)  # before the fix: waits forever
        await stream.aclose()
    assert engine.running() is None


async def test_a_stream_started_after_close_fails_with_engine_error(tmp_path):
    engine, _ = await _engine(tmp_path)
    await engine.close()
    with pytest.raises(EngineError, match="not started"):
        await anext(engine.generate(_long("late")))


async def test_closing_a_stream_still_aborts_it_on_a_live_engine(tmp_path):
    engine, stand_in = await _engine(tmp_path)
    stream = engine.generate(_long("left"))
    await anext(stream)
    await stream.aclose()
    assert stand_in.output_processor.request_states == {}
    assert engine.running() == 0
    await engine.close()


async def test_steps_on_a_model_unloaded_under_them_fail_and_the_run_ends(aiohttp_client,
                                                                         tmp_path):
    # the proxy's view: three workflow steps stream on a managed model when it is
    # unloaded (ResidencyManager.unload: what a shutdown does, leases or not); each step
    # fails with the engine's error (an embedded engine's failure is not retried) and
    # the run ends. Before the fix the steps stayed `running` and the run never ended.
    from flowlift.local_engine.residency import ManagedModel, ResidencyManager
    from flowlift.local_engine.resident import managed_engines
    from flowlift.proxy import create_app
    from flowlift.proxy.state import STATE
    from flowlift.testing import parse_sse

    stand_in = StandInAsyncLLM()
    engine = VLLMEngine(VLLMConfig(model=str(tmp_path), served_model_name="m"),
                        build=lambda _config: stand_in)
    mgr = ResidencyManager({"m": ManagedModel(engine, 400.0)}, 400.0, recheck_s=0.05)
    app = create_app(managed_engines(mgr), residency=mgr)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    nodes = [{"id": f"s{i}", "kind": "llm", "model": "m", "params": {"max_tokens": 1000},
              "messages": [{"role": "user", "content": [{"text": f"count {i}"}]}]}
             for i in range(3)]

    async def run() -> str:
        resp = await client.post("/v1/workflows", json={"name": "long", "nodes": nodes})
        return await resp.text()
    task = asyncio.create_task(run())
    async with asyncio.timeout(10):
        while len(stand_in.output_processor.request_states) < 3:
            await asyncio.sleep(0.01)
    await mgr.unload("m")
    body = await asyncio.wait_for(task, 5.0)  # before the fix: never returns
    done = next(d for e, d in parse_sse(body) if e == "run.finished")
    assert done["status"] == "failed"
    assert "shut down" in str(done["failures"])
