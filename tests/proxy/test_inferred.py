"""Workflows inferred from plain OpenAI traffic: ids, edges by containment, bounds,
measured facts (pure: no proxy, no engine)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlift.compiler import CompileOptions, compile_graph
from flowlift.dataflow import dependencies, validate
from flowlift.errors import RequestError
from flowlift.graph import Graph, Ref, Text
from flowlift.proxy.wire.messages import render_message
from flowlift.proxy.workflows.inferred import InferredWorkflows, workflow_from
from flowlift.report import CompileReport

PREAMBLE = ("You are a precise assistant for the Python standard library documentation. "
            "Answer briefly, in plain English, and never invent module names. ") * 3
DOC = "The json module encodes and decodes JSON documents; dumps turns objects into text."
FACTS = '{"purpose": "encode and decode JSON documents", "key_terms": ["json", "dumps"]}'
LABEL = "The area is data formats and serialization."


def compile_report(graph: Graph) -> dict:
    """What POST /v1/workflows:compile answers for ``graph`` (default cost models)."""
    return compile_graph(graph, CompileOptions()).report.model_dump(mode="json")


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def system(text: str = PREAMBLE) -> dict:
    return {"role": "system", "content": text}


def rec(store: InferredWorkflows, output: str, *messages: dict, at: tuple[float, float],
        step: str | None = None, wid: str = "wf", prompt: str | None = None, **kw) -> str:
    step_id = store.record(wid, step=step, model=kw.pop("model", "m"),
                           messages=list(messages) or None, prompt=prompt, output=output,
                           usage=kw.pop("usage", None), started_at=at[0], finished_at=at[1],
                           backend=kw.pop("backend", "embedded"), **kw)
    assert step_id is not None
    return step_id


def deps_of(store: InferredWorkflows, wid: str = "wf") -> dict[str, list[str]]:
    graph = store.graph(wid)
    assert graph is not None
    validate(graph)
    return {k: sorted(v) for k, v in dependencies(graph).items()}


def chain(store: InferredWorkflows, wid: str = "wf") -> None:
    rec(store, FACTS, system(), user(f"Documentation:\n{DOC}\nWhat is it for?"),
        step="extract", wid=wid, at=(0.0, 1.0))
    rec(store, LABEL, user(f"Which area? Facts: {FACTS}"), step="classify", wid=wid,
        at=(1.01, 1.5))
    rec(store, "Encodes JSON.", system(),
        user(f"Facts: {FACTS}\nArea: {LABEL}\nOne sentence:"), step="summarize", wid=wid,
        at=(1.52, 2.0))


# --- edges -------------------------------------------------------------------------------

def test_extract_classify_summarize_chain_gives_the_right_edges():
    store = InferredWorkflows()
    chain(store)
    assert deps_of(store) == {"extract": [], "classify": ["extract"],
                              "summarize": ["classify", "extract"]}
    graph = store.graph("wf")
    summarize = graph.node_map()["summarize"]
    assert summarize.messages[1].content == (
        Text(text="Facts: "), Ref(ref="extract"), Text(text="\nArea: "), Ref(ref="classify"),
        Text(text="\nOne sentence:"))
    assert summarize.model == "m" and summarize.name == "summarize"


def test_output_appearing_twice_gives_one_edge_and_two_refs():
    store = InferredWorkflows()
    rec(store, FACTS, user("extract"), at=(0, 1))
    rec(store, "ok", user(f"A: {FACTS}\nagain A: {FACTS}"), at=(2, 3))
    assert deps_of(store) == {"call-1": [], "call-2": ["call-1"]}
    content = store.graph("wf").node_map()["call-2"].messages[0].content
    assert content.count(Ref(ref="call-1")) == 2
    steps = store.describe("wf", compile_report)["steps"]
    assert steps[1]["depends_on"] == ["call-1"]


def test_short_outputs_do_not_create_spurious_edges():
    store = InferredWorkflows()
    rec(store, "yes", user("Is JSON a data format?"), at=(0, 1))
    rec(store, "data formats", user("Name an area."), at=(0, 1))
    rec(store, "fine", user("Answer yes or no: is XML one of the data formats we use?"),
        at=(2, 3))
    assert deps_of(store)["call-3"] == []


def test_short_output_quoted_as_a_whole_message_is_a_chat_continuation():
    store = InferredWorkflows()
    rec(store, " Paris.\n", user("Capital of France?"), at=(0, 1))
    rec(store, "About 2 million.", user("Capital of France?"),
        {"role": "assistant", "content": "Paris."}, user("Population?"), at=(2, 3))
    assert deps_of(store)["call-2"] == ["call-1"]


def test_no_edge_to_a_call_that_finished_after_this_one_started():
    store = InferredWorkflows()
    rec(store, FACTS, user("extract"), at=(0.0, 2.0))
    # started while call-1 was still running: cannot have read its output
    rec(store, "x", user(f"Facts: {FACTS}"), at=(1.0, 3.0))
    # a later call with the same prompt can
    rec(store, "y", user(f"Facts: {FACTS}"), at=(3.5, 4.0))
    assert deps_of(store) == {"call-1": [], "call-2": [], "call-3": ["call-1"]}


def test_a_call_never_references_itself_or_a_later_call():
    store = InferredWorkflows()
    rec(store, FACTS, user(f"Repeat: {FACTS}"), at=(0, 1))
    rec(store, "z", user("unrelated"), at=(2, 3))
    assert deps_of(store) == {"call-1": [], "call-2": []}


INNER = "the quick brown fox jumps over the lazy dog"
OUTER = f"Yesterday {INNER} twice, then slept."
BLOB = "x" * 30  # one long word: no anchor, found by str.find


@pytest.mark.parametrize(("outputs", "prompt", "expected"), [
    # the longest output wins where two overlap
    ([(INNER, (0, 1)), (OUTER, (0, 1))], f"Story: {OUTER}", ["call-2"]),
    # the same text from two calls: the most recent call that finished in time
    ([(FACTS, (0, 1)), (FACTS, (1, 2))], f"Facts: {FACTS}", ["call-2"]),
    ([(FACTS, (0, 1)), (FACTS, (1, 3.5))], f"Facts: {FACTS}", ["call-1"]),
    # an output quoted stripped of whitespace, and one with no word anchor
    ([(f"\n  {FACTS}  \n", (0, 1)), (BLOB, (0, 1))], f"F={FACTS};B={BLOB}",
     ["call-1", "call-2"]),
])
def test_which_earlier_call_a_quoted_text_refers_to(outputs, prompt, expected):
    store = InferredWorkflows()
    for k, (output, at) in enumerate(outputs):
        rec(store, output, user(f"input {k}"), at=at)
    rec(store, "done", user(prompt), at=(3, 4))
    assert deps_of(store)[f"call-{len(outputs) + 1}"] == expected


def test_completions_prompt_and_message_parts_render_the_same_way():
    store = InferredWorkflows()
    rec(store, FACTS, prompt=f"Doc: {DOC}", at=(0, 1))
    rec(store, "ok", {"role": "user", "content": [
        {"type": "text", "text": "Facts: "}, {"type": "text", "text": FACTS},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
        {"role": "assistant", "content": None}, at=(2, 3))
    graph = store.graph("wf")
    node = graph.node_map()["call-2"]
    assert node.messages[0].content == (Text(text="Facts: "), Ref(ref="call-1"),
                                        Text(text="[image_url]"))
    assert node.messages[1].content == (Text(text=""),)
    assert graph.node_map()["call-1"].messages[0].role == "user"


def test_agent_loop_tool_calls_chain_through_render_message():
    store = InferredWorkflows()
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "lookup", "arguments": '{"q": "json"}'}}]}
    assert render_message(reply) == ("assistant", '[tool call lookup: {"q": "json"}]')
    assert render_message({"role": "developer", "content": "d"}) == ("system", "d")
    assert render_message({"role": "tool", "content": "r"}) == ("user", "r")
    history = [system(), user("What does json do?")]
    rec(store, render_message(reply)[1], *history, at=(0, 1))
    history += [reply, {"role": "tool", "tool_call_id": "c1", "content": DOC}]
    rec(store, "It encodes JSON.", *history, at=(1.5, 2))
    assert deps_of(store)["call-2"] == ["call-1"]


# --- describe: report and measured facts --------------------------------------------------

def test_describe_has_the_compile_report_graph_and_steps():
    store = InferredWorkflows()
    chain(store)
    out = store.describe("wf", compile_report)
    assert out["object"] == "workflow.inferred" and out["id"] == "wf"
    assert out["truncated"] is False and out["dropped_calls"] == 0
    report = CompileReport.model_validate(out["report"])
    assert report.critical_path == ["extract", "classify", "summarize"]
    assert Graph.model_validate(out["graph"]).node_map().keys() == {
        "extract", "classify", "summarize"}
    step = out["steps"][2]
    assert step["id"] == "summarize" and step["depends_on"] == ["extract", "classify"]
    assert step["latency_ms"] == 480.0 and step["backend"] == "embedded"
    assert step["started_at"] == 1.52 and step["ran_after"] is None
    observed = out["observed"]
    assert observed["makespan_ms"] == 2000.0
    assert observed["dependency_chain"] == ["extract", "classify", "summarize"]
    assert observed["parallelizable"] == [] and observed["parallelizable_steps"] == 0
    assert store.describe("nope", compile_report) is None and store.graph("nope") is None


def test_two_steps_sharing_a_long_system_preamble_form_one_prefix_group():
    store = InferredWorkflows()
    rec(store, "a1", system(), user("Classify: csv"), at=(0, 1))
    rec(store, "a2", system(), user("Classify: zlib"), at=(0, 1))
    rec(store, "a3", user("Something else entirely"), at=(0, 1))
    groups = store.describe("wf", compile_report)["report"]["prefix_groups"]
    assert len(groups) == 1
    assert sorted(groups[0]["members"]) == ["call-1", "call-2"]
    assert groups[0]["shared_tokens"] >= 16


def test_independent_steps_run_one_after_another_are_reported_parallelizable():
    store = InferredWorkflows()
    for k in range(3):  # the app awaited each call before sending the next
        rec(store, f"label {k}", user(f"Classify document number {k}"),
            at=(k * 1.0 + 0.01 * k, k * 1.0 + 0.01 * k + 1.0))
    out = store.describe("wf", compile_report)
    observed = out["observed"]
    assert observed["parallelizable_steps"] == 2
    assert {(p["step"], p["after"]) for p in observed["parallelizable"]} == {
        ("call-2", "call-1"), ("call-3", "call-2")}
    assert observed["makespan_ms"] == 3020.0 and observed["dependency_bound_ms"] == 1000.0
    assert observed["possible_saving_ms"] == 2020.0
    assert observed["concurrency"] == round(3000 / 3020, 2)
    assert out["steps"][2]["waited_ms"] == 2020.0 and out["steps"][2]["ran_after"] == "call-2"
    assert out["report"]["levels"] == 1  # the compiler agrees: one parallel level


def test_concurrent_independent_steps_are_not_reported():
    store = InferredWorkflows()
    for k in range(3):
        rec(store, f"label {k}", user(f"Classify document number {k}"), at=(0.0, 1.0 + k))
    observed = store.describe("wf", compile_report)["observed"]
    assert observed["parallelizable"] == [] and observed["concurrency"] == 2.0


# --- ids, names, bounds ------------------------------------------------------------------

def test_step_ids_unnamed_repeated_and_colliding_names():
    store = InferredWorkflows()
    ids = [rec(store, "o", user("p"), at=(0, 1), step=s)
           for s in (None, "extract", "extract", None, "call-3", None, "extract#3", "extract")]
    assert ids == ["call-1", "extract", "extract#2", "call-2", "call-3", "call-4",
                   "extract#3", "extract#4"]


def test_max_steps_truncates_and_records_nothing_more():
    store = InferredWorkflows(max_steps=2)
    rec(store, FACTS, user("a"), at=(0, 1))
    rec(store, "b", user("b"), at=(1, 2))
    assert store.record("wf", step=None, model="m", messages=[user(FACTS)], prompt=None,
                        output="c", usage=None, started_at=2, finished_at=3,
                        backend=None) is None
    out = store.describe("wf", compile_report)
    assert out["truncated"] is True and out["dropped_calls"] == 1
    assert [s["id"] for s in out["steps"]] == ["call-1", "call-2"]
    assert out["graph"]["metadata"] == {"inferred": True, "truncated": True}


def test_max_chars_bounds_the_text_as_sent_history_included():
    per_call = len(PREAMBLE) + 32 + len("q0") + 32 + len("o0")  # texts + 32 per message
    store = InferredWorkflows(max_chars=5 * per_call + 1)
    ids = [store.record("wf", step=None, model="m", messages=[system(), user(f"q{k}")],
                        prompt=None, output=f"o{k}", usage=None, started_at=k,
                        finished_at=k + 0.5, backend=None) for k in range(9)]
    assert ids == ["call-1", "call-2", "call-3", "call-4", "call-5", None, None, None, None]
    out = store.describe("wf", compile_report)
    assert out["truncated"] is True and out["dropped_calls"] == 4


def test_a_long_agent_conversation_chains_every_turn():
    store = InferredWorkflows()
    history = [system()]
    for k in range(100):
        history.append(user(f"Turn {k}: look up item {k}."))
        reply = f"Item {k} is an entry with these properties: " + "abc " * 40
        rec(store, reply, *history, at=(float(k), k + 0.5))
        history.append({"role": "assistant", "content": reply})
    deps = deps_of(store)
    assert deps["call-100"] == sorted(f"call-{k}" for k in range(1, 100))
    observed = store.describe("wf", lambda graph: {})["observed"]
    assert observed["parallelizable"] == []
    assert len(observed["dependency_chain"]) == 100


def test_max_workflows_and_ttl_bound_the_store():
    now = [0.0]
    store = InferredWorkflows(max_workflows=2, ttl_s=60, timer=lambda: now[0])
    for wid in ("a", "b", "c"):
        rec(store, "o", user("p"), wid=wid, at=(0, 1))
    assert len(store) == 2 and "a" not in store and "c" in store
    now[0] = 50.0
    rec(store, "o", user("p"), wid="c", at=(2, 3))  # activity refreshes the TTL
    now[0] = 100.0
    assert "b" not in store and "c" in store
    assert [s["id"] for s in store.describe("c", compile_report)["steps"]] == ["call-1",
                                                                             "call-2"]


def test_sampling_and_usage_feed_the_graph_params():
    store = InferredWorkflows()
    rec(store, "o", user("p"), at=(0, 1), usage={"prompt_tokens": 3, "completion_tokens": 7},
        sampling={"temperature": 0, "stop": "\n", "seed": 3, "messages": []})
    rec(store, "o", user("p"), at=(0, 1), sampling={"temperature": 9})  # invalid: defaults
    nodes = store.graph("wf").nodes
    assert (nodes[0].params.max_tokens, nodes[0].params.temperature,
            nodes[0].params.stop, nodes[0].params.seed) == (7, 0.0, ("\n",), 3)
    assert nodes[1].params.temperature == 1.0 and nodes[1].params.max_tokens == 1


# --- workflow ids from requests -----------------------------------------------------------

def test_workflow_from_header_metadata_and_neither():
    assert workflow_from({"X-Flowlift-Workflow": "run-1"}, {}) == ("run-1", None)
    assert workflow_from({"x-flowlift-workflow": "run-1", "x-flowlift-step": "extract"},
                         {"model": "m"}) == ("run-1", "extract")
    body = {"metadata": {"flowlift_workflow": "run-2", "flowlift_step": "s", "other": "x"}}
    assert workflow_from({}, body) == ("run-2", "s")
    assert workflow_from({"X-Flowlift-Workflow": "run-2"}, body) == ("run-2", "s")
    assert workflow_from({}, {"metadata": {"user": "x"}}) is None
    assert workflow_from({}, {"metadata": None}) is None
    assert workflow_from({}, ["not", "a", "dict"]) is None


@pytest.mark.parametrize(("headers", "body", "param"), [
    ({"X-Flowlift-Workflow": ""}, {}, "X-Flowlift-Workflow"),
    ({"X-Flowlift-Workflow": "has space"}, {}, "X-Flowlift-Workflow"),
    ({"X-Flowlift-Workflow": "x" * 129}, {}, "X-Flowlift-Workflow"),
    ({"X-Flowlift-Workflow": "caf\u00e9"}, {}, "X-Flowlift-Workflow"),
    ({"X-Flowlift-Workflow": "tab\there"}, {}, "X-Flowlift-Workflow"),
    ({}, {"metadata": {"flowlift_workflow": 42}}, "metadata.flowlift_workflow"),
    ({}, {"metadata": {"flowlift_workflow": "a b"}}, "metadata.flowlift_workflow"),
    ({"X-Flowlift-Workflow": "w", "X-Flowlift-Step": "bad step"}, {}, "X-Flowlift-Step"),
    ({"X-Flowlift-Workflow": "a"}, {"metadata": {"flowlift_workflow": "b"}},
     "metadata.flowlift_workflow"),
    ({"X-Flowlift-Step": "s"}, {}, "X-Flowlift-Step"),
    ({}, {"metadata": {"flowlift_step": "s"}}, "metadata.flowlift_step"),
])
def test_bad_workflow_ids_name_the_param_and_the_fix(headers, body, param):
    with pytest.raises(RequestError) as info:
        workflow_from(headers, body)
    assert info.value.param == param
    assert param in info.value.message
    assert info.value.to_openai()["error"]["param"] == param
    assert any(w in info.value.message for w in ("use an id", "add the", "send one"))


def test_longest_valid_id_is_accepted():
    assert workflow_from({"X-Flowlift-Workflow": "a" * 128}, {}) == ("a" * 128, None)


# --- scale and a property ------------------------------------------------------------------

def test_a_2000_step_workflow_builds_and_compiles():
    store = InferredWorkflows()
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    for k in range(1000):  # extract_k, then summarize_k reading it (and a shared preamble)
        doc = " ".join(rng.choices(words, k=150))
        out = f"Facts {k}: " + " ".join(rng.choices(words, k=60))
        rec(store, out, system(), user(f"Doc {k}:\n{doc}"), step="extract",
            at=(2.0 * k, 2.0 * k + 1))
        rec(store, f"Summary {k}.", system(), user(f"Facts: {out}\nSummarize."),
            step="summarize", at=(2.0 * k + 1.01, 2.0 * k + 1.9))
    out = store.describe("wf", compile_report)
    validate(Graph.model_validate(out["graph"]))
    deps = {step["id"]: step["depends_on"] for step in out["steps"]}
    assert len(deps) == 2000 and out["report"]["steps"] == 2000
    assert deps["summarize#1000"] == ["extract#1000"] and deps["extract#1000"] == []
    assert sum(len(v) for v in deps.values()) == 1000
    assert out["observed"]["parallelizable_steps"] == 999  # each extract after a summarize


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sets(st.integers(min_value=0, max_value=30), max_size=3),
                min_size=1, max_size=12))
def test_inferred_edges_are_exactly_the_quoted_outputs(picks):
    store = InferredWorkflows()
    truth: dict[str, list[str]] = {}
    outputs: list[str] = []
    for j, pick in enumerate(picks):
        sources = sorted({p % j for p in pick}) if j else []
        quoted = " | ".join(f"<{outputs[i]}>" for i in sources)
        step = rec(store, f"result number {j} of the run, value {j * 7919}",
                   user(f"Step {j}. Inputs: {quoted}."), at=(float(j), j + 0.5))
        outputs.append(f"result number {j} of the run, value {j * 7919}")
        truth[step] = [f"call-{i + 1}" for i in sources]
    got = deps_of(store)
    assert got == {k: sorted(v) for k, v in truth.items()}
