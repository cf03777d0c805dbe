"""Tools the proxy runs itself (issue 24 part 1): ``[tools.*]`` MCP servers (stdio and
Streamable HTTP, real servers started by the tests: tests/tools_mcp_server.py) and
configured Python callables (tests/tools_callables.py), named in ``@step(tools=[...])``
with ``flowlift.proxy_tool("server.tool")`` next to app ``@tool`` functions. FakeEngine
and an in-process proxy; the kill -9 test is tests/reliability/test_proxy_tools_kill9.py."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from flowlift import (
    GraphError,
    StepFailed,
    UserError,
    WorkflowFailed,
    proxy_tool,
    step,
    tool,
    workflow,
)
from flowlift.errors import ConfigError
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, capture_spans, free_port, tool_calls_text
from flowlift.tracing.timeline import segments
from tests import tools_callables
from tests.tools_mcp_server import serving_http

SERVER = str(Path(__file__).parents[1] / "tools_mcp_server.py")
APP_CALLS: list[str] = []


@tool
def note(text: str) -> str:
    """Write a note (an app tool)."""
    APP_CALLS.append(text)
    return f"noted: {text}"


@step(tools=[proxy_tool("mcp.add"), note], max_turns=4)
def adder(question):
    return question


@step(tools=[proxy_tool("atlas.lookup")], max_turns=3)
def geo(question):
    return question


@pytest.fixture(autouse=True)
def _fresh():
    APP_CALLS.clear()
    tools_callables.STARTED.clear()


def scripted(engine: FakeEngine, *answers: str) -> list[GenerationRequest]:
    seen: list[GenerationRequest] = []
    queue = list(answers)

    def respond(request: GenerationRequest) -> str:
        seen.append(request)
        return queue.pop(0)
    engine.responder = respond
    return seen


def config(**tools: dict) -> dict:
    return {"tools": {
        "mcp": {"command": [sys.executable, SERVER], "timeout_s": 5},
        "atlas": {"callables": ["tests.tools_callables:lookup",
                                "tests.tools_callables:slow_sync",
                                "tests.tools_callables:huge"], "timeout_s": 1,
                  "early": "always"},  # (callables declare no MCP annotations)
        **tools}}


async def proxy(aiohttp_client, engine: FakeEngine, cfg: dict):
    app = create_app({"fake-model": engine}, file_config=parse_config(cfg))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client, app


def url(client) -> str:
    return str(client.make_url("")).rstrip("/")


def calls_of(wf, step_id: str) -> list[dict]:
    return next(r for r in wf.trace if r.get("step_id") == step_id)["tool_calls"]


def events(app, wf, name: str) -> list[dict]:
    """The data of the run's ``name`` events, from the proxy's log."""
    run = app[STATE].runs.live(wf.run_id)
    return [d for _, n, d in run.log.history() if n == name]


def tool_messages(request: GenerationRequest) -> str:
    return "\n".join(m.content for m in request.messages)


async def test_stdio_mcp_tool_runs_on_the_proxy_next_to_an_app_tool(
        aiohttp_client, tmp_path, monkeypatch):
    monkeypatch.setenv("SECRET_OF_THE_PROXY", "s3cret")
    engine = FakeEngine(["fake-model"])
    seen = scripted(engine, tool_calls_text(("add", {"a": 2, "b": 3}),
                                            ("note", {"text": "hi"})),
                    "2 + 3 is 5.")
    count = tmp_path / "count.txt"
    client, app = await proxy(aiohttp_client, engine, config(mcp={
        "command": [sys.executable, SERVER], "env": {"COUNT_FILE": str(count)}}))
    async with workflow("mcp", base_url=url(client)) as wf:
        out = adder("What is 2+3?")
    assert out.value == "2 + 3 is 5."
    assert APP_CALLS == ["hi"]  # only the app tool went to the app
    first, second = (tool_messages(r) for r in seen)
    assert "Add two whole numbers." in first  # the server's description reached the model
    assert '"a"' in first and "integer" in first  # and its schema
    assert "5" in second and "noted: hi" in second
    calls = {c["name"]: c for c in calls_of(wf, "adder_1")}
    assert calls["add"]["server"] == "mcp" and calls["add"]["outcome"] == "ok"
    assert calls["note"]["server"] is None
    wanted = events(app, wf, "tool.wanted")
    assert [d["name"] for d in wanted] == ["note"]  # no app round trip for add
    results = events(app, wf, "tool.result")
    assert {"step_id": "adder_1:call_1", "value": "5"} in results
    assert count.read_text() == "2+3\n"  # the server got its `env`


@pytest.fixture
def http_mcp(http_mcp_proc):
    return http_mcp_proc[0]


@pytest.fixture
def http_mcp_proc():
    port = free_port()
    with serving_http(port) as proc:
        yield f"http://127.0.0.1:{port}/mcp", proc


async def test_streamable_http_mcp_server(aiohttp_client, http_mcp):
    engine = FakeEngine(["fake-model"])
    scripted(engine, tool_calls_text(("add", {"a": 40, "b": 2})), "It is 42.")
    cfg = {"tools": {"mcp": {"url": http_mcp, "allow": ["add"]}}}
    client, app = await proxy(aiohttp_client, engine, cfg)
    async with workflow("http", base_url=url(client)) as wf:
        out = adder("40+2?")
    assert out.value == "It is 42."
    assert calls_of(wf, "adder_1")[0]["outcome"] == "ok"
    assert [d["value"] for d in events(app, wf, "tool.result")] == ["42"]


async def test_an_http_server_that_goes_away_mid_call_is_an_error_result(
        aiohttp_client, http_mcp_proc):
    address, proc = http_mcp_proc
    engine = FakeEngine(["fake-model"])

    @step(tools=[proxy_tool("mcp.hang")], max_turns=2)
    def waits(q):
        return q

    seen = scripted(engine, tool_calls_text(("hang", {})), "gave up")
    client, _ = await proxy(aiohttp_client, engine,
                            {"tools": {"mcp": {"url": address, "timeout_s": 20}}})

    async def kill_soon() -> None:
        await asyncio.sleep(1.5)
        proc.kill()

    killer = asyncio.ensure_future(kill_soon())
    t0 = time.monotonic()
    async with workflow("gone", base_url=url(client)):
        out = waits("x")
    await killer
    assert out.value == "gave up"
    assert "error:" in tool_messages(seen[1])
    assert time.monotonic() - t0 < 19, tool_messages(seen[1])  # not the timeout


async def test_configured_callable_tool(aiohttp_client):
    engine = FakeEngine(["fake-model"])
    seen = scripted(engine, tool_calls_text(("lookup", {"city": "Oslo", "k": 2})), "Found.")
    client, _app = await proxy(aiohttp_client, engine, config())
    async with workflow("callable", base_url=url(client)):
        out = geo("Where is Oslo?")
    assert out.value == "Found."
    assert [c for c, _ in tools_callables.STARTED] == ["Oslo"]
    assert engine.prefills == []  # no prefill-ahead racing the next turn's own prefill
    assert "Look a city up in the atlas." in tool_messages(seen[0])
    assert "a city name" in tool_messages(seen[0])  # Field(description=...) in the schema
    assert "Oslo: 2 hit(s)" in tool_messages(seen[1])


async def test_unknown_server_tool_and_disallowed_tool_are_listed_graph_errors(
        aiohttp_client):
    engine = FakeEngine(["fake-model"])
    cfg = config(limited={"command": [sys.executable, SERVER], "allow": ["add"]})
    client, _app = await proxy(aiohttp_client, engine, cfg)

    @step(tools=[proxy_tool("nowhere.add"), proxy_tool("mcp.subtract"),
                 proxy_tool("limited.big")])
    def bad(q):
        return q

    with pytest.raises(GraphError) as err:
        async with workflow("bad", base_url=url(client)):
            bad("x")
    problems = err.value.problems
    assert len(problems) == 3, problems
    assert "tools.0 (nowhere.add)" in problems[0] and "no tool server 'nowhere'" in problems[0]
    assert "has no tool 'subtract'" in problems[1] and "add" in problems[1]
    assert "not in its allow list" in problems[2]
    body = {"nodes": [{"kind": "llm", "id": "a", "messages": [
        {"role": "user", "content": [{"text": "x"}, {"ref": "gone"}]}],
        "tools": [{"name": "add", "server": "nowhere"}]}]}
    resp = await client.post("/v1/workflows", json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == "invalid_graph" and error["param"] == "graph"
    assert "unknown node 'gone'" in error["problems"][0]  # listed with the others
    assert "node 'a' tools.0" in error["problems"][1]


async def test_a_tenant_reaches_only_the_tool_servers_it_is_allowed(
        aiohttp_client, monkeypatch):
    monkeypatch.setenv("ACME_KEYS", "k-acme")
    monkeypatch.setenv("GLOBEX_KEYS", "k-globex")
    engine = FakeEngine(["fake-model"])
    scripted(engine, tool_calls_text(("lookup", {"city": "Rome"})), "Rome.")
    cfg = {**config(), "tenants": {"acme": {"api_key_env": "ACME_KEYS", "tools": ["atlas"]},
                                   "globex": {"api_key_env": "GLOBEX_KEYS"}}}
    client, _app = await proxy(aiohttp_client, engine, cfg)
    async with workflow("acme", base_url=url(client), api_key="k-acme"):
        out = geo("Rome?")
    assert out.value == "Rome."
    with pytest.raises(GraphError, match="tenant 'globex' may not use tool server 'atlas'"):
        async with workflow("globex", base_url=url(client), api_key="k-globex"):
            geo("Rome?")
    with pytest.raises(ConfigError, match=r"tenants.acme.tools: no tool server named 'nope'"):
        parse_config({**cfg, "tenants": {"acme": {"api_key_env": "ACME_KEYS",
                                                  "tools": ["nope"]}}})


async def test_hung_dead_and_huge_tools_become_error_results_and_the_server_recovers(
        aiohttp_client):
    engine = FakeEngine(["fake-model"])
    cfg = config(mcp={"command": [sys.executable, SERVER], "timeout_s": 4,
                      "max_result_bytes": 1_000_000})

    @step(tools=[proxy_tool("mcp.hang"), proxy_tool("mcp.die"), proxy_tool("mcp.big"),
                 proxy_tool("mcp.add"), proxy_tool("mcp.boom"), proxy_tool("atlas.huge"),
                 proxy_tool("atlas.slow_sync")], max_turns=3,
          on_max_turns="raise")
    def rough(q):
        return q

    seen = scripted(engine, tool_calls_text(("hang", {}), ("big", {"n": 2_000_000}),
                                            ("boom", {}), ("huge", {"n": 10_000_000}),
                                            ("slow_sync", {"seconds": 3})),
                    tool_calls_text(("die", {})),
                    tool_calls_text(("add", {"a": 1, "b": 1})))
    client, app = await proxy(aiohttp_client, engine, cfg)
    t0 = time.monotonic()
    with pytest.raises(WorkflowFailed):  # max_turns: every turn called tools
        async with workflow("rough", base_url=url(client)) as wf:
            rough("go")
    assert time.monotonic() - t0 < 30  # never a hung run
    results = {d["step_id"]: d for d in events(app, wf, "tool.result")}
    assert "timeout_s=4" in results["rough_1:call_1"]["error"]
    assert "2000000 bytes, over the proxy's max_result_bytes=1000000" in \
        results["rough_1:call_2"]["error"]
    assert results["rough_1:call_3"]["error"]  # the tool raised: its error text
    assert "10000000 bytes, over the proxy's max_result_bytes=1000000" in \
        results["rough_1:call_4"]["error"]  # atlas's default bound: 1 MB
    assert "timeout_s=1" in results["rough_1:call_5"]["error"]  # a blocked thread
    assert "failed during the call" in results["rough_1:call_6"]["error"]
    third = tool_messages(seen[2])
    assert "error:" in third and "timeout_s" in third  # the model read the errors
    # after its process died the server is started again for the next call
    scripted(engine, tool_calls_text(("add", {"a": 1, "b": 1})), "two")
    async with workflow("after", base_url=url(client)) as wf2:
        out = rough("again")
    assert out.value == "two"
    assert [d.get("value") for d in events(app, wf2, "tool.result")] == ["2"]


async def test_schema_violation_is_the_result_and_raise_fails_the_step(aiohttp_client):
    engine = FakeEngine(["fake-model"])
    seen = scripted(engine, tool_calls_text(("add", {"a": "two", "b": 3})), "gave up")
    client, _app = await proxy(aiohttp_client, engine, config())
    async with workflow("schema", base_url=url(client)) as wf:
        out = adder("x")
    assert out.value == "gave up"
    assert "error: bad arguments for add: a:" in tool_messages(seen[1])
    assert calls_of(wf, "adder_1")[0]["outcome"] == "invalid"

    @step(tools=[proxy_tool("mcp.boom")], tool_errors="raise")
    def strict(q):
        return q

    scripted(engine, tool_calls_text(("boom", {})), "never")
    with pytest.raises(WorkflowFailed) as failed:
        async with workflow("strict", base_url=url(client)):
            strict("x")
    assert isinstance(failed.value.failures["strict_1"], StepFailed)
    assert "tool 'boom' raised" in str(failed.value)


async def test_a_proxy_tool_starts_before_the_turn_stream_ends(aiohttp_client):
    engine = FakeEngine(["fake-model"], delay_s=0.02, chunk_chars=4)
    padding = "p" * 400  # the second call's JSON streams for ~2 s after the first's
    seen = scripted(engine, tool_calls_text(("lookup", {"city": "Lima"}),
                                            ("lookup", {"city": padding})), "ok")
    client, _app = await proxy(aiohttp_client, engine, config())
    async with workflow("early", base_url=url(client)) as wf:
        out = geo("Lima?")
    assert out.value == "ok"
    record = next(r for r in wf.trace if r.get("step_id") == "geo_1")
    turn1 = next(a for a in record["attempts"] if a["turn"] == 1)
    first = next(c for c in record["tool_calls"] if c["turn"] == 1)
    assert first["wanted_ms"] < turn1["finished_ms"] - 1000, (first, turn1)
    assert [c for c, _ in tools_callables.STARTED] == ["Lima", padding]  # each ran once
    assert len(seen) == 2


@tool
async def meet_app() -> str:
    """Wait for the proxy's tool of the same turn."""
    return await tools_callables.MEETING.meet()


