"""LangGraph on flowlift (issue 25): the triage graph of examples/frameworks (three
nodes and a conditional edge, a fan-out and a join) records its LLM calls as one open
run with dataflow edges; the fan-out's calls overlap on the proxy (measured in the
run's trace), and a step starts when its own inputs are done, not at the end of a
LangGraph superstep. FakeEngine, deterministic."""

from __future__ import annotations

import subprocess
import sys
from typing import Literal, TypedDict

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph

from examples.frameworks import langgraph_graph as example
from flowlift import SemanticVariableError, UserError, workflow
from flowlift.graph import Ref
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import create_app
from flowlift.sdk.langchain import FlowliftChat, areveal, reveal, reveal_state
from flowlift.testing import FakeEngine
from tests.openapi_spec import LiveServers

CAUSES = "Causes: the row limit of the CSV writer and a timeout in the export job."


def _prompt(request: GenerationRequest) -> str:
    return "\n".join(m.content for m in request.messages)


def responder(label: str, seen: list[GenerationRequest]):
    """classify -> ``label``; diagnose -> a long answer (slow: ~60 chunks); the rest echo
    their prompt's last line."""
    def respond(request: GenerationRequest) -> str:
        seen.append(request)
        if request.constraint is not None and request.constraint.choices:
            return label
        prompt = _prompt(request)
        if "most likely causes" in prompt:
            return CAUSES + " More detail." * 10
        return "echo: " + prompt.splitlines()[-1]
    return respond


def _deps(wf) -> dict[str, set[str]]:
    return {n.id: {p.ref for m in n.messages for p in m.content if isinstance(p, Ref)}
            for n in wf.nodes}


@pytest.fixture
def proxy(client, engine, monkeypatch):
    monkeypatch.setenv("FLOWLIFT_BASE_URL", str(client.make_url("")).rstrip("/"))
    engine.delay_s = 0.004
    return engine


async def test_bug_ticket_fans_out_in_one_run_with_dataflow_edges(proxy):
    seen: list[GenerationRequest] = []
    proxy.responder = responder("bug", seen)
    state, wf = await example.triage(example.TICKET)
    assert state["visited"] == ["classify", "diagnose", "draft", "summarize"]
    assert wf.status == "succeeded" and wf.run_id
    # one run: every call is a step of it, named after its LangGraph node
    spans = example.step_spans(wf)
    assert set(spans) == {"classify_1", "diagnose_1", "draft_1", "summarize_1"}
    assert len(seen) == 4
    # dataflow edges from the markers the graph's state carried
    assert _deps(wf) == {"classify_1": set(), "diagnose_1": set(), "draft_1": {"classify_1"},
                         "summarize_1": {"diagnose_1", "draft_1"}}
    # the values reached the later prompts, and the final state holds them
    assert state["label"] == "bug"
    assert state["diagnosis"].startswith(CAUSES)
    assert state["reply"] == "echo: Write a two-sentence reply to the customer."
    summarize_prompt = _prompt(seen[-1])
    assert CAUSES in summarize_prompt and state["reply"] in summarize_prompt
    assert "Category: bug" in _prompt(next(r for r in seen if "two-sentence" in _prompt(r)))
    # the fan-out ran side by side on the proxy; the join after both
    assert example.overlap_ms(spans, "diagnose_1", "draft_1") > 0
    assert spans["summarize_1"][0] >= max(spans["diagnose_1"][1], spans["draft_1"][1])


async def test_question_ticket_takes_the_other_branch(proxy):
    seen: list[GenerationRequest] = []
    proxy.responder = responder("question", seen)
    state, wf = await example.triage("How do I export a report as PDF?")
    assert state["visited"] == ["classify", "draft", "summarize"]
    assert "diagnosis" not in state and len(seen) == 3
    assert "Causes: not investigated" in _prompt(seen[-1])
    assert set(example.step_spans(wf)) == {"classify_1", "draft_1", "summarize_1"}


class Chain(TypedDict, total=False):
    a1: str
    a2: str
    b: str


async def test_a_step_starts_when_its_inputs_are_done_not_at_the_superstep_end(proxy):
    """a1 -> a2 beside a slow b: LangGraph's supersteps would start a2 only after b
    (superstep 2 waits for all of superstep 1); on the proxy a2 starts once a1 is done."""
    proxy.responder = lambda r: ("slow " * 60 if "task b" in _prompt(r) else "quick answer")
    llm = FlowliftChat()

    async def a1(state: Chain) -> Chain:
        return {"a1": str((await llm.ainvoke("task a1")).content)}

    async def a2(state: Chain) -> Chain:
        return {"a2": str((await llm.ainvoke(f"task a2 after {state['a1']}")).content)}

    async def b(state: Chain) -> Chain:
        return {"b": str((await llm.ainvoke("task b")).content)}

    graph = StateGraph(Chain)
    for node in (a1, a2, b):
        graph.add_node(node.__name__, node)
    graph.add_edge(START, "a1")
    graph.add_edge(START, "b")
    graph.add_edge("a1", "a2")
    graph.add_edge("a2", END)
    graph.add_edge("b", END)
    async with workflow("chain") as wf:
        state = await graph.compile().ainvoke({})
    spans = example.step_spans(wf)
    assert _deps(wf)["a2_1"] == {"a1_1"}
    assert spans["a2_1"][0] < spans["b_1"][1], spans  # a2 ran while b was still running
    assert reveal_state(state, wf) == {"a1": "quick answer", "a2": "quick answer",
                                       "b": "slow " * 60}


