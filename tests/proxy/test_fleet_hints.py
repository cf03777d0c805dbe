"""The router hint adapters (proxy/dispatch/fleet_hints.py, issue 37 item 2): for each
adapter a backend opts in to, exactly the headers and body that reach the upstream --
for a workflow step (through ``open_chat``, an ``httpx.MockTransport`` recording every
request) and for a drop-in session (through the proxy) -- and nothing for a backend
that did not opt in."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import pytest

from flowlift.errors import ConfigError
from flowlift.local_engine.base import (
    ChatMessage,
    GenerationRequest,
    SamplingOptions,
    ToolDef,
)
from flowlift.proxy import create_app
from flowlift.proxy.config import UpstreamSpec, parse_config
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.routing.fleet_hints import (
    ProgramSteps,
    StepHints,
    agent_component,
    agentic_context,
    class_of,
    deadline_left_s,
)
from flowlift.proxy.dispatch.routing.hints import hint_fields, hint_headers
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.dispatch.upstream.attempts import Opened
from flowlift.proxy.dispatch.upstream.engine import open_chat
from flowlift.proxy.state import STATE

ADAPTERS = ["vllm-session", "vllm-router-program", "llm-d", "dynamo-session",
            "sglang-routing-key", "sglang-priority"]
HINT_HEADERS = {"x-session-id", "x-llm-d-inference-fairness-id", "x-llm-d-inference-objective",
                "x-dynamo-session-id", "x-dynamo-parent-session-id", "x-smg-routing-key"}
BASE = {"stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "top_p": 1.0,
        "max_tokens": 64}


def _sse() -> httpx.Response:
    events = [{"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return httpx.Response(200, content=body + b"data: [DONE]\n\n",
                          headers={"content-type": "text/event-stream"})


class Recorder:
    """Every request: (host, headers lower-cased, body); chat answers streamed or whole."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.seen.append((request.url.host, {k.lower(): v for k, v in request.headers.items()},
                          body))
        if body.get("stream") is True:
            return _sse()
        return httpx.Response(200, json={
            "id": "c", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

    def on(self, host: str) -> list[tuple[dict[str, str], dict[str, Any]]]:
        return [(h, b) for x, h, b in self.seen if x == host]


def _hints_of(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k in HINT_HEADERS}


def config() -> dict[str, Any]:
    names = [*ADAPTERS, "plain"]
    return {"backends": {n: {"kind": "openai", "base_url": f"http://{n}.invalid/v1",
                             "hints": [] if n == "plain" else [n]} for n in names},
            "models": {f"m-{n}": {"backends": [n]} for n in names}}


def request(model: str, **kw: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id="run-1:s1:1", model=model, messages=(ChatMessage("user", "hi"),),
        sampling=SamplingOptions(max_tokens=64, temperature=0.0), priority=-1234,
        session_id="run-1", **kw)


async def _open(backends: Backends, model: str, req: GenerationRequest) -> None:
    opened = await open_chat(backends, backends.route(model), req)
    assert isinstance(opened, Opened)
    await opened.release()


# -- the pure part ---------------------------------------------------------------------
def spec(*hints: str) -> UpstreamSpec:
    return UpstreamSpec(kind="openai", base_url="http://e.invalid/v1", hints=list(hints))


FULL = StepHints(priority=-5000, session_id="run-1", expected_output_tokens=30,
                 next_turn=True, workflow_class="interactive", deadline_s=12.5, step=3,
                 kv_retention_ttl_s=10.0)


def test_no_adapter_writes_anything_unless_opted_in():
    assert hint_fields(spec(), FULL, {}) == {}
    assert hint_headers(spec(), FULL) == {}


@pytest.mark.parametrize("adapter,headers,fields", [
    ("vllm-session", {"x-session-id": "run-1"}, {"session_id": "run-1"}),
    ("vllm-router-program", {"x-session-id": "run-1"}, {"vllm_xargs": {
        "agentic_context": json.dumps({
            "program_id": "run-1", "step_id": 3, "priority": 5000, "deadline_seconds": 12.5,
            "expected_output_length": 30, "expected_resume": True,
            "kv_retention_ttl_seconds": 10.0}, separators=(",", ":"))}}),
    ("llm-d", {"x-session-id": "run-1", "x-llm-d-inference-fairness-id": "run-1",
               "x-llm-d-inference-objective": "interactive"}, {}),
    ("dynamo-session", {"x-dynamo-session-id": "run-1"}, {}),
    ("sglang-routing-key", {"x-smg-routing-key": "run-1"}, {}),
    ("sglang-priority", {}, {"priority": 5000}),  # higher first: flowlift's order negated
])
def test_each_adapter_writes_exactly_its_router_fields(adapter, headers, fields):
    assert hint_headers(spec(adapter), FULL) == headers
    assert hint_fields(spec(adapter), FULL, {}) == fields


def test_the_clients_own_fields_win():
    body = {"session_id": "mine", "priority": 1, "vllm_xargs": {"agentic_context": "{}"}}
    every = spec("vllm-session", "vllm-router-program", "sglang-priority")
    assert hint_fields(every, FULL, body) == {}
    merged = hint_fields(every, FULL, {"vllm_xargs": {"kv_transfer": "x"}})
    assert merged["vllm_xargs"]["kv_transfer"] == "x" and "agentic_context" in merged[
        "vllm_xargs"]


def test_dynamo_agent_hints_and_the_session_header_go_together():
    both = spec("dynamo", "dynamo-session")
    assert hint_fields(both, FULL, {}) == {"nvext": {"agent_hints": {
        "priority": 5000, "osl": 30, "speculative_prefill": True}}}
    assert hint_headers(both, FULL) == {"x-dynamo-session-id": "run-1"}


def test_the_sglang_priority_sign_is_higher_first_and_bounded():
    urgent, later = (hint_fields(spec("sglang-priority"), StepHints(p), {})["priority"]
                     for p in (-9_000, 1_000_000_500))  # interactive, then batch
    assert urgent > later
    assert hint_fields(spec("sglang-priority"), StepHints(-2**40), {})["priority"] == 2**31 - 1


def test_both_priority_scales_on_one_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="sglang-priority"):
        parse_config({"backends": {"a": {"kind": "openai", "base_url": "http://a/v1",
                                         "hints": ["vllm-priority", "sglang-priority"]}},
                      "models": {"m": {"backends": ["a"]}}})


# -- parents: an agent step's turns are a sub-agent of the run ----------------------------
AGENT = dataclasses.replace(FULL, agent_id="scout")
PARENT_FIELDS = {"task_id": "run-1", "agent_id": "scout", "agent_role": "subagent",
                 "parent_program_id": "run-1", "blocks_parent": False}


def test_an_agent_turn_names_its_run_as_parent_where_routers_read_one():
    assert hint_headers(spec("dynamo-session"), AGENT) == {
        "x-dynamo-session-id": "run-1:scout", "x-dynamo-parent-session-id": "run-1"}
    context = json.loads(hint_fields(spec("vllm-router-program"), AGENT, {})[
        "vllm_xargs"]["agentic_context"])
    assert context == {"program_id": "run-1:scout", **PARENT_FIELDS, "step_id": 3,
                       "priority": 5000, "deadline_seconds": 12.5,
                       "expected_output_length": 30, "expected_resume": True,
                       "kv_retention_ttl_seconds": 10.0}
    # the router's placement key stays the run: x-session-id is the run's
    assert hint_headers(spec("vllm-router-program"), AGENT) == {"x-session-id": "run-1"}
    # the adapters without a parent notion keep the run as the session
    for adapter in ("vllm-session", "llm-d", "sglang-routing-key"):
        assert hint_headers(spec(adapter), AGENT) == hint_headers(spec(adapter), FULL)
    assert hint_fields(spec("vllm-session"), AGENT, {}) == {"session_id": "run-1"}


def test_a_root_request_has_no_parent():
    assert "x-dynamo-parent-session-id" not in hint_headers(spec("dynamo-session"), FULL)
    context = json.loads(hint_fields(spec("vllm-router-program"), FULL, {})[
        "vllm_xargs"]["agentic_context"])
    assert not set(PARENT_FIELDS) & set(context)
    # an agent id without a session names nothing
    assert StepHints(None, agent_id="scout").program is None
    assert StepHints(None, agent_id="scout").parent is None


def test_a_step_id_that_cannot_go_in_a_header_is_digested():
    assert agent_component("map_1[3]") == "map_1[3]"
    odd = "étape: résumé\n" + "x" * 100
    digest = agent_component(odd)
    assert digest.startswith("h-") and len(digest) == 18 and digest.isascii()
    assert digest == agent_component(odd) != agent_component(odd + "y")
    headers = hint_headers(spec("dynamo-session"), dataclasses.replace(FULL, agent_id=odd))
    assert headers["x-dynamo-session-id"] == f"run-1:{digest}"


def test_agentic_context_carries_only_what_is_known():
    assert agentic_context(StepHints(None), "p") == {"program_id": "p"}
    # a step whose next turn does not come back: no retention, no resume
    assert agentic_context(StepHints(7, step=0, kv_retention_ttl_s=9.0), "p") == {
        "program_id": "p", "step_id": 0, "priority": -7}


def test_class_and_deadline_from_the_scheduler_order():
    assert class_of(Priority.of("interactive", 1500.0).engine_priority()) == "interactive"
    assert class_of(Priority.of("batch", 1500.0).engine_priority()) == "batch"
    assert class_of(Priority.of("batch", 0.0).engine_priority()) == "batch"
    assert class_of(Priority.of("idle", 10.0).engine_priority()) == "idle"
    assert class_of(0) == "interactive"
    assert deadline_left_s(Priority.of("batch", 2000.0, slack_ms=3000.0)) == 5.0
    assert deadline_left_s(Priority.of("batch", 2000.0)) is None


def test_program_steps_count_from_zero_per_program():
    steps = ProgramSteps()
    assert [steps.next("a"), steps.next("a"), steps.next("b"), steps.next("a")] == [0, 1, 0, 2]


# -- a workflow step: exactly what reaches each upstream -----------------------------------
TOOLS = (ToolDef("look", "looks", {"type": "object", "properties": {}}),)


def _recording() -> tuple[Backends, Recorder]:
    seen = Recorder()
    return Backends({}, config=parse_config(config()),
                    transport=httpx.MockTransport(seen.handler)), seen


async def test_the_exact_request_each_adapter_sends_for_a_step():
    backends, seen = _recording()
    try:
        for name in [*ADAPTERS, "plain"]:
            await _open(backends, f"m-{name}", request(f"m-{name}", expected_output_tokens=40))
        await _open(backends, "m-vllm-router-program",  # an agent turn: its next comes back
                    request("m-vllm-router-program", tools=TOOLS))

        def only(name: str) -> tuple[dict[str, str], dict[str, Any]]:
            [(headers, body)] = seen.on(f"{name}.invalid")[:1]
            return _hints_of(headers), body

        assert only("vllm-session") == ({"x-session-id": "run-1"}, {
            **BASE, "model": "m-vllm-session", "session_id": "run-1"})
        program = [(h, b) for h, b in seen.on("vllm-router-program.invalid")]
        assert [_hints_of(h) for h, _ in program] == [{"x-session-id": "run-1"}] * 2
        contexts = [json.loads(b["vllm_xargs"]["agentic_context"]) for _, b in program]
        assert contexts[0] == {"program_id": "run-1", "step_id": 1, "priority": 1234,
                               "expected_output_length": 40}
        assert contexts[1] == {"program_id": "run-1", "step_id": 6, "priority": 1234,
                               "expected_output_length": 64, "expected_resume": True,
                               "kv_retention_ttl_seconds": backends.keep_ttl_s}
        assert {k: v for k, v in program[0][1].items() if k != "vllm_xargs"} == {
            **BASE, "model": "m-vllm-router-program"}
        assert only("llm-d") == ({"x-session-id": "run-1",
                                  "x-llm-d-inference-fairness-id": "run-1",
                                  "x-llm-d-inference-objective": "interactive"},
                                 {**BASE, "model": "m-llm-d"})
        assert only("dynamo-session") == ({"x-dynamo-session-id": "run-1"}, {
            **BASE, "model": "m-dynamo-session"})
        assert only("sglang-routing-key") == ({"x-smg-routing-key": "run-1"}, {
            **BASE, "model": "m-sglang-routing-key"})
        assert only("sglang-priority") == ({}, {**BASE, "model": "m-sglang-priority",
                                                "priority": 1234})
        assert only("plain") == ({}, {**BASE, "model": "m-plain"})
    finally:
        await backends.aclose()


# -- a drop-in session through the proxy ------------------------------------------------------
async def test_a_drop_in_session_reaches_each_router_as_its_session(aiohttp_client):
    seen = Recorder()
    app = create_app({}, file_config=parse_config(config()),
                     transport=httpx.MockTransport(seen.handler))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    for name in [*ADAPTERS, "plain"]:
        for _ in range(2):
            resp = await client.post("/v1/chat/completions", json={
                "model": f"m-{name}", "messages": [{"role": "user", "content": "hi"}]},
                headers={"X-Flowlift-Session": "sess-9"})
            assert resp.status == 200, await resp.text()
    sent = {name: [(_hints_of(h), b) for h, b in seen.on(f"{name}.invalid")]
            for name in [*ADAPTERS, "plain"]}
    assert [h for h, _ in sent["vllm-session"]] == [{"x-session-id": "sess-9"}] * 2
    assert [b["session_id"] for _, b in sent["vllm-session"]] == ["sess-9"] * 2
    # the session's requests counted across the proxy (its first two went to vllm-session)
    assert [json.loads(b["vllm_xargs"]["agentic_context"])
            for _, b in sent["vllm-router-program"]] == [
        {"program_id": "sess-9", "step_id": 2}, {"program_id": "sess-9", "step_id": 3}]
    # a drop-in request has no class: no objective header, the session still goes
    assert [h for h, _ in sent["llm-d"]] == [{"x-session-id": "sess-9",
                                              "x-llm-d-inference-fairness-id": "sess-9"}] * 2
    assert [h for h, _ in sent["dynamo-session"]] == [{"x-dynamo-session-id": "sess-9"}] * 2
    assert all("nvext" not in b for _, b in sent["dynamo-session"])
    assert [h for h, _ in sent["sglang-routing-key"]] == [{"x-smg-routing-key": "sess-9"}] * 2
    assert ["priority" in b for _, b in sent["sglang-priority"]] == [False, False]  # no order
    assert all(h == {} and set(b) == {"model", "messages"} for h, b in sent["plain"])


# -- a workflow run: class and deadline from the granted slot -------------------------------
async def _both(aiohttp_client: Any, *hints: str) -> tuple[Any, Recorder]:
    """A proxy whose model ``m-both`` has one backend (``both.invalid``) with ``hints``."""
    seen = Recorder()
    cfg = config()
    cfg["backends"]["both"] = {"kind": "openai", "base_url": "http://both.invalid/v1",
                               "hints": list(hints)}
    cfg["models"]["m-both"] = {"backends": ["both"]}
    app = create_app({}, file_config=parse_config(cfg),
                     transport=httpx.MockTransport(seen.handler))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client, seen


async def test_a_run_sends_its_class_deadline_and_steps(aiohttp_client):
    from flowlift.testing import parse_sse

    client, seen = await _both(aiohttp_client, "llm-d", "vllm-router-program")

    def llm(step: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"kind": "llm", "id": step, "model": "m-both", "params": {"max_tokens": 24},
                "messages": [{"role": "user", "content": content}]}
    resp = await client.post("/v1/workflows", json={
        "workflow_class": "batch", "deadline_s": 600, "nodes": [
            llm("a", [{"text": "first"}]), llm("b", [{"text": "then "}, {"ref": "a"}])]})
    events = parse_sse(await resp.text())
    run_id = next(d for e, d in events if e == "run.finished")["run_id"]
    sent = seen.on("both.invalid")
    assert [_hints_of(h) for h, _ in sent] == [
        {"x-session-id": run_id, "x-llm-d-inference-fairness-id": run_id,
         "x-llm-d-inference-objective": "batch"}] * 2
    contexts = [json.loads(b["vllm_xargs"]["agentic_context"]) for _, b in sent]
    assert [c["step_id"] for c in contexts] == [0, 1]
    assert all(c["program_id"] == run_id and c["expected_output_length"] == 24
               for c in contexts)
    assert 0 < contexts[1]["deadline_seconds"] <= contexts[0]["deadline_seconds"] <= 600
    assert contexts[0]["priority"] > contexts[1]["priority"]  # a: the longer path left


# -- parents: exactly what reaches the upstream -------------------------------------------
async def test_an_agent_turn_reaches_the_routers_as_a_sub_agent_of_its_run():
    backends, seen = _recording()
    try:
        for name in ("dynamo-session", "vllm-router-program"):
            for _ in range(2):
                await _open(backends, f"m-{name}",
                            request(f"m-{name}", tools=TOOLS, agent_id="scout"))
        await _open(backends, "m-vllm-router-program", request("m-vllm-router-program"))
    finally:
        await backends.aclose()
    assert [_hints_of(h) for h, _ in seen.on("dynamo-session.invalid")] == [
        {"x-dynamo-session-id": "run-1:scout", "x-dynamo-parent-session-id": "run-1"}] * 2
    program = seen.on("vllm-router-program.invalid")
    assert [_hints_of(h) for h, _ in program] == [{"x-session-id": "run-1"}] * 3
    contexts = [json.loads(b["vllm_xargs"]["agentic_context"]) for _, b in program]
    assert contexts[0] == {"program_id": "run-1:scout", **PARENT_FIELDS, "step_id": 2,
                           "priority": 1234, "expected_output_length": 64,
                           "expected_resume": True,
                           "kv_retention_ttl_seconds": backends.keep_ttl_s}
    # steps are counted per program (the sub-agent's first two went to dynamo-session),
    # the sub-agent's and the run's apart
    assert [c["step_id"] for c in contexts] == [2, 3, 0]
    assert contexts[2] == {"program_id": "run-1", "step_id": 0, "priority": 1234,
                           "expected_output_length": 64}


async def test_a_runs_agent_step_is_its_sub_agent_and_its_other_steps_the_root(
        aiohttp_client):
    from flowlift.testing import parse_sse

    client, seen = await _both(aiohttp_client, "dynamo-session", "vllm-router-program")
    resp = await client.post("/v1/workflows", json={"nodes": [
        {"kind": "llm", "id": "scout", "model": "m-both", "params": {"max_tokens": 16},
         "messages": [{"role": "user", "content": [{"text": "look around"}]}],
         "tools": [{"name": "look", "parameters": {"type": "object", "properties": {}}}]},
        {"kind": "llm", "id": "sum", "model": "m-both", "params": {"max_tokens": 16},
         "messages": [{"role": "user", "content": [{"text": "sum up "}, {"ref": "scout"}]}]},
    ]})
    events = parse_sse(await resp.text())
    finished = next(d for e, d in events if e == "run.finished")
    assert finished["status"] == "succeeded", events
    run = finished["run_id"]
    sent = seen.on("both.invalid")
    assert [_hints_of(h) for h, _ in sent] == [
        {"x-session-id": run, "x-dynamo-session-id": f"{run}:scout",
         "x-dynamo-parent-session-id": run},
        {"x-session-id": run, "x-dynamo-session-id": run}]
    scout, summary = (json.loads(b["vllm_xargs"]["agentic_context"]) for _, b in sent)
    assert {k: scout[k] for k in ("program_id", "task_id", "agent_id", "agent_role",
                                  "parent_program_id", "blocks_parent", "step_id")} == {
        "program_id": f"{run}:scout", "task_id": run, "agent_id": "scout",
        "agent_role": "subagent", "parent_program_id": run, "blocks_parent": False,
        "step_id": 0}
    assert summary["program_id"] == run and summary["step_id"] == 0
    assert "parent_program_id" not in summary