async def test_app_and_proxy_calls_of_one_turn_run_concurrently(aiohttp_client):
    tools_callables.MEETING = tools_callables.Meeting()
    engine = FakeEngine(["fake-model"])

    @step(tools=[proxy_tool("side.meet"), meet_app], max_turns=2)
    def both(q):
        return q

    seen = scripted(engine, tool_calls_text(("meet", {}), ("meet_app", {})), "met twice")
    cfg = config(side={"callables": ["tests.tools_callables:meet"], "timeout_s": 10})
    client, _ = await proxy(aiohttp_client, engine, cfg)
    async with workflow("meet", base_url=url(client)) as wf:
        out = both("go")
    assert out.value == "met twice"
    assert tool_messages(seen[1]).count("met") >= 2 and "error" not in tool_messages(seen[1])
    calls = calls_of(wf, "both_1")
    assert [c["outcome"] for c in calls] == ["ok", "ok"]
    record = next(r for r in wf.trace if r.get("step_id") == "both_1")
    stages = {s.stage for s in segments(record)}
    assert {"tool_run", "tool_wait"} <= stages  # the proxy's time apart from the app's


async def test_a_proxy_call_is_its_own_tool_run_span_with_its_server(aiohttp_client):
    with capture_spans() as captured:
        engine = FakeEngine(["fake-model"])
        scripted(engine, tool_calls_text(("lookup", {"city": "Kyiv"})), "found")
        client, _ = await proxy(aiohttp_client, engine, config())
        async with workflow("spans", base_url=url(client)) as wf:
            geo("Kyiv?")
        for _ in range(1000):  # the run's spans are built once it closed
            if captured.named("invoke_workflow spans") and captured.named(
                    "execute_tool lookup"):
                break
            await asyncio.sleep(0.01)
    span = captured.named("execute_tool lookup")[0]
    assert span.attributes["flowlift.tool.server"] == "atlas"
    assert [c.name for c in captured.children(span)] == ["tool_run"]
    record = next(r for r in wf.trace if r.get("step_id") == "geo_1")
    assert record["stages_ms"]["tool_run"] >= 0 and "tool_wait" not in record["stages_ms"]


