"""Prefill-ahead: while a ``@tool`` step (or an agent step's tool call) is out, the
embedded engine prefills the known start of the step that reads its result; never under
memory pressure, released when memory runs short, never changing an output
(FakeEngine, an in-process proxy)."""

from __future__ import annotations

import asyncio

import pytest

from flowlift import step, tool, workflow
from flowlift.graph import MessageTemplate, Ref, Text
from flowlift.local_engine.base import ChatMessage, GenerationRequest, ToolCall
from flowlift.proxy import create_app
from flowlift.proxy.config import ProxyConfig
from flowlift.proxy.dispatch.slots.prefill_ahead import AHEAD_PRIORITY, AheadConfig, skip_reason
from flowlift.proxy.dispatch.slots.scheduler import PrioritySlots
from flowlift.proxy.state import STATE
from flowlift.proxy.workflows.ahead import HOLE, known_prefix, next_turn_prefix
from flowlift.testing import FakeEngine, tool_calls_text

DOC = " ".join(f"word{i}" for i in range(60))
SEEN: dict[str, object] = {}


def base_url(client) -> str:
    return str(client.make_url("")).rstrip("/")


async def proxy(aiohttp_client, engine: FakeEngine, **config):
    app = create_app({"fake-model": engine}, ProxyConfig(**config))
    c = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return c, app[STATE].backends


@step(max_tokens=8)
def facts(doc):
    return f"Facts of: {doc}"


@tool
async def lookup(fact) -> str:
    await asyncio.sleep(0.05)  # the proxy's prefill-ahead runs meanwhile
    engine = SEEN["engine"]
    assert isinstance(engine, FakeEngine)
    SEEN["prefills_while_out"] = list(engine.prefills)
    return "looked up"


@step(max_tokens=8)
def answer(doc, fact, found):
    return [{"role": "system", "content": "You answer from the document."},
            {"role": "user", "content": f"Document: {doc}\nFact: {fact}\nLookup: {found}\n"
                                        "Answer:"}]


async def run_pipeline(client) -> tuple[str, object]:
    async with workflow("ahead", base_url=base_url(client)) as wf:
        f = facts(DOC)
        out = answer(DOC, f, lookup(f))
    rec = next(r for r in wf.trace if r.get("step_id") == "answer_1")
    return out.value, rec


# -- pure parts --------------------------------------------------------------------


def test_known_prefix_fills_what_is_known_and_stops_at_the_first_unknown_hole():
    templates = (MessageTemplate(role="system", content=(Text(text="sys"),)),
                 MessageTemplate(role="user", content=(
                     Text(text="A "), Ref(ref="a", path=("x",)), Text(text=" B "),
                     Ref(ref="tool"), Text(text=" C"))))
    got = known_prefix(templates, {"a": {"x": [1, 2]}})
    assert got == [ChatMessage("system", "sys"), ChatMessage("user", f"A [1, 2] B {HOLE}")]
    # a hole not yet known earlier in the prompt ends it there
    assert known_prefix(templates, {})[-1] == ChatMessage("user", f"A {HOLE}")
    # nothing before the hole, or no hole left: nothing to prefill
    assert known_prefix((MessageTemplate(role="user", content=(Ref(ref="t"),)),), {}) is None
    assert known_prefix(templates, {"a": {"x": 1}, "tool": "r"}) is None


def test_next_agent_turn_ends_at_the_first_result():
    convo = [ChatMessage("user", "q")]
    calls = (ToolCall("c1", "search", "{}"), ToolCall("c2", "calc", "{}"))
    got = next_turn_prefix(convo, "", calls)
    assert got[:1] == convo and got[1].tool_calls == calls
    assert got[2] == ChatMessage("tool", HOLE, tool_call_id="c1")


@pytest.mark.parametrize(("kv", "in_flight", "busy", "queued", "reason"), [
    (0.1, 0, 0, 0, None), (None, 1, 0, 0, None), (0.7, 0, 0, 0, "memory"),
    (0.95, 0, 0, 0, "memory"), (0.1, 2, 0, 0, "in_flight"), (0.1, 0, 4, 0, "busy"),
])
async def test_skip_reason(kv, in_flight, busy, queued, reason):
    slots = PrioritySlots(4)
    slots.in_use = busy
    assert skip_reason(AheadConfig(), kv_usage=kv, in_flight=in_flight, slots=slots) == reason
    assert skip_reason(AheadConfig(enabled=False), kv_usage=0.0, in_flight=0,
                       slots=slots) == "off"


# -- on the proxy ------------------------------------------------------------------


