"""Identical calls paid once (issue 18 item 2): across the documents of one graph,
through ``@tool(pure=True)`` steps too, so a corpus with repeated documents costs the
engine its distinct documents only. A tool not declared pure is never merged (it may
have side effects), and neither is anything reading it."""

from __future__ import annotations

import asyncio
from typing import Literal

from pydantic import BaseModel

from flowlift import step, tool, workflow
from flowlift.compiler import compile_graph


class Facts(BaseModel):
    name: str
    tags: list[str]


@step(output=Facts)
def extract(doc: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Facts of: {doc}"}]


@step(output=Literal["alpha", "beta"])
def classify(doc: str, facts: Facts) -> str:
    return f"Classify {doc} given {facts}"


CALLS: list[str] = []


@tool(pure=True)
def nearby(facts: Facts, module: str) -> list[str]:
    CALLS.append(module)
    return [module, facts.name]


@tool
def nearby_impure(facts: Facts, module: str) -> list[str]:
    CALLS.append(module)
    return [module, facts.name]


@step(max_tokens=20)
def summarize(doc: str, label: str, rel: list[str]) -> str:
    return f"Summarize {doc} ({label}) next to {rel}"


def _record(docs: list[str], lookup=nearby) -> None:
    for doc in docs:
        facts = extract(doc)
        summarize(doc, classify(doc, facts), lookup(facts, doc))


def _merged(docs: list[str], lookup=nearby) -> dict[str, str]:
    with workflow("dups", submit=False) as wf:
        _record(docs, lookup)
    return compile_graph(wf.graph()).merged_into


def test_a_repeated_document_merges_every_step_through_a_pure_tool():
    merged = _merged(["a", "b", "a"])
    assert merged == {"extract_3": "extract_1", "classify_3": "classify_1",
                      "nearby_3": "nearby_1", "summarize_3": "summarize_1"}


def test_an_impure_tool_and_what_reads_it_are_never_merged():
    merged = _merged(["a", "b", "a"], nearby_impure)
    assert merged == {"extract_3": "extract_1", "classify_3": "classify_1"}


def test_pure_tool_calls_with_other_arguments_are_not_merged():
    with workflow("args", submit=False) as wf:
        facts = extract("a")
        nearby(facts, "x")
        nearby(facts, "y")
        nearby(facts, module="x")  # by name: another call shape, kept apart
        nearby(facts, "x")
    assert compile_graph(wf.graph()).merged_into == {"nearby_4": "nearby_1"}


def test_the_pure_flag_is_on_the_wire():
    with workflow("wire", submit=False) as wf:
        nearby(extract("a"), "a")
        nearby_impure(extract("b"), "b")
    tools = [n for n in wf.graph().to_wire()["nodes"] if n["kind"] == "tool"]
    assert [t["pure"] for t in tools] == [True, False]


async def test_repeats_cost_the_engine_nothing_and_the_tool_runs_once(client, engine):
    base = str(client.make_url("")).rstrip("/")
    CALLS.clear()

    def run():
        with workflow("dups", base_url=base, workflow_class="batch") as wf:
            outs = []
            for doc in ["a", "b", "a", "a", "c", "b"]:
                facts = extract(doc)
                outs.append(summarize(doc, classify(doc, facts), nearby(facts, doc)))
        return wf, outs

    wf, outs = await asyncio.to_thread(run)
    assert wf.status == "succeeded", wf.failures
    assert sorted(CALLS) == ["a", "b", "c"]  # the app ran each distinct call once
    assert len(engine.requests) == 3 * 3  # 3 distinct documents x 3 llm steps
    assert outs[2].value == outs[0].value and outs[5].value == outs[1].value
    merged = [r for r in wf.trace if r.get("same_as")]
    assert len(merged) == 3 * 4  # 3 repeats x (extract, classify, nearby, summarize)
    assert all(r.get("prompt_tokens", 0) == 0 for r in merged)  # no tokens counted