@step(max_tokens=8)
def warm(q):
    return q


async def test_nodes_appended_to_an_open_run_get_their_proxy_tools_described(
        aiohttp_client, monkeypatch):
    monkeypatch.setenv("GLOBEX_KEYS", "k-globex")
    engine = FakeEngine(["fake-model"])
    seen: list[GenerationRequest] = []

    def respond(request: GenerationRequest) -> str:
        seen.append(request)
        if not request.tools and "Look a city up" not in tool_messages(request):
            return "warm"
        done = "Oslo: 1 hit(s)" in tool_messages(request)
        return "Oslo found." if done else tool_calls_text(("lookup", {"city": "Oslo"}))
    engine.responder = respond
    cfg = {**config(), "tenants": {"globex": {"api_key_env": "GLOBEX_KEYS"}}}
    cfg["server"] = {"api_keys_env": "DEFAULT_KEYS"}
    monkeypatch.setenv("DEFAULT_KEYS", "k-default")
    client, _ = await proxy(aiohttp_client, engine, cfg)
    async with workflow("grow", base_url=url(client), api_key="k-default"):
        await warm("first")  # the run is open and running: what follows is appended
        out = geo("Oslo?")
    assert out.value == "Oslo found."
    assert "Look a city up in the atlas." in tool_messages(seen[-2])
    with pytest.raises(GraphError, match="tenant 'globex' may not use tool server 'atlas'"):
        async with workflow("grow2", base_url=url(client), api_key="k-globex"):
            await warm("first")
            geo("Oslo?")


def test_proxy_tool_names_and_config_are_checked():
    with pytest.raises(UserError, match=r"server\.tool"):
        proxy_tool("no-dot")
    with pytest.raises(UserError, match="two tools are named 'note'"):
        step(tools=[note, proxy_tool("x.note")])(lambda q: q)
    assert parse_config({"tools": {"x": {"callable": "m:f"}}}).tools["x"].callables == ["m:f"]
    with pytest.raises(ConfigError, match="not both"):
        parse_config({"tools": {"x": {"callable": "m:f", "callables": ["m:g"]}}})
    with pytest.raises(ConfigError, match="exactly one of url"):
        parse_config({"tools": {"x": {"url": "http://a/mcp", "command": ["y"]}}})
    with pytest.raises(ConfigError, match="cannot import module 'no_such_mod'"):
        create_app({"fake-model": FakeEngine(["fake-model"])}, file_config=parse_config(
            {"tools": {"x": {"callables": ["no_such_mod:f"]}}}))
