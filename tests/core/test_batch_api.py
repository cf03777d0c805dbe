"""The fake Batch API (flowlift.testing.batch) and the batch backend's client
(flowlift.proxy.dispatch.batch.api): packing, submission, polling, every per-line outcome."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestServer

from flowlift.errors import ConfigError, UpstreamError
from flowlift.proxy.config import BatchSpec, parse_config
from flowlift.proxy.dispatch.batch.api import (
    Advice,
    BatchClient,
    BatchLine,
    Kind,
    custom_id,
    pack,
    parse_custom_id,
    read_outcomes,
)
from flowlift.testing import MALFORMED, FakeBatchAPI, LineError, lognormal_turnaround


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@contextlib.asynccontextmanager
async def _client(api: FakeBatchAPI) -> AsyncIterator[tuple[BatchClient, Clock]]:
    server = TestServer(api.app())
    await server.start_server()
    clock = api._clock
    assert isinstance(clock, Clock)

    async def sleep(seconds: float) -> None:
        clock.t += seconds  # polling advances the fake clock instead of waiting

    spec = BatchSpec(kind="openai-batch", base_url=str(server.make_url("/v1")),
                     poll_initial_s=1.0, poll_max_s=60.0)
    client = BatchClient(spec, "sk-test", sleep=sleep)
    try:
        yield client, clock
    finally:
        await client.aclose()
        await server.close()


def lines(n: int, model: str = "m", run: str = "r1") -> list[BatchLine]:
    return [BatchLine(custom_id(run, f"s{i}", 1),
                      {"model": model, "messages": [{"role": "user", "content": f"q{i}"}]})
            for i in range(n)]


def test_custom_id_round_trips_step_ids_with_colons() -> None:
    assert parse_custom_id(custom_id("run1", "a:b", 3)) == ("run1", "a:b", 3)
    with pytest.raises(ValueError, match="custom_id"):
        parse_custom_id("nocolons")


def test_pack_splits_by_model_line_count_and_bytes() -> None:
    mixed = lines(5, "a") + lines(3, "b")
    files = pack(mixed, max_lines=2)
    assert [(f.model, len(f.custom_ids)) for f in files] == [
        ("a", 2), ("a", 2), ("a", 1), ("b", 2), ("b", 1)]
    one = len(lines(1)[0].encode())
    by_bytes = pack(lines(4), max_bytes=2 * one + 1)
    assert [len(f.custom_ids) for f in by_bytes] == [2, 2]
    assert all(len(f.data) <= 2 * one + 1 for f in by_bytes)
    assert [json.loads(x)["custom_id"] for x in files[0].data.splitlines()] == [
        "r1:s0:1", "r1:s1:1"]


def test_pack_refuses_a_line_past_the_file_limit_and_a_line_without_model() -> None:
    with pytest.raises(ConfigError, match="byte file limit"):
        pack(lines(1), max_bytes=10)
    with pytest.raises(ConfigError, match="names no model"):
        pack([BatchLine("r:s:1", {"messages": []})])


def test_read_outcomes_classifies_every_kind() -> None:
    def ok(cid: str) -> dict[str, Any]:
        return {"custom_id": cid, "response": {"status_code": 200, "body": {
            "choices": [{"message": {"content": "x"}}]}}, "error": None}
    output = "\n".join(json.dumps(r) for r in [
        ok("a"),
        {"custom_id": "z", "response": {"status_code": 0, "request_id": "", "body": None},
         "error": None},
        "not json"])
    errors = "\n".join(json.dumps(r) for r in [
        {"custom_id": "b", "response": {"status_code": 400, "body": {"error": {
            "message": "bad"}}}, "error": None},
        {"custom_id": "c", "response": {"status_code": 500, "body": {}}, "error": None},
        {"custom_id": "d", "response": None, "error": {"code": "batch_expired",
                                                        "message": "late"}},
        {"custom_id": "e", "response": None, "error": {"code": "batch_cancelled",
                                                        "message": "x"}},
        {"custom_id": "f", "response": {"status_code": 429, "body": {}}, "error": None}])
    got = read_outcomes(["a", "b", "c", "d", "e", "f", "z", "gone"], output, errors + "\n{")
    assert {k: v.kind for k, v in got.items()} == {
        "a": Kind.OK, "b": Kind.INVALID, "c": Kind.FAILED, "d": Kind.EXPIRED,
        "e": Kind.CANCELLED, "f": Kind.FAILED, "z": Kind.MALFORMED, "gone": Kind.MISSING}
    assert got["b"].advice is Advice.FASTER  # a validation error: never the same tier
    assert got["d"].advice is Advice.FASTER
    assert got["z"].advice is Advice.ANY
    assert got["a"].advice is Advice.ACCEPT and got["a"].completion is not None


async def test_a_batch_completes_after_its_turnaround_with_every_line(clock: Clock) -> None:
    api = FakeBatchAPI(clock=clock, time_scale=10.0,
                       turnaround=lambda rng: 600.0)  # 60 s of the fake clock
    async with _client(api) as (client, _):
        (file,) = pack(lines(3))
        file_id, batch_id = await client.submit(file)
        assert (await client.get(batch_id))["status"] == "in_progress"
        clock.t = 30.0
        half = await client.get(batch_id)
        assert half["status"] == "in_progress" and half["request_counts"]["completed"] == 1
        final = await client.wait(batch_id)
        assert final["status"] == "completed"
        assert final["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert 60.0 <= clock.t < 200.0  # backed off, but not past poll_max_s
        got = await client.outcomes(final, file.custom_ids)
        assert [o.kind for o in got.values()] == [Kind.OK] * 3
        content = got["r1:s2:1"].completion
        assert content is not None
        assert content["choices"][0]["message"]["content"] == "echo: q2"
        assert await client.content(file_id) == file.data.decode()


async def test_partial_failures_go_to_the_error_file(clock: Clock) -> None:
    def responder(body: dict[str, Any]) -> Any:
        text = body["messages"][-1]["content"]
        return {"q0": LineError(400, "invalid_request_error", "bad schema"),
                "q1": LineError(500, "server_error", "boom"),
                "q2": MALFORMED}.get(text, "fine")
    api = FakeBatchAPI(clock=clock, responder=responder, turnaround=lambda rng: 5.0)
    async with _client(api) as (client, _):
        (file,) = pack(lines(4))
        _, batch_id = await client.submit(file)
        final = await client.wait(batch_id)
        # the malformed line counts as completed: "completed, 0 failed" in the wild
        assert final["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
        assert final["error_file_id"] and final["output_file_id"]
        got = await client.outcomes(final, file.custom_ids)
        assert [o.kind for o in got.values()] == [Kind.INVALID, Kind.FAILED,
                                                  Kind.MALFORMED, Kind.OK]
        assert got["r1:s0:1"].message == "bad schema"


async def test_an_expired_batch_keeps_its_finished_lines(clock: Clock) -> None:
    api = FakeBatchAPI(clock=clock, turnaround=lambda rng: 2 * 86400.0)
    async with _client(api) as (client, _):
        (file,) = pack(lines(4))
        _, batch_id = await client.submit(file)
        client.spec = client.spec.model_copy(update={"poll_max_s": 3600.0})
        final = await client.wait(batch_id)
        assert final["status"] == "expired" and final["expired_at"]
        got = await client.outcomes(final, file.custom_ids)
        assert [o.kind for o in got.values()] == [Kind.OK, Kind.OK,
                                                  Kind.EXPIRED, Kind.EXPIRED]


async def test_a_cancelled_batch_keeps_its_finished_lines(clock: Clock) -> None:
    api = FakeBatchAPI(clock=clock, turnaround=lambda rng: 100.0)
    async with _client(api) as (client, _):
        (file,) = pack(lines(4))
        _, batch_id = await client.submit(file)
        clock.t = 50.0
        await client.cancel(batch_id)
        clock.t = 500.0
        final = await client.wait(batch_id)
        assert final["status"] == "cancelled" and final["cancelled_at"]
        got = await client.outcomes(final, file.custom_ids)
        assert [o.kind for o in got.values()] == [Kind.OK, Kind.OK,
                                                  Kind.CANCELLED, Kind.CANCELLED]
        assert (await client.cancel(batch_id))["status"] == "cancelled"


async def test_the_fake_refuses_what_the_real_api_refuses(clock: Clock) -> None:
    api = FakeBatchAPI(clock=clock)
    async with _client(api) as (client, _):
        with pytest.raises(UpstreamError, match="does not exist"):
            await client.create("file-nope")
        http = httpx.AsyncClient(base_url=client.spec.base_url + "/")
        file_id = await client.upload(b'{"custom_id":"a"}\n')
        bad = await http.post("batches", json={"input_file_id": file_id,
                                               "endpoint": "/v1/chat/completions",
                                               "completion_window": "1h"})
        assert bad.status_code == 400
        nofile = await http.post("files", data={"purpose": "fine-tune"})
        assert nofile.status_code == 400
        assert (await http.get("batches/batch_x")).status_code == 404
        await http.aclose()


def test_lognormal_turnaround_matches_the_published_median_and_p90() -> None:
    import random
    draw = lognormal_turnaround()
    rng = random.Random(1)
    xs = sorted(draw(rng) for _ in range(20_000))
    assert 380 < xs[10_000] < 460  # median 7 minutes
    assert 3300 < xs[18_000] < 3900  # 90% under an hour
    assert xs[-1] <= 86400 * 1.02


def test_config_declares_tiers_prices_and_batch_backends(monkeypatch: Any) -> None:
    monkeypatch.setenv("K", "sk")
    cfg = parse_config({
        "backends": {"std": {"kind": "openai", "base_url": "http://x/v1", "tier": "flex",
                             "input_price_per_1k": 0.1, "output_price_per_1k": 0.4},
                     "b": {"kind": "openai-batch", "base_url": "http://x/v1",
                           "api_key_env": "K", "input_price_per_1k": 0.05}},
        "models": {"m": {"backends": ["std"], "batch": "b"}}})
    batch = cfg.backends["b"]
    assert isinstance(batch, BatchSpec) and batch.tier == "batch"
    assert batch.max_lines_per_file == 50_000
    with pytest.raises(ConfigError, match="is a batch backend"):
        parse_config({"backends": {"b": {"kind": "openai-batch", "base_url": "http://x"}},
                      "models": {"m": {"backends": ["b"]}}})
    with pytest.raises(ConfigError, match="not a backend of kind"):
        parse_config({"backends": {"s": {"kind": "openai", "base_url": "http://x"}},
                      "models": {"m": {"backends": ["s"], "batch": "s"}}})
    with pytest.raises(ConfigError, match="max_lines_per_file"):
        parse_config({"backends": {"b": {"kind": "openai-batch", "base_url": "http://x",
                                         "max_lines_per_file": 60_000}}})


class Recorder:
    def __init__(self, die_on_submit: bool = False) -> None:
        self.events: list[tuple[str, Any]] = []
        self.die_on_submit = die_on_submit

    def uploaded(self, file_id: str, model: str, custom_ids: Any) -> None:
        self.events.append(("uploaded", (file_id, model, tuple(custom_ids))))

    def submitted(self, submission: Any) -> None:
        if self.die_on_submit:  # the process dies between create and the journal write
            raise SystemExit("killed")
        self.events.append(("submitted", submission))

    def finished(self, done: Any) -> None:
        self.events.append(("finished", done.status))


async def test_the_pool_packs_lines_ready_together_into_one_file_per_model(
        clock: Clock) -> None:
    import asyncio

    from flowlift.proxy.dispatch.batch.pool import BatchPool
    api = FakeBatchAPI(clock=clock, turnaround=lambda rng: 30.0)
    async with _client(api) as (client, _):
        journal = Recorder()
        seen: list[float] = []
        pool = BatchPool(client, journal=journal, collect_s=0.01,
                         on_finished=lambda d: seen.append(d.turnaround_s))
        got = await asyncio.gather(*(pool.outcome(x) for x in lines(3, "a") + lines(2, "b")))
        assert [o.kind for o in got] == [Kind.OK] * 5
        assert len(api.batches) == 2  # one file per model
        assert [e[0] for e in journal.events].count("uploaded") == 2
        assert [e[0] for e in journal.events].count("submitted") == 2
        assert seen == [30.0, 30.0]
        await pool.aclose()


async def test_a_restart_resumes_polling_and_never_submits_a_line_twice(
        clock: Clock) -> None:
    import asyncio

    from flowlift.proxy.dispatch.batch.pool import BatchPool
    api = FakeBatchAPI(clock=clock, turnaround=lambda rng: 30.0)
    async with _client(api) as (client, _):
        dying = BatchPool(client, journal=Recorder(die_on_submit=True))
        with pytest.raises(SystemExit):
            await dying._submit_file(pack(lines(3))[0])
        await dying.aclose()
        assert len(api.batches) == 1
        (file_id,) = [f for f in api.files if api.files[f] == pack(lines(3))[0].data]
        # the restarted proxy read "uploaded" from the journal, not "submitted"
        journal = Recorder()
        pool = BatchPool(client, journal=journal)
        sub = await pool.adopt(file_id, "m", pack(lines(3))[0].custom_ids)
        assert sub is not None and sub.batch_id in api.batches
        got = await asyncio.gather(*(pool.wait_line(c) for c in sub.custom_ids))
        assert [o.kind for o in got] == [Kind.OK] * 3
        assert len(api.batches) == 1  # nothing submitted twice
        # a journaled submission is resumed as is, without a POST
        posts = sum(1 for m, p in api.requests if m == "POST")
        again = BatchPool(client)
        again.resume(sub)
        assert (await again.wait_line(sub.custom_ids[0])).kind is Kind.OK
        assert sum(1 for m, p in api.requests if m == "POST") == posts
        assert await pool.adopt("file-never", "m", ["x:y:1"]) is None
        await pool.aclose()
        await again.aclose()


async def test_a_batch_whose_lines_are_all_abandoned_is_cancelled(clock: Clock) -> None:
    import asyncio

    from flowlift.proxy.dispatch.batch.pool import BatchPool
    api = FakeBatchAPI(clock=clock, turnaround=lambda rng: 100.0)
    async with _client(api) as (client, _):
        pool = BatchPool(client)
        (sub,) = await pool.submit(lines(2))
        clock.t = 60.0
        await pool.abandon(sub.custom_ids[0])
        assert api.batches[sub.batch_id].cancelled_sim is None  # one line still wanted
        await pool.abandon(sub.custom_ids[1])
        assert api.batches[sub.batch_id].cancelled_sim == 60.0
        got = await asyncio.gather(*(pool.wait_line(c) for c in sub.custom_ids))
        assert [o.kind for o in got] == [Kind.OK, Kind.CANCELLED]  # finished line kept
        await pool.aclose()


async def test_a_completed_batch_returns_every_line_whatever_the_float_rounding(
        clock: Clock) -> None:
    # (created + turnaround) - created < turnaround in floats for the first pair
    cases = [(42057.1580830845, 2589.1675029296334), (0.1, 0.7), (5.0, 1 / 3)]
    turnarounds = iter([t for _, t in cases])
    api = FakeBatchAPI(clock=clock, turnaround=lambda rng: next(turnarounds))
    async with _client(api) as (client, _):
        for k, (created, _) in enumerate(cases):
            clock.t = created
            (file,) = pack(lines(7, run=f"r{k}"))
            _, batch_id = await client.submit(file)
            final = await client.wait(batch_id)
            assert final["status"] == "completed" and not final["error_file_id"]
            got = await client.outcomes(final, file.custom_ids)
            assert {o.kind for o in got.values()} == {Kind.OK}


async def test_a_line_abandoned_before_its_file_is_sent_is_never_submitted(
        clock: Clock) -> None:
    import asyncio

    from flowlift.proxy.dispatch.batch.pool import BatchPool
    api = FakeBatchAPI(clock=clock)
    async with _client(api) as (client, _):
        pool = BatchPool(client, collect_s=0.05)
        (line,) = lines(1)
        waiting = asyncio.ensure_future(pool.outcome(line))
        await asyncio.sleep(0)
        await pool.abandon(line.custom_id)
        assert (await waiting).kind is Kind.CANCELLED
        await asyncio.sleep(0.1)
        assert not api.batches and not api.files
        await pool.aclose()


async def test_the_pool_forgets_the_lines_it_answered(clock: Clock) -> None:
    import asyncio

    from flowlift.proxy.dispatch.batch.pool import BatchPool
    api = FakeBatchAPI(clock=clock, turnaround=lambda rng: 10.0)
    async with _client(api) as (client, _):
        pool = BatchPool(client, collect_s=0.01)
        read = lines(3)
        got = await asyncio.gather(*(pool.outcome(x) for x in read[:2]))
        assert [o.kind for o in got] == [Kind.OK, Kind.OK]
        (sub,) = await pool.submit(read[2:])
        await pool.abandon(sub.custom_ids[0])  # its only line: the batch is cancelled
        for _ in range(50):
            if not pool._futures:
                break
            await asyncio.sleep(0.01)
        assert not pool._futures and not pool._batch_of and not pool._abandoned
        await pool.aclose()


async def test_a_malformed_line_comes_in_a_completed_batch_with_0_failed(clock: Clock) -> None:
    api = FakeBatchAPI(clock=clock, turnaround=lambda rng: 5.0,
                       responder=lambda body: MALFORMED if body["messages"][-1]["content"]
                       == "q1" else "fine")
    async with _client(api) as (client, _):
        (file,) = pack(lines(3))
        _, batch_id = await client.submit(file)
        final = await client.wait(batch_id)
        # what the provider says: every line completed, none failed, no error file
        assert final["status"] == "completed" and final["error_file_id"] is None
        assert final["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        got = await client.outcomes(final, file.custom_ids)
        assert [o.kind for o in got.values()] == [Kind.OK, Kind.MALFORMED, Kind.OK]
        malformed = got["r1:s1:1"]
        assert malformed.advice is Advice.ANY and malformed.completion is None
