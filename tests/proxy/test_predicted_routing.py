"""Routing by predicted latency (proxy/dispatch/routing/latency.py, routing.py): the per-replica
TTFT/TPOT models, the choice they drive, the bound on affinity, and replicas of
different speeds behind a real proxy (httpx.MockTransport: no upstream sockets)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest

from flowlift.errors import ConfigError
from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.dispatch.routing.latency import Demand, Features, LatencyBook, Ridge
from flowlift.proxy.dispatch.routing.routing import Route, affinity_score, pick
from flowlift.proxy.state import STATE


def _observe(book, name, in_flight, ttft_s, *, tokens=11, tpot_s=0.01, prompt=400,
             cached=0, now=0.0):
    book.observe(name, "m", Features(in_flight, prompt, cached), ttft_s=ttft_s,
                 total_s=ttft_s + (tokens - 1) * tpot_s, output_tokens=tokens, now=now)


def test_the_ttft_model_learns_how_queue_depth_slows_a_replica():
    book = LatencyBook()
    for _ in range(5):
        for depth in (0, 2, 4):
            _observe(book, "a", depth, 0.1 + 0.1 * depth)
    w = book.replicas["a"].ttft.weights()
    assert w[0] == pytest.approx(0.1, abs=0.01) and w[1] == pytest.approx(0.1, abs=0.01)
    at3 = book.predict("a", Features(3, 400), 11, now=0.0)
    assert at3 == pytest.approx(0.4 + 10 * 0.01, abs=0.02)
    assert book.predict("a", Features(0, 400), 11, now=0.0) < at3


def test_slopes_stay_non_negative():
    ridge = Ridge(3)
    for depth in range(6):  # more load, faster answers: noise, never a rule to follow
        ridge.add((1.0, float(depth), 0.4), 1.0 - 0.1 * depth)
    w = ridge.weights()
    assert w[1] == 0.0 and w[2] >= 0.0
    assert ridge.predict((1.0, 50.0, 0.4)) > 0.0


def test_an_expected_prefix_hit_lowers_the_predicted_ttft():
    book = LatencyBook()
    for _ in range(4):  # prefill: 0.05 s + 0.2 s per 1,000 uncached tokens
        for uncached in (0, 1000, 3000):
            _observe(book, "a", 0, 0.05 + 0.2 * uncached / 1000, prompt=uncached)
    book.sent("a", "run-1", 2000)
    demand = Demand(prompt_tokens=2500, affinity="run-1")
    warm = book.features("a", demand, in_flight=0)
    cold = book.features("a", Demand(prompt_tokens=2500, affinity="run-2"), in_flight=0)
    assert warm.cached_tokens == 2000 and cold.cached_tokens == 0
    t_warm = book.predict("a", warm, 1, now=0.0)
    t_cold = book.predict("a", cold, 1, now=0.0)
    assert t_warm == pytest.approx(0.05 + 0.2 * 0.5, abs=0.02)
    assert t_cold == pytest.approx(0.05 + 0.2 * 2.5, abs=0.02)


def test_old_observations_fade_until_the_replica_is_unknown_again():
    book = LatencyBook(half_life_s=10.0)
    for _ in range(5):
        _observe(book, "a", 0, 0.2, now=100.0)
    assert book.predict("a", Features(0, 400), 11, now=100.0) is not None
    assert book.predict("a", Features(0, 400), 11, now=160.0) is None
    assert book.predict("never", Features(0, 400), 11, now=100.0) is None


def test_recent_observations_outweigh_old_ones():
    book = LatencyBook()
    for _ in range(30):
        _observe(book, "a", 0, 0.1)
    for _ in range(30):  # the replica got slower
        _observe(book, "a", 0, 1.0)
    assert book.predict("a", Features(0, 400), 1, now=0.0) > 0.8


def test_failures_add_their_cost_to_the_prediction():
    book = LatencyBook()
    for name in ("steady", "flaky"):
        for _ in range(6):
            _observe(book, name, 0, 0.1)
    for _ in range(4):
        book.failed("flaky", 0.5, now=0.0)
    steady = book.predict("steady", Features(0, 400), 11, now=0.0)
    flaky = book.predict("flaky", Features(0, 400), 11, now=0.0)
    assert flaky > steady * 1.2


def test_a_whole_answer_teaches_ttft_less_the_predicted_decode():
    book = LatencyBook()
    for _ in range(4):  # streamed: TTFT 0.1 s, TPOT 0.02 s
        _observe(book, "a", 0, 0.1, tokens=21, tpot_s=0.02)
    for _ in range(20):  # whole answers of 21 tokens in 0.5 s: TTFT 0.1 s
        book.observe("a", "m", Features(0, 400), ttft_s=0.5, total_s=0.5,
                     output_tokens=21, now=0.0, streamed=False)
    assert book.replicas["a"].ttft.predict((1.0, 0.0, 0.4)) == pytest.approx(0.1, abs=0.02)


def test_expected_output_follows_answers_and_max_tokens():
    book = LatencyBook()
    assert book.expected_output("m", None) == 128.0
    for _ in range(50):
        _observe(book, "a", 0, 0.1, tokens=40)
    assert book.expected_output("m", None) == pytest.approx(40, abs=1)
    assert book.expected_output("m", 10) == 10


ROUTE = Route("m", ("r1", "r2", "r3"))


def _pick(route=ROUTE, predicted=None, load=None, **kw):
    predicted = predicted or {}
    return pick(route, available=lambda n: True, load=(load or {}).get if load else lambda n: 0,
                predict=predicted.get, **kw)


def test_predicted_latency_picks_the_fastest_not_the_least_loaded():
    times = {"r1": 0.9, "r2": 0.3, "r3": 0.5}
    loads = {"r1": 0, "r2": 6, "r3": 1}
    assert _pick(predicted=times, load=loads) == "r2"
    least = Route("m", ROUTE.replicas, strategy="least-loaded")
    assert _pick(least, predicted=times, load=loads) == "r1"


def test_an_unknown_replica_is_explored_before_a_known_one_as_fast():
    assert _pick(predicted={"r1": 0.2}) == "r2"
    assert _pick(predicted={"r1": 0.2, "r2": 0.1}) == "r3"
    assert _pick(predicted={}, load={"r1": 2, "r2": 0, "r3": 1}) == "r2"  # nothing known
    # one probe at a time: an unknown replica with a request in flight is left out
    assert _pick(predicted={"r1": 0.2}, load={"r1": 3, "r2": 1, "r3": 1}) == "r1"
    assert _pick(predicted={"r1": 0.2}, load={"r1": 3, "r2": 1, "r3": 0}) == "r3"


def _home(route, key_prefix, target):
    return next(k for k in (f"{key_prefix}-{i}" for i in range(1000))
                if max(route.replicas, key=lambda n: affinity_score(k, n)) == target)


def test_affinity_wins_only_while_its_replica_is_not_predicted_much_slower():
    key = _home(ROUTE, "run", "r1")
    assert _pick(predicted={"r1": 0.29, "r2": 0.2, "r3": 0.4}, affinity=key) == "r1"
    second = max(("r2", "r3"), key=lambda n: affinity_score(key, n))
    assert _pick(predicted={"r1": 0.31, "r2": 0.2, "r3": 0.25}, affinity=key) == second
    assert _pick(predicted={"r1": 0.31, "r2": 0.2, "r3": 0.4}, affinity=key) == "r2"
    loose = Route("m", ROUTE.replicas, affinity_max_slowdown=10.0)
    assert _pick(loose, predicted={"r1": 1.9, "r2": 0.2, "r3": 0.4}, affinity=key) == "r1"
    least = Route("m", ROUTE.replicas, strategy="least-loaded")
    assert _pick(least, predicted={"r1": 9.0, "r2": 0.2}, affinity=key) == "r1"


def test_a_replica_the_health_rule_cools_is_never_chosen_however_fast():
    times = {"r1": 0.9, "r2": 0.1, "r3": 0.5}
    cooled = pick(ROUTE, available=lambda n: n != "r2", load=lambda n: 0,
                  predict=times.get)
    assert cooled == "r3"
    key = _home(ROUTE, "run", "r2")
    assert pick(ROUTE, available=lambda n: n != "r2", load=lambda n: 0,
                predict=times.get, affinity=key) == "r3"  # r1: past the bound


def test_round_robin_takes_each_replica_in_turn():
    rr = Route("m", ROUTE.replicas, strategy="round-robin")
    assert [_pick(rr, turn=t) for t in range(6)] == ["r1", "r2", "r3"] * 2


def test_routing_config_is_checked():
    backends = {"a": {"kind": "openai", "base_url": "http://a/v1"}}
    with pytest.raises(ConfigError, match=r"models\.m\.routing"):
        parse_config({"backends": backends,
                      "models": {"m": {"backends": ["a"], "routing": "fastest"}}})
    with pytest.raises(ConfigError, match=r"models\.m\.affinity_max_slowdown"):
        parse_config({"backends": backends,
                      "models": {"m": {"backends": ["a"], "affinity_max_slowdown": 0.5}}})
    config = parse_config({"backends": backends, "models": {"m": {"backends": ["a"]}}})
    assert config.models["m"].routing == "predicted-latency"


class Replicas:
    """Fake upstream replicas by host: each streams ``tokens`` chat chunks after its TTFT,
    one per TPOT (seconds); records which replica served each request."""

    def __init__(self, speeds: dict[str, tuple[float, float]], tokens: int = 6) -> None:
        self.speeds, self.tokens = speeds, tokens
        self.served: Counter[str] = Counter()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.served[host] += 1
        ttft_s, tpot_s = self.speeds[host]
        stream = json.loads(request.content).get("stream") is True

        def event(delta, finish=None):
            return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                           "created": 1, "model": "m", "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"

        async def body():
            await asyncio.sleep(ttft_s)
            for i in range(self.tokens):
                yield event({"content": f"t{i} "})
                await asyncio.sleep(tpot_s)
            yield event({}, "stop")
            yield b"data: [DONE]\n\n"

        if not stream:
            await asyncio.sleep(ttft_s + self.tokens * tpot_s)
            return httpx.Response(200, json={
                "id": "c", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "x"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": self.tokens,
                          "total_tokens": 3 + self.tokens}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=body())


SPEEDS = {"slow": (0.1, 0.01), "fast-a": (0.01, 0.002), "fast-b": (0.01, 0.002)}


async def _proxy(aiohttp_client, replicas, **model):
    config = parse_config({
        "backends": {h: {"kind": "openai", "base_url": f"http://{h}/v1"} for h in SPEEDS},
        "models": {"m": {"backends": list(SPEEDS), **model}}})
    app = create_app({}, file_config=config, transport=httpx.MockTransport(replicas))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def _ask(client, n, *, stream=True, session=None):
    headers = {"X-Flowlift-Session": session} if session else {}
    for _ in range(n):
        resp = await client.post("/v1/chat/completions", headers=headers, json={
            "model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status == 200
        await resp.read()


@pytest.mark.parametrize("stream", [True, False])
async def test_requests_leave_the_slow_replica_that_least_loaded_keeps(aiohttp_client,
                                                                       stream):
    replicas = Replicas(SPEEDS)
    client = await _proxy(aiohttp_client, replicas)
    await _ask(client, 16, stream=stream)
    # one request at a time: every replica idle, least-loaded's tie goes to the first
    # listed (slow) every time; predicted latency tries each, then keeps to the fast ones
    assert replicas.served["slow"] <= 3
    assert replicas.served["fast-a"] + replicas.served["fast-b"] >= 13

    baseline = Replicas(SPEEDS)
    client = await _proxy(aiohttp_client, baseline, routing="least-loaded")
    await _ask(client, 16, stream=stream)
    assert baseline.served["slow"] == 16


async def test_a_session_leaves_its_replica_when_it_is_predicted_much_slower(aiohttp_client):
    route = Route("m", tuple(SPEEDS))
    session = _home(route, "agent", "slow")
    replicas = Replicas(SPEEDS)
    client = await _proxy(aiohttp_client, replicas)
    await _ask(client, 8)  # the replicas' speeds are learned
    before = Counter(replicas.served)
    await _ask(client, 10, session=session)
    moved = replicas.served - before
    # the session moved to the next replica of its rendezvous order (a fast one; only
    # timing noise on a loaded machine, past the 1.5x bound, moves a turn to the other)
    assert moved["slow"] == 0 and max(moved.values()) >= 8

    replicas = Replicas(SPEEDS)
    client = await _proxy(aiohttp_client, replicas, affinity_max_slowdown=1000.0)
    await _ask(client, 8)
    before = Counter(replicas.served)
    await _ask(client, 10, session=session)
    assert (replicas.served - before)["slow"] == 10  # a loose bound keeps the session home


async def test_workflow_steps_on_upstream_replicas_teach_their_latency_models(aiohttp_client):
    from flowlift.testing import parse_sse

    replicas = Replicas(SPEEDS)
    client = await _proxy(aiohttp_client, replicas)
    graph = {"nodes": [{"kind": "llm", "id": f"s{i}", "model": "m", "messages": [
        {"role": "user", "content": [{"text": f"step {i}"}]}]} for i in range(3)]}
    events = parse_sse(await (await client.post("/v1/workflows", json=graph)).text())
    assert len([e for e, _ in events if e == "step.finished"]) == 3
    book = client.app[STATE].backends.latency
    (served, _), = replicas.served.most_common(1)
    model = book.replicas[served]
    assert model.ttft.weight > 2.0 and model.tpot.weight > 2.0  # TTFT and TPOT both seen
    run_id = next(d["run_id"] for e, d in events if "run_id" in d)
    assert book.replicas[served].prefixes.get(run_id, 0) > 0  # its prefix is expected there
