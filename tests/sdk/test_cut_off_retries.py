"""A retry after an output was cut off at ``max_tokens`` changes what cut it (issue 15,
item 5): it doubles the budget up to the step's ceiling, or the error says the budget
is too small; the compiler warns when a contract's output cannot fit ``max_tokens``."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from flowlift import step, workflow
from flowlift.compiler import compile_graph
from flowlift.graph import Graph, Params
from flowlift.testing import FakeEngine, cut
from tests.sdk.test_contract_retries import llm, proxy, run

LIST = {"type": "object", "properties": {"items": {"type": "array",
                                                   "items": {"type": "integer"}}},
        "required": ["items"]}
LONG = json.dumps({"items": list(range(12))})  # 13 fake tokens (words)


def _budgets(engine: FakeEngine) -> list[int | None]:
    return [r.sampling.max_tokens for r in engine.requests]


async def test_a_cut_off_json_output_is_retried_with_a_larger_budget(aiohttp_client):
    engine = FakeEngine(["m"], responder=lambda req: LONG)
    client = await proxy(aiohttp_client, {"m": engine})
    done, failed, steps = await run(client, llm(
        "s", "list", contract={"json_schema": LIST}, retries=2,
        params={"max_tokens": 4, "max_tokens_ceiling": 16}))
    assert not failed and done["s"] == {"items": list(range(12))}
    assert _budgets(engine) == [4, 8, 16], "each retry doubles the budget, to the ceiling"
    attempts = steps["s"]["attempts"]
    assert [a["finish_reason"] for a in attempts] == ["length", "length", "stop"]
    assert "retried with max_tokens=8" in attempts[0]["error"]
    retry = engine.requests[1]
    assert retry.messages == engine.requests[0].messages, "same question, more room"


async def test_no_room_left_fails_at_once_saying_the_budget_is_too_small(aiohttp_client):
    engine = FakeEngine(["m"], responder=lambda req: LONG)
    client = await proxy(aiohttp_client, {"m": engine})
    _, failed, _ = await run(client, llm(
        "s", "list", contract={"json_schema": LIST}, retries=5,
        params={"max_tokens": 4, "max_tokens_ceiling": 6}))
    assert _budgets(engine) == [4, 6], "no third try with the same budget"
    assert "cut off at max_tokens=6" in failed["s"]
    assert "max_tokens_ceiling=6 leaves no room" in failed["s"]
    assert "budget is too small" in failed["s"]


async def test_without_retries_the_error_says_what_would_help(aiohttp_client):
    engine = FakeEngine(["m"], responder=lambda req: LONG)
    client = await proxy(aiohttp_client, {"m": engine})
    _, failed, _ = await run(client, llm("s", "list", contract={"json_schema": LIST},
                                         params={"max_tokens": 4}))
    assert _budgets(engine) == [4]
    assert "cut off at max_tokens=4" in failed["s"] and "retries >= 1" in failed["s"]
    assert "max_tokens=8 (ceiling 8)" in failed["s"], "default ceiling: twice max_tokens"


def test_the_ceiling_is_declared_on_the_step_and_checked():
    @step(output=None, max_tokens=64, max_tokens_ceiling=300)
    def s(x):
        return f"{x}"

    with workflow("w", submit=False) as wf:
        s("a")
    params = wf.graph().nodes[0].params
    assert params.max_tokens_ceiling == 300 and params.ceiling() == 300
    assert Params(max_tokens=64).ceiling() == 128
    assert Params(max_tokens=30000).ceiling() == 32768
    assert "max_tokens_ceiling" not in Params(max_tokens=64).model_dump(mode="json")
    with pytest.raises(ValueError, match="max_tokens_ceiling"):
        Params(max_tokens=64, max_tokens_ceiling=10)


def test_the_fake_engine_cuts_like_an_engine():
    assert cut("a b c d", (), 2) == ("a b", "length")
    assert cut("a b STOP c d", ("STOP",), None) == ("a b ", "stop")
    assert cut("a b c STOP d", ("X", "STOP"), 2) == ("a b", "length")
    assert cut("a b", ("",), 5) == ("a b", "stop")


# -- the compiler's warnings -------------------------------------------------------------
class Ticket(BaseModel):
    title: str = Field(max_length=400)
    tags: list[str] = Field(max_length=10)
    priority: int


def _warnings(max_tokens, schema, **params):
    graph = Graph.model_validate({"nodes": [llm("s", "x", contract={"json_schema": schema},
                                                params={"max_tokens": max_tokens,
                                                        **params})]})
    return compile_graph(graph).report.warnings


def test_the_compiler_warns_when_the_largest_valid_output_cannot_fit():
    schema = Ticket.model_json_schema()
    warned = _warnings(32, schema)
    assert len(warned) == 1 and "step 's'" in warned[0]
    assert "largest valid output" in warned[0] and "max_tokens=32" in warned[0]
    assert "tags[]: no maxLength" in warned[0], "the unbounded field is named"
    assert not _warnings(4000, {**schema, "properties": {
        **schema["properties"], "tags": {"type": "array", "maxItems": 3,
                                         "items": {"type": "string", "maxLength": 20}}}})


def test_the_compiler_warns_when_even_the_smallest_output_cannot_fit():
    schema = {"type": "object", "required": ["a", "b", "c"], "properties": {
        k: {"type": "string", "minLength": 200} for k in "abc"}}
    warned = _warnings(16, schema)
    assert warned and "smallest valid output" in warned[0] and "every answer" in warned[0]


def test_labels_and_unbounded_outputs_are_warned_only_when_relevant():
    graph = Graph.model_validate({"nodes": [
        llm("l", "x", contract={"choices": ["a " * 30, "b"]}, params={"max_tokens": 4}),
        llm("free", "x", contract={"json_schema": {"type": "string"}},
            params={"max_tokens": 64}),
        llm("text", "x", params={"max_tokens": 1})]})
    warned = compile_graph(graph).report.warnings
    assert len(warned) == 1 and "step 'l'" in warned[0] and "label" in warned[0]


async def test_the_sdk_warns_at_submission_when_an_output_cannot_fit(client):
    from flowlift.errors import PlanWarning

    @step(output=Ticket, max_tokens=32, retries=0)
    def ticket(text):
        return f"File a ticket: {text}"

    @step(output=Ticket, max_tokens=4000)
    def roomy(text):
        return f"File a ticket: {text}"

    base = str(client.make_url("")).rstrip("/")
    with pytest.warns(PlanWarning, match=r"workflow 'tickets': step 'ticket_1': the "
                                         r"largest valid output") as caught:
        async with workflow("tickets", base_url=base):
            ticket("printer on fire")
            roomy("printer on fire")
    assert len([w for w in caught if w.category is PlanWarning]) == 1


def test_patterns_and_formats_bound_strings_and_regex_contracts_are_checked():
    from flowlift.compiler import approximate_tokenize
    from flowlift.output_size import pattern_width, schema_size

    def count(text):
        return len(approximate_tokenize("m", text))

    assert pattern_width("^[a-z][a-z0-9 ]{1,20}[a-z0-9]$") == (3, 22)
    assert pattern_width(r"\d+") == (1, None) and pattern_width("(") == (0, None)
    size = schema_size({"type": "object", "required": ["t", "d"], "properties": {
        "t": {"type": "string", "pattern": "^[a-z]{4,40}$"},
        "d": {"type": "string", "format": "date"}}}, count)
    assert size.unbounded == () and size.largest_tokens > size.smallest_tokens
    graph = Graph.model_validate({"nodes": [
        llm("r", "x", contract={"regex": "[a-z ]{400}"}, params={"max_tokens": 16}),
        llm("ok", "x", contract={"regex": "[a-z]{3}-\\d{2}"}, params={"max_tokens": 16})]})
    warned = compile_graph(graph).report.warnings
    assert len(warned) == 1 and "step 'r'" in warned[0] and "shortest match" in warned[0]


async def test_the_fake_engine_honours_stop_strings():
    from flowlift.local_engine.base import ChatMessage, GenerationRequest, SamplingOptions

    engine = FakeEngine(["m"], responder=lambda req: "first line\nsecond line")
    request = GenerationRequest(request_id="r", model="m",
                                messages=[ChatMessage("user", "x")],
                                sampling=SamplingOptions(max_tokens=50, stop=("\n",)))
    chunks = [c async for c in engine.generate(request)]
    assert "".join(c.text for c in chunks) == "first line"
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 2
