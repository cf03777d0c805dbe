"""Output contracts (regex included), cheap single-step retries with the validation
error fed back (case T3), contracts on backends without native structured output
(case W3), typed errors no retry can change."""

from __future__ import annotations

import json
import re

import pytest

from flowlift import Regex, step, workflow
from flowlift.dataflow import validate
from flowlift.errors import (
    ContentRefused,
    ContextLengthExceeded,
    ContractError,
    GraphError,
    UpstreamError,
    UserError,
)
from flowlift.graph import Contract, Graph
from flowlift.local_engine.base import GenerationRequest, OutputConstraint
from flowlift.proxy import create_app
from flowlift.proxy.dispatch.upstream.engine import chat_body
from flowlift.proxy.dispatch.upstream.provider import unretryable
from flowlift.proxy.state import STATE
from flowlift.proxy.workflows.contracts import check_output
from flowlift.testing import FakeEngine, default_responder, parse_sse

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def llm(node_id, text, **extra):
    return {"kind": "llm", "id": node_id, "name": node_id.rstrip("0123456789_"),
            "messages": [{"role": "user", "content": [{"text": text}]}], **extra}


async def proxy(aiohttp_client, engines):
    app = create_app(engines)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def run(client, *nodes):
    """Run ``nodes`` as one graph: (outputs, failures, trace step records) by step id."""
    resp = await client.post("/v1/workflows", json={"nodes": list(nodes)})
    assert resp.status == 200, await resp.text()
    events = parse_sse(await resp.text())
    done = {d["step_id"]: d["value"] for e, d in events if e == "step.finished"}
    failed = {d["step_id"]: d["error"] for e, d in events if e == "step.failed"}
    steps = {r["step_id"]: r for r in events[-1][1]["trace"] if r["type"] == "step"}
    return done, failed, steps


def scripted(*answers):
    """A responder that answers with ``answers`` in order (the last one repeats)."""
    seen: list[GenerationRequest] = []

    def respond(request):
        seen.append(request)
        return answers[min(len(seen), len(answers)) - 1]

    respond.seen = seen  # type: ignore[attr-defined]
    return respond


# -- regex contracts ---------------------------------------------------------------------

def test_sdk_regex_outputs_become_regex_contracts():
    @step(output=re.compile(r"[A-Z]{3}-\d{2}"))
    def code(x):
        return f"code for {x}"

    @step(output=Regex(r"yes|no"), retries=2)
    def answer(x):
        return f"{x}?"

    with workflow("r", submit=False) as wf:
        answer(code("a"))
    nodes = wf.graph().node_map()
    assert nodes["code_1"].contract == Contract(regex=r"[A-Z]{3}-\d{2}")
    assert nodes["answer_1"].contract.regex == "yes|no" and nodes["answer_1"].retries == 2
    with pytest.raises(UserError, match="inline"):
        step(output=re.compile("yes", re.IGNORECASE))
    with pytest.raises(UserError, match="does not compile"):
        Regex("([a-z")


def test_a_regex_contract_that_does_not_compile_is_a_graph_error():
    graph = Graph.model_validate({"nodes": [llm("a", "x", contract={"regex": "([a-z"})]})
    with pytest.raises(GraphError, match="invalid regex contract"):
        validate(graph)
    with pytest.raises(ValueError, match="exactly one of json_schema, choices or regex"):
        Contract(regex="a", choices=("a",))


@pytest.mark.parametrize(("pattern", "what"), [(r"(ab)\1", "a backreference"),
                                               (r"(?=a)\w+", "look-ahead"),
                                               (r"(?:(?!q).)*", "negative look-around")])
def test_a_regex_decoding_cannot_follow_is_a_graph_error(pattern, what):
    graph = Graph.model_validate({"nodes": [llm("a", "x", contract={"regex": pattern})]})
    with pytest.raises(GraphError, match=what):
        validate(graph)
    validate(Graph.model_validate({"nodes": [llm("a", "x", contract={
        "regex": r"[A-Z]{3}-\d{2,4}( \(urgent\))?"})]}))  # regular: fine


def test_the_fake_engine_honours_a_regex_constraint():
    for pattern in (r"[A-Z]{3}-\d{2}", r"(yes|no)", r"\w+@\w+\.com", r"v\d+\.\d+"):
        text = default_responder(GenerationRequest(
            "r", "m", constraint=OutputConstraint(regex=pattern)))
        assert re.fullmatch(pattern, text), (pattern, text)


def test_regex_check_is_a_whole_match_and_the_error_names_step_model_attempt():
    contract = Contract(regex=r"\d{3}")
    assert check_output(contract, "123") == "123"
    with pytest.raises(ContractError) as err:
        check_output(contract, "1234", step_id="s_1", model="small", attempt=2)
    e = err.value
    assert (e.step_id, e.model, e.attempt) == ("s_1", "small", 2) and e.errors
    assert "'s_1'" in e.message and "'small'" in e.message and "attempt 2" in e.message


async def test_a_regex_step_runs_constrained_on_the_fake_engine(aiohttp_client):
    engine = FakeEngine(["m"])
    client = await proxy(aiohttp_client, {"m": engine})
    done, failed, _ = await run(client, llm("a", "code?", contract={"regex": r"[A-Z]{2}\d"}))
    assert not failed and re.fullmatch(r"[A-Z]{2}\d", done["a"])
    assert engine.requests[0].constraint.regex == r"[A-Z]{2}\d"


