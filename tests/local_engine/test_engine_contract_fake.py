"""The engine contract (tests/engine_contract.py) on the public FakeEngine, plus proofs
that the priority and abort checks fail on an engine without those behaviours."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from flowlift.local_engine.base import GenerationChunk, GenerationRequest
from flowlift.testing import FakeEngine
from tests.engine_contract import CHECKS, Target, check_abort_running, check_priority


def _target(engine: FakeEngine) -> Target:
    return Target(engine=engine, model="fake-model", slots=4)


@pytest.mark.parametrize("name", sorted(CHECKS))
async def test_fake_engine_meets_the_contract(name: str) -> None:
    engine = FakeEngine(delay_s=0.01, max_running=4)
    await engine.start()
    await CHECKS[name](_target(engine))
    assert engine.running() == 0


class FifoFake(FakeEngine):
    """Admits requests in arrival order whatever their priority."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        from dataclasses import replace

        return super().generate(replace(request, priority=0))


class DeafFake(FakeEngine):
    """Ignores aborts."""

    async def abort(self, request_id: str) -> None:
        return None


async def test_priority_check_fails_on_a_fifo_engine() -> None:
    with pytest.raises(AssertionError):
        await check_priority(_target(FifoFake(delay_s=0.01, max_running=4)))


async def test_abort_check_fails_on_an_engine_that_ignores_aborts() -> None:
    with pytest.raises(AssertionError):
        await check_abort_running(_target(DeafFake(delay_s=0.001, max_running=4,
                                                   responder=lambda r: "word " * 500)))


async def test_a_client_that_leaves_a_stream_aborts_its_generation(aiohttp_client) -> None:
    from flowlift.proxy import create_app
    from flowlift.proxy.state import STATE

    engine = FakeEngine(["m"], delay_s=0.05)
    app = create_app({"m": engine})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    resp = await client.post("/v1/chat/completions", json={
        "model": "m", "stream": True, "max_tokens": 200,
        "messages": [{"role": "user", "content": " ".join(["word"] * 200)}]})
    assert resp.status == 200
    await resp.content.readline()  # the first event arrived: the engine is generating
    assert engine.running() == 1
    resp.close()  # the client goes away mid-stream
    for _ in range(100):
        if engine.running() == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.running() == 0 and engine.aborted  # nothing left generating