async def test_the_next_steps_known_prefix_is_prefilled_while_the_tool_is_out(
        aiohttp_client):
    engine = FakeEngine(["fake-model"])
    SEEN.clear()
    SEEN["engine"] = engine
    client, backends = await proxy(aiohttp_client, engine)
    _, rec = await run_pipeline(client)
    (request, prefix), = SEEN["prefills_while_out"]
    assert isinstance(request, GenerationRequest)
    assert request.priority == AHEAD_PRIORITY and request.sampling.max_tokens == 1
    assert backends.ahead.counts["done"] == 1
    # the prefix is the step's own prompt up to the tool's output, the fact filled in
    (req,) = [r for r in engine.requests if r.request_id.split(":")[1] == "answer_1"]
    text = FakeEngine.prompt_text(req)
    assert prefix == text[:text.index("looked up")]
    assert prefix.startswith("system: You answer from the document. user: Document: " + DOC)
    assert prefix.endswith("\nLookup: ") and "\nFact: " in prefix
    assert rec["cached_tokens"] >= len(prefix.split()) - 1


async def test_outputs_and_requests_are_the_same_without_it(aiohttp_client):
    runs = []
    for enabled in (True, False):
        engine = FakeEngine(["fake-model"])
        SEEN["engine"] = engine
        client, _ = await proxy(aiohttp_client, engine, prefill_ahead=enabled)
        value, rec = await run_pipeline(client)
        runs.append((value, [(r.messages, r.sampling, r.constraint) for r in engine.requests],
                     rec["cached_tokens"], len(engine.prefills)))
    (on_value, on_requests, on_cached, on_prefills), (off_value, off_requests, off_cached,
                                                     off_prefills) = runs
    assert on_value == off_value and on_requests == off_requests
    assert (on_prefills, off_prefills) == (1, 0)
    assert on_cached > off_cached  # what it is for


async def test_none_is_issued_under_memory_pressure(aiohttp_client):
    engine = FakeEngine(["fake-model"], kv_usage=lambda: 0.9)
    SEEN["engine"] = engine
    client, backends = await proxy(aiohttp_client, engine, prefill_ahead_max_kv_usage=0.8)
    await run_pipeline(client)
    assert SEEN["prefills_while_out"] == [] and engine.prefills == []
    assert backends.ahead.counts["skipped_memory"] == 1


async def test_one_in_flight_is_released_when_memory_runs_short(aiohttp_client):
    usage = [0.1]
    engine = FakeEngine(["fake-model"], kv_usage=lambda: usage[0], prefill_delay_s=30)
    SEEN["engine"] = engine
    client, backends = await proxy(aiohttp_client, engine)

    @tool
    async def slow(fact) -> str:
        for _ in range(100):  # the prefill-ahead starts, then memory runs short
            if engine.prefills:
                break
            await asyncio.sleep(0.01)
        usage[0] = 0.95
        for _ in range(100):
            if backends.ahead.in_flight() == 0:
                break
            await asyncio.sleep(0.01)
        return "looked up"

    async with workflow("ahead", base_url=base_url(client)) as wf:
        f = facts(DOC)
        out = answer(DOC, f, slow(f))
    assert out.value and wf.failures == {}
    (request, _), = engine.prefills
    assert request.request_id in engine.aborted and engine.prefilled == []
    assert backends.ahead.counts["released"] == 1 and backends.ahead.in_flight() == 0


async def test_an_agent_steps_next_turn_is_prefilled_while_its_call_is_out(aiohttp_client):
    engine = FakeEngine(["fake-model"])
    answers = [tool_calls_text(("find", {"q": "alpha"})), "done"]
    engine.responder = lambda request: answers.pop(0)
    client, _ = await proxy(aiohttp_client, engine)
    prefills_out: list[int] = []

    @tool
    async def find(q: str) -> str:
        """Find something."""
        await asyncio.sleep(0.05)
        prefills_out.append(len(engine.prefilled))
        return f"found {q}"

    @step(tools=[find], max_turns=3)
    def agent(question):
        return [{"role": "system", "content": "You use tools. " + DOC},
                {"role": "user", "content": question}]

    async with workflow("agent", base_url=base_url(client)) as wf:
        out = agent("what is alpha?")
    assert out.value == "done" and prefills_out == [1]
    (request, prefix), = engine.prefills
    second = FakeEngine.prompt_text(engine.requests[1])
    assert second.startswith(prefix) and "found alpha" in second[len(prefix):]
    assert "found alpha" not in prefix and request.tools == ()
    rec = next(r for r in wf.trace if r.get("step_id") == "agent_1")
    assert rec["attempts"][1]["cached_tokens"] >= len(prefix.split()) - 1


# -- flags ---------------------------------------------------------------------------


def test_serve_flags_reach_the_proxy_settings():
    from flowlift.cli import build_parser, serve_flags
    from flowlift.proxy.config import settings

    assert settings({}).prefill_ahead is True  # on by default
    args = build_parser().parse_args(["serve", "--no-prefill-ahead",
                                      "--prefill-ahead-max-kv-usage", "0.5"])
    got = settings(serve_flags(args))
    assert (got.prefill_ahead, got.prefill_ahead_max_kv_usage) == (False, 0.5)
    assert settings(serve_flags(build_parser().parse_args(["serve"]))).prefill_ahead is True


@pytest.mark.parametrize("value", ["0", "1.5", "x", "nan"])
def test_a_share_outside_0_1_is_refused(capsys, value):
    from flowlift import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--engine", "fake", "--prefill-ahead-max-kv-usage", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "must be a number in (0, 1]" in err, err
