"""Agent steps: ``@step(tools=[...], max_turns=N)`` loops on the proxy, turn by turn,
with the app running each tool call (FakeEngine and an in-process proxy; one test on an
upstream model through an ``httpx.MockTransport``)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import httpx
import pytest
from pydantic import BaseModel, Field

from flowlift import StepFailed, UserError, WorkflowFailed, step, tool, workflow
from flowlift.costs import CostTracker
from flowlift.graph import Graph, LLMNode
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.state import STATE
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.workflows.registry import RunRegistry
from flowlift.sdk.agents import agent_tools, tool_spec
from flowlift.testing import FakeEngine, capture_spans, tool_calls_text
from flowlift.tracing.timeline import segments

CALLED: list[tuple[str, object]] = []


class Meeting:
    """Two tool calls that each wait for the other: they finish only when they run at
    the same time."""

    def __init__(self) -> None:
        self.arrived = 0
        self.both = asyncio.Event()

    async def meet(self) -> None:
        self.arrived += 1
        if self.arrived == 2:
            self.both.set()
        await asyncio.wait_for(self.both.wait(), timeout=5)


MEETING = Meeting()


@tool
async def search(query: str, k: Annotated[int, Field(ge=1, description="hits")] = 2) -> str:
    """Search the corpus for a query."""
    CALLED.append(("search", query))
    if query == "alpha":
        await MEETING.meet()
    return f"hits for {query}: {k}"


@tool
async def calculator(expression: str) -> float:
    """Evaluate an arithmetic expression."""
    CALLED.append(("calculator", expression))
    await MEETING.meet()
    return 5.0


@tool
def lookup(city: str) -> str:
    """Look a city up."""
    CALLED.append(("lookup", city))
    raise ValueError(f"no such city: {city}")


@step(tools=[search, calculator], max_turns=4)
def answer(question):
    return [{"role": "system", "content": "You answer with tools."},
            {"role": "user", "content": question}]


@pytest.fixture(autouse=True)
def _fresh():
    global MEETING
    CALLED.clear()
    MEETING = Meeting()


def scripted(engine: FakeEngine, *answers: str) -> list[GenerationRequest]:
    """Answer the agent's turns with ``answers`` in order; returns the turns' requests."""
    seen: list[GenerationRequest] = []
    queue = list(answers)

    def respond(request: GenerationRequest) -> str:
        seen.append(request)
        return queue.pop(0)
    engine.responder = respond
    return seen


def base_url(client) -> str:
    return str(client.make_url("")).rstrip("/")


def agent_record(wf, step_id: str = "answer_1") -> dict:
    return next(r for r in wf.trace if r.get("step_id") == step_id)


async def test_three_turns_two_tools_parallel_calls_and_the_growing_conversation(
        client, engine):
    seen = scripted(engine,
                    tool_calls_text(("search", {"query": "alpha"}),
                                    ("calculator", {"expression": "2+3"})),
                    tool_calls_text(("search", {"query": "beta", "k": 3})),
                    "The answer is 5.")
    async with workflow("agent", base_url=base_url(client), workflow_class="batch") as wf:
        out = answer("What is 2+3?")
    assert out.value == "The answer is 5."
    assert CALLED == [("search", "alpha"), ("calculator", "2+3"), ("search", "beta")]
    assert len(seen) == 3
    # each turn's prompt is the previous turn's plus its calls and results, in order
    texts = [[m.content for m in r.messages] for r in seen]
    assert texts[1][:len(texts[0])] == texts[0] and texts[2][:len(texts[1])] == texts[1]
    calls_1, results_1 = texts[1][len(texts[0]):]
    assert json.loads(calls_1) == {"tool_calls": [
        {"name": "search", "arguments": {"query": "alpha"}},
        {"name": "calculator", "arguments": {"expression": "2+3"}}]}
    assert results_1.index("Result of search") < results_1.index("Result of calculator")
    assert "hits for alpha: 2" in results_1 and "\n5.0" in results_1
    assert "hits for beta: 3" in texts[2][-1]
    assert "search: Search the corpus" in texts[0][0]  # the tools offered, described
    # later turns reuse the conversation's KV and go at interactive priority
    usage_cached = [a["cached_tokens"] for a in agent_record(wf)["attempts"]]
    assert usage_cached[0] == 0 and usage_cached[1] > 0 and usage_cached[2] > usage_cached[1]
    assert seen[0].priority > 500_000_000 > seen[1].priority  # batch, then interactive
    assert {r.session_id for r in seen} == {wf.run_id}
    rec = agent_record(wf)
    assert [(a["turn"], a["outcome"]) for a in rec["attempts"]] == [
        (1, "tool_calls"), (2, "tool_calls"), (3, "ok")]
    assert [(c["call_id"], c["name"], c["turn"], c["outcome"]) for c in rec["tool_calls"]] \
        == [("answer_1:call_1", "search", 1, "ok"), ("answer_1:call_2", "calculator", 1, "ok"),
            ("answer_1:call_3", "search", 2, "ok")]


@pytest.mark.parametrize(("call", "error"), [
    (("delete_everything", {}), "error: there is no tool 'delete_everything'; the tools "
                                "are: search, calculator"),
    (("search", {"query": 3}), "error: bad arguments for search: query: 3 is not of type "
                               "'string'"),
    (("search", {"query": "x", "k": 0}), "k: 0 is less than the minimum of 1"),
    (("search", {"q": "x"}), "'query' is a required property"),
])
async def test_a_bad_call_gets_its_error_as_the_result_and_the_loop_goes_on(
        client, engine, call, error):
    seen = scripted(engine, tool_calls_text(call), "done")
    async with workflow("agent", base_url=base_url(client)) as wf:
        out = answer("q")
    assert out.value == "done" and CALLED == []  # the app never saw the bad call
    assert error in seen[1].messages[-1].content
    (ct,) = agent_record(wf)["tool_calls"]
    assert ct["outcome"] == "invalid" and error in ct["error"]
    assert len(agent_record(wf)["attempts"]) == 2  # the bad call's turn counted


async def test_max_turns_fails_the_step_naming_it_the_turns_and_the_last_tool(client, engine):
    scripted(engine, tool_calls_text(("search", {"query": "a"})),
             tool_calls_text(("calculator", {"expression": "1"}),
                             ("search", {"query": "b"})))

    @step(tools=[search, calculator], max_turns=2, on_max_turns="raise")
    def short(q):
        return q

    with pytest.raises(WorkflowFailed):
        async with workflow("agent", base_url=base_url(client)):
            out = short("q")
    with pytest.raises(StepFailed, match=r"'short_1'.*after 2 turns.*last tool asked for "
                                         r"was 'search'"):
        _ = out.value
    assert CALLED == [("search", "a")]  # the last turn's calls are not run


async def test_a_tool_call_cut_off_at_max_tokens_is_no_answer(client, engine):
    scripted(engine, tool_calls_text(("search", {"query": "a long query " * 20})))

    @step(tools=[search], max_turns=3, max_tokens=4)
    def cut(q):
        return q

    with pytest.raises(WorkflowFailed):
        async with workflow("agent", base_url=base_url(client)):
            out = cut("q")
    with pytest.raises(StepFailed, match=r"'cut_1'.*turn 1's tool call was cut off at "
                                         r"max_tokens=4"):
        _ = out.value
    assert CALLED == []


async def test_a_tool_that_raises_returns_its_error_to_the_model(client, engine):
    seen = scripted(engine, tool_calls_text(("lookup", {"city": "Atlantis"})), "unknown")

    @step(tools=[lookup])
    def where(q):
        return q

    async with workflow("agent", base_url=base_url(client)) as wf:
        out = where("q")
    assert out.value == "unknown"
    assert "error: ValueError: no such city: Atlantis" in seen[1].messages[-1].content
    assert agent_record(wf, "where_1")["tool_calls"][0]["outcome"] == "error"


async def test_tool_errors_raise_fails_the_step_naming_the_tool(client, engine):
    scripted(engine, tool_calls_text(("lookup", {"city": "Atlantis"})), "never")

    @step(tools=[lookup], tool_errors="raise")
    def where(q):
        return q

    with pytest.raises(WorkflowFailed):
        async with workflow("agent", base_url=base_url(client)):
            out = where("q")
    with pytest.raises(StepFailed, match="tool 'lookup' raised: ValueError: no such city"):
        _ = out.value
    assert len(engine.requests) == 1


async def test_the_deadline_clock_stops_while_tool_calls_are_out(client, engine):
    scripted(engine, tool_calls_text(("slow", {"s": 0.6}), ("slow", {"s": 0.6})), "ok")

    @tool
    async def slow(s: float) -> str:
        await asyncio.sleep(s)
        return "slept"

    @step(tools=[slow])
    def patient(q):
        return q

    async with workflow("agent", base_url=base_url(client), deadline_s=0.4) as wf:
        out = patient("q")
    assert out.value == "ok" and wf.status == "succeeded"
    calls = agent_record(wf, "patient_1")["tool_calls"]
    assert all(c["finished_ms"] - c["wanted_ms"] >= 550 for c in calls)


def _upstream_app(handler):
    return create_app({}, file_config=parse_config({
        "backends": {"up": {"kind": "openai", "base_url": "http://up.invalid/v1"}},
        "models": {"up-model": {"backends": ["up"]}}}),
        transport=httpx.MockTransport(handler))


def _sse(*deltas: dict, finish: str) -> httpx.Response:
    events = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return httpx.Response(200, content=body + b"data: [DONE]\n\n",
                          headers={"content-type": "text/event-stream"})


async def test_an_agent_step_on_an_upstream_model_reads_streamed_tool_calls(aiohttp_client):
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        if len(bodies) == 1:  # two calls, their arguments in pieces
            return _sse({"role": "assistant", "content": None},
                        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                         "function": {"name": "search", "arguments": ""}}]},
                        {"tool_calls": [{"index": 0, "function": {"arguments": '{"que'}}]},
                        {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                         "function": {"name": "calculator",
                                                      "arguments": '{"expression"'}}]},
                        {"tool_calls": [{"index": 0, "function": {"arguments": 'ry": "alpha"}'}}]},
                        {"tool_calls": [{"index": 1, "function": {"arguments": ': "2+3"}'}}]},
                        finish="tool_calls")
        return _sse({"content": "It is "}, {"content": "5."}, finish="stop")

    app = _upstream_app(handler)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()

    @step(model="up-model", tools=[search, calculator])
    def remote(q):
        return q

    async with workflow("agent", base_url=base_url(client)) as wf:
        out = remote("What is 2+3?")
    assert out.value == "It is 5."
    assert sorted(CALLED) == [("calculator", "2+3"), ("search", "alpha")]
    first, second = bodies
    assert [t["function"]["name"] for t in first["tools"]] == ["search", "calculator"]
    assert first["tools"][0]["function"]["parameters"]["required"] == ["query"]
    assert second["messages"][:1] == first["messages"]
    assert second["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "search", "arguments": '{"query": "alpha"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]}
    assert second["messages"][2:] == [
        {"role": "tool", "tool_call_id": "call_a", "content": "hits for alpha: 2"},
        {"role": "tool", "tool_call_id": "call_b", "content": "5.0"}]
    assert [a["outcome"] for a in agent_record(wf, "remote_1")["attempts"]] == [
        "tool_calls", "ok"]


async def test_one_trace_with_a_row_segment_and_span_per_turn_and_tool_call(aiohttp_client):
    with capture_spans() as captured:
        engine = FakeEngine(["fake-model"])
        app = create_app({"fake-model": engine})
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        scripted(engine, tool_calls_text(("search", {"query": "alpha"}),
                                         ("calculator", {"expression": "1"})), "five")
        async with workflow("traced", base_url=base_url(client)) as wf:
            answer("q")
        for _ in range(500):  # the run's spans are built once it closed
            if captured.named("invoke_workflow traced") and any(
                    s.name.startswith("chat ")
                    and s.attributes.get("flowlift.step.id") == "answer_1"
                    for s in captured.spans):
                break
            await asyncio.sleep(0.01)
    rec = agent_record(wf)
    segs = segments(rec)
    turns = [(s.stage, s.note) for s in segs if s.stage in ("prefill", "decode")]
    assert turns == [("prefill", "turn 1"), ("decode", "turn 1"),
                     ("prefill", "turn 2"), ("decode", "turn 2")]
    waits = [s.note for s in segs if s.stage == "tool_wait"]
    assert waits == ["search (turn 1): ok", "calculator (turn 1): ok"]
    assert not [s for s in segs if s.stage == "failed_try"]
    assert rec["stages_ms"]["tool_wait"] > 0
    for stage in ("prefill", "decode"):  # the step's figure is its turns' sum
        assert rec["stages_ms"][stage] == pytest.approx(
            sum(s.ms for s in segs if s.stage == stage)), stage
    chat = next(s for s in captured.spans if s.name.startswith("chat ")
                and s.attributes.get("flowlift.step.id") == "answer_1")
    children = sorted(s.name for s in captured.children(chat))
    assert children == ["execute_tool calculator", "execute_tool search", "queue",
                        "turn 1", "turn 2", "validate"]


async def test_a_resumed_run_does_not_ask_again_for_a_tool_result_in_its_log():
    graph = Graph.model_validate({"nodes": [{
        "kind": "llm", "id": "agent", "messages": [{"role": "user", "content": [
            {"text": "q"}]}], "tools": [tool_spec(search).model_dump()]}]})
    store = RunStore(":memory:")
    store.create("wf-agent", graph.to_wire())
    first_turn = [["call_x", "search", '{"query": "alpha"}'],
                  ["call_y", "search", '{"query": "beta"}']]
    for seq, (name, data) in enumerate([
            ("run.started", {"run_id": "wf-agent", "steps": ["agent"]}),
            ("agent.turn", {"step_id": "agent", "turn": 1, "content": "",
                            "tool_calls": first_turn}),
            ("tool.wanted", {"step_id": "agent:call_1", "name": "search", "args": [],
                             "kwargs": {"query": "alpha"}, "agent_step": "agent"}),
            ("tool.wanted", {"step_id": "agent:call_2", "name": "search", "args": [],
                             "kwargs": {"query": "beta"}, "agent_step": "agent"}),
            ("tool.result", {"step_id": "agent:call_1", "value": "from the log"})], 1):
        store.append("wf-agent", seq, name, data)
    engine = FakeEngine(["m"])
    seen = scripted(engine, "final")
    (run,) = await RunRegistry(store).resume_all(Backends({"m": engine}), CostTracker())
    wanted: list[dict] = []

    async def app() -> None:  # the reconnected SDK: answers what is asked for
        async for _, name, data in run.log.follow(5):
            if name == "tool.wanted":
                wanted.append(data)
                run.deliver_tool_result(data["step_id"], "posted now")
    await asyncio.wait_for(app(), timeout=10)
    assert [w["step_id"] for w in wanted] == ["agent:call_2"]  # call_1 is in the log
    assert run.outputs == {"agent": "final"} and len(seen) == 1  # turn 1 not generated
    assert "from the log" in seen[0].messages[-1].content
    assert "posted now" in seen[0].messages[-1].content
    assert store.load("wf-agent").status == "succeeded"


def test_tool_definitions_come_from_signatures_and_docstrings():
    spec = tool_spec(search)
    assert spec.name == "search" and spec.description == "Search the corpus for a query."
    assert spec.parameters["required"] == ["query"]
    assert spec.parameters["properties"]["k"] == {"default": 2, "description": "hits",
                                                  "minimum": 1, "title": "K",
                                                  "type": "integer"}
    with workflow("rec", submit=False) as wf:
        answer("q")
    node = wf.graph().nodes[0]
    assert isinstance(node, LLMNode) and [t.name for t in node.tools] == ["search",
                                                                           "calculator"]
    wire = wf.graph().to_wire()["nodes"][0]
    assert wire["max_turns"] == 4 and "tool_errors" not in wire  # defaults stay off the wire


def test_a_graph_without_tools_keeps_its_old_wire_form():
    @step
    def plain(q):
        return q

    with workflow("rec", submit=False) as wf:
        plain("q")
    wire = wf.graph().to_wire()["nodes"][0]
    assert not {"tools", "max_turns", "tool_errors"} & set(wire)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tools": [print]}, "takes @tool functions"),
    ({"tools": [search, search]}, "two tools are named 'search'"),
    ({"tools": [search], "max_turns": 0}, "max_turns=0"),
    ({"tools": [search], "tool_errors": "ignore"}, "tool_errors='ignore'"),
])
def test_bad_agent_settings_are_user_errors(kwargs, match):
    with pytest.raises(UserError, match=match):
        step(**kwargs)(lambda q: q)


async def test_sync_workflows_and_eager_calls_run_agent_steps_too(client, engine,
                                                                 monkeypatch):
    @tool
    def double(n: int) -> int:
        """Double a number."""
        CALLED.append(("double", n))
        return 2 * n

    @step(tools=[double])
    def doubler(q):
        return q

    scripted(engine, tool_calls_text(("double", {"n": 21})), "42",
             tool_calls_text(("double", {"n": 1})), "2")

    def run() -> str:
        with workflow("sync-agent", base_url=base_url(client)):
            out = doubler("twice 21")
        return out.value

    assert await asyncio.to_thread(run) == "42"
    assert CALLED == [("double", 21)]
    monkeypatch.setenv("FLOWLIFT_BASE_URL", base_url(client))
    assert await asyncio.to_thread(doubler, "twice 1") == "2"


class Point(BaseModel):
    x: int
    y: int


def test_the_app_gets_arguments_validated_into_the_annotated_types():
    @tool
    def norm(p: Point, scale: float = 1.0) -> float:
        """Manhattan norm."""
        assert isinstance(p, Point)
        return (abs(p.x) + abs(p.y)) * scale

    callables, (spec,) = agent_tools([norm], "step")
    assert spec.parameters["properties"]["p"] == {"$ref": "#/$defs/Point"}
    assert callables["norm"].fn(p={"x": 3, "y": -4}, scale=2) == 14.0


async def test_the_embedded_engines_take_tools_only_as_constrained_json():
    from flowlift.errors import RequestError
    from flowlift.local_engine.base import ChatMessage, ToolDef

    engine = FakeEngine(["m"])
    for request in (GenerationRequest("r1", "m", [ChatMessage("user", "hi")],
                                      tools=(ToolDef("search"),)),
                    GenerationRequest("r2", "m", [ChatMessage("tool", "x", tool_call_id="c")])):
        with pytest.raises(RequestError, match="StepDispatcher"):
            await anext(engine.generate(request))


async def test_tool_choice_required_constrains_every_turn_to_calls(client, engine):
    """OpenAI's ``tool_choice="required"`` on every turn: the engine's schema has no
    ``content`` answer, and the tools are described as to be called now; the loop runs
    its ``max_turns`` turns and fails as a loop that never answers."""
    seen = scripted(engine, *[tool_calls_text(("search", {"query": f"q{i}"}))
                              for i in range(3)])

    @step(tools=[search], max_turns=3, tool_choice="required")
    def forced(q):
        return q

    with pytest.raises(WorkflowFailed):
        async with workflow("agent", base_url=base_url(client)):
            out = forced("q")
    with pytest.raises(StepFailed, match="after 3 turns"):
        _ = out.value
    assert len(seen) == 3 and CALLED == [("search", "q0"), ("search", "q1")]
    for request in seen:
        schema = request.constraint.json_schema
        assert "anyOf" not in schema and schema["required"] == ["tool_calls"]
        assert "Call one or more of these functions now" in request.messages[0].content


def test_tool_choice_is_auto_or_required_with_tools():
    with pytest.raises(UserError, match="tool_choice"):
        step(tool_choice="required")(lambda q: q)
    with pytest.raises(UserError, match="tool_choice"):
        step(tools=[search], tool_choice="any")(lambda q: q)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs tools"):
        LLMNode.model_validate({"id": "a", "name": "a", "tool_choice": "required",
                                "messages": [{"role": "user", "content": [{"text": "q"}]}]})


async def test_tool_choice_required_reaches_an_upstream_model(aiohttp_client):
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return _sse({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                     "function": {"name": "search",
                                                  "arguments": '{"query": "x"}'}}]},
                    finish="tool_calls")

    app = _upstream_app(handler)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()

    @step(model="up-model", tools=[search], max_turns=2, tool_choice="required")
    def remote(q):
        return q

    with pytest.raises(WorkflowFailed):
        async with workflow("agent", base_url=base_url(client)):
            remote("q")
    assert [b["tool_choice"] for b in bodies] == ["required", "required"]