def test_upstream_regex_and_choices_become_instructions():
    body = chat_body(GenerationRequest("r", "m", messages=[],
                                       constraint=OutputConstraint(regex=r"\d+")), "m")
    assert r"regular expression \d+" in body["messages"][0]["content"]


# -- retries -----------------------------------------------------------------------------

async def test_t3_validation_retry_feeds_the_error_back(aiohttp_client):
    """Case T3: the retry re-asks the model with the validation error in the prompt, on
    the same model with the same resolved inputs, re-running only that step."""
    responder = scripted('{"n": "three"}', '{"n": 3}')

    def respond(request):  # "other" takes no scripted answer, whichever goes first
        return "free text" if request.constraint is None else responder(request)

    engine = FakeEngine(["m"], responder=respond)
    client = await proxy(aiohttp_client, {"m": engine})
    done, failed, steps = await run(
        client, {"kind": "input", "id": "doc", "value": "three apples"},
        {**llm("count", ""), "messages": [{"role": "user", "content": [
            {"text": "How many? "}, {"ref": "doc"}]}], "contract": {"json_schema": SCHEMA},
         "retries": 2},
        llm("other", "independent"))
    assert not failed and done["count"] == {"n": 3}
    tries = [r for r in responder.seen if r.constraint is not None]
    assert len(tries) == 2  # the step alone re-ran, once
    first, second = tries
    assert second.messages[:len(first.messages)] == first.messages  # same resolved inputs
    assert first.messages[0].content == "How many? three apples"
    assistant, user = second.messages[-2:]
    assert assistant.role == "assistant" and assistant.content == '{"n": "three"}'
    assert user.role == "user" and "n: 'three' is not of type 'integer'" in user.content
    assert [a["outcome"] for a in steps["count"]["attempts"]] == ["contract_failed", "ok"]
    assert [a["model"] for a in steps["count"]["attempts"]] == ["m", "m"]
    assert len(steps["other"]["attempts"]) == 1  # nothing else re-ran


async def test_retries_are_bounded_and_the_last_error_names_everything(aiohttp_client):
    engine = FakeEngine(["m"], responder=scripted("nope"))
    client = await proxy(aiohttp_client, {"m": engine})
    _, failed, steps = await run(client, llm("s", "x", contract={"regex": r"\d+"},
                                             retries=2))
    assert len(engine.requests) == 3
    assert "step 's' on model 'm', attempt 3" in failed["s"] and "does not match" in failed["s"]
    assert [a["outcome"] for a in steps["s"]["attempts"]] == ["contract_failed"] * 3
    assert all(a["error"] and a["finished_ms"] is not None for a in steps["s"]["attempts"])


async def test_w3_contract_on_a_backend_without_structured_output_is_checked_and_retried(
        aiohttp_client):
    """Case W3: a backend that cannot enforce the contract natively; the output is still
    checked after generation (and retried), never passed through unchecked."""
    engine = FakeEngine(["plain"], structured_outputs=False,
                        responder=scripted("Sure! Here it is: AB-12", "AB-12"))
    assert not engine.capabilities.structured_outputs
    assert FakeEngine.capabilities.structured_outputs  # other fakes unchanged
    client = await proxy(aiohttp_client, {"plain": engine})
    done, failed, steps = await run(
        client, llm("r", "code?", contract={"regex": r"[A-Z]{2}-\d{2}"}, retries=1),
        llm("j", "json?", contract={"json_schema": SCHEMA}))
    assert done["r"] == "AB-12"
    assert [a["outcome"] for a in steps["r"]["attempts"]] == ["contract_failed", "ok"]
    assert "j" in failed and "not valid JSON" in failed["j"]  # never silently dropped
    resp = await client.post("/v1/workflows:compile", json={"nodes": [
        llm("r", "code?", contract={"regex": "a"})]})
    breaks = (await resp.json())["breaks"]
    assert breaks and "checked after generation" in breaks[0]["reason"]


async def test_errors_no_retry_can_change_are_not_retried_on_the_same_model(aiohttp_client):
    engine = FakeEngine(["m"], fail_with=ContextLengthExceeded("prompt too long",
                                                               param="messages"))
    client = await proxy(aiohttp_client, {"m": engine})
    _, failed, steps = await run(client, llm("s", "x", contract={"regex": "a"}, retries=3))
    assert len(engine.requests) == 1 and "prompt too long" in failed["s"]
    assert [a["outcome"] for a in steps["s"]["attempts"]] == ["error"]


async def test_engine_errors_are_not_retried_by_the_contract_loop(aiohttp_client):
    from flowlift.errors import EngineError

    engine = FakeEngine(["m"], fail_with=EngineError("engine down"))
    client = await proxy(aiohttp_client, {"m": engine})
    _, failed, _ = await run(client, llm("s", "x", contract={"regex": "a"}, retries=3))
    assert len(engine.requests) == 1 and "engine down" in failed["s"]


def test_upstream_context_and_policy_errors_are_typed_unretryable():
    def err(code, status=400):
        body = json.dumps({"error": {"message": f"m {code}", "type": "invalid_request_error",
                                     "code": code}}).encode()
        return UpstreamError("x", status=status, body=body, retryable=False)

    assert isinstance(unretryable(err("context_length_exceeded"), "m"), ContextLengthExceeded)
    assert isinstance(unretryable(err("content_policy_violation"), "m"), ContentRefused)
    assert isinstance(unretryable(err("content_filter"), "m"), ContentRefused)
    assert unretryable(err("rate_limit_exceeded", 429), "m") is None
    assert unretryable(err("server_error", 500), "m") is None
    assert unretryable(UpstreamError("x", status=400, body=b"<html>"), "m") is None