async def test_outside_a_workflow_a_call_runs_at_once(proxy):
    reply = await FlowliftChat().ainvoke([HumanMessage("hello there")])
    assert isinstance(reply, AIMessage) and reply.content == "echo: hello there"


async def test_a_changed_marker_is_refused_when_recorded(proxy):
    llm = FlowliftChat()
    with pytest.raises(SemanticVariableError, match="case-changed"):
        async with workflow("mangled"):
            first = await llm.ainvoke("first")
            await llm.ainvoke(f"then {str(first.content).upper()}")


async def test_areveal_reads_inside_the_block_and_the_run_goes_on(proxy):
    llm = FlowliftChat(step_name="ask")
    async with workflow("reads") as wf:
        first = await llm.ainvoke("one")
        assert await areveal(first) == "echo: one"  # the run opened here
        second = await llm.ainvoke(f"two after {first.content}")
    assert reveal_state(second, wf).content == "echo: two after echo: one"
    assert [n.id for n in wf.nodes] == ["ask_1", "ask_2"]
    assert len({r.get("run_id") for r in wf.trace if r.get("type") == "step"}) == 1


def test_flowlift_imports_without_langchain():
    code = ("import sys; sys.modules['langchain_core'] = None\n"
            "import flowlift, flowlift.sdk\n"
            "try:\n    import flowlift.sdk.langchain\nexcept ImportError:\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "ok"



async def test_a_value_read_and_passed_on_as_text_still_makes_an_edge(proxy):
    proxy.responder = lambda r: "a long enough answer to quote later: " + r.messages[-1].content
    llm = FlowliftChat(step_name="ask")
    async with workflow("relinked") as wf:
        first = await areveal(await llm.ainvoke("one"))  # plain text now
        second = await llm.ainvoke(f"Given: {first}\nGo on.")
    assert _deps(wf) == {"ask_1": set(), "ask_2": {"ask_1"}}
    assert reveal_state(second, wf).content.endswith(f"Given: {first}\nGo on.")


class Sync(TypedDict, total=False):
    question: str
    label: str
    answer: str


def test_a_sync_graph_in_a_sync_workflow(monkeypatch):
    """``graph.invoke`` in ``with workflow(...)``: the router reads with ``reveal``."""
    engine = FakeEngine(["fake-model"])
    llm = FlowliftChat(output=Literal["short", "long"])
    writer = FlowliftChat()

    def classify(state: Sync) -> Sync:
        return {"label": str(llm.invoke(state["question"]).content)}

    def route(state: Sync) -> str:
        return "answer" if reveal(state["label"]) == "short" else END

    def answer(state: Sync) -> Sync:
        return {"answer": str(writer.invoke(f"{state['label']}: {state['question']}").content)}

    graph = StateGraph(Sync)
    graph.add_node("classify", classify)
    graph.add_node("answer", answer)
    graph.add_edge(START, "classify")
    graph.add_conditional_edges("classify", route, ["answer", END])
    graph.add_edge("answer", END)
    with LiveServers() as servers:
        url = servers.serve(lambda: create_app({"fake-model": engine}))
        monkeypatch.setenv("FLOWLIFT_BASE_URL", url)
        with workflow("sync-graph") as wf:
            state = graph.compile().invoke({"question": "why?"})
    assert reveal_state(state, wf) == {"question": "why?", "label": "short",
                                       "answer": "echo: short: why?"}
    assert _deps(wf) == {"classify_1": set(), "answer_1": {"classify_1"}}


def test_the_example_prints_its_steps_and_the_overlap(monkeypatch, tmp_path, capsys):
    seen: list[GenerationRequest] = []
    engine = FakeEngine(["fake-model"], responder=responder("bug", seen), delay_s=0.004)
    with LiveServers() as servers:
        monkeypatch.setenv("FLOWLIFT_BASE_URL",
                           servers.serve(lambda: create_app({"fake-model": engine})))
        assert example.main(["--trace", str(tmp_path / "t.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "visited: classify -> diagnose -> draft -> summarize" in out
    assert "fan-out diagnose | draft: ran side by side for" in out
    assert "after ['diagnose_1', 'draft_1']" in out and (tmp_path / "t.jsonl").exists()


async def test_per_call_options_and_image_parts_are_refused(proxy):
    llm = FlowliftChat()
    async with workflow("refused"):
        with pytest.raises(UserError, match="per-call options") as info:
            await llm.bind(max_tokens=5).ainvoke("hi")
        assert info.value.param == "max_tokens"
        with pytest.raises(UserError, match="'image_url' part"):
            await llm.ainvoke([HumanMessage(content=[
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}])])
        await llm.ainvoke("fine")  # the block still runs the rest
