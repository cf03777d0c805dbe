"""Hints the engines understand (proxy/dispatch/routing/hints.py): vLLM ``priority``, SGLang
``session_id`` with its sessions opened and closed, Dynamo ``nvext.agent_hints``; the
exact request bodies through an ``httpx.MockTransport``, and nothing for a backend that
did not opt in."""

from __future__ import annotations

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
from flowlift.proxy.dispatch.routing.hints import (
    SESSION_CAPACITY_CHARS,
    SESSION_TIMEOUT_S,
    SessionBook,
    StepHints,
    hint_fields,
    server_root,
)
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.dispatch.upstream.attempts import Opened
from flowlift.proxy.dispatch.upstream.engine import open_chat
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse

ENGINES = {"vllm": ["vllm-priority"], "sglang": ["sglang-session"], "dynamo": ["dynamo"],
           "plain": []}


def spec(*hints: str) -> UpstreamSpec:
    return UpstreamSpec(kind="openai", base_url="http://e.invalid/v1", hints=list(hints))


def _sse(text: str = "ok") -> httpx.Response:
    events = [{"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return httpx.Response(200, content=body + b"data: [DONE]\n\n",
                          headers={"content-type": "text/event-stream"})


class Engines:
    """One MockTransport for every backend: records each request (host, path, body) and
    answers chat completions with a stream and SGLang's session calls with ``open``."""

    def __init__(self, open_status: int = 200) -> None:
        self.seen: list[tuple[str, str, dict[str, Any]]] = []
        self.open_status = open_status

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.seen.append((request.url.host, request.url.path, body))
        if request.url.path == "/open_session":
            return httpx.Response(self.open_status, json=body["session_id"])
        if request.url.path == "/close_session":
            return httpx.Response(200, json={"success": True})
        if body.get("stream") is not True:
            return httpx.Response(200, json={
                "id": "c", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
        return _sse()

    def chats(self, host: str) -> list[dict[str, Any]]:
        return [b for h, p, b in self.seen if h == host and p == "/v1/chat/completions"]

    def calls(self, host: str) -> list[tuple[str, dict[str, Any]]]:
        return [(p, b) for h, p, b in self.seen if h == host]


def config() -> dict[str, Any]:
    return {"backends": {name: {"kind": "openai", "base_url": f"http://{name}.invalid/v1",
                                "hints": hints} for name, hints in ENGINES.items()},
            "models": {f"m-{name}": {"backends": [name]} for name in ENGINES}}


def request(model: str, **kw: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id="run-1:s1:1", model=model,
        messages=(ChatMessage("user", "hi"),), sampling=SamplingOptions(max_tokens=64,
                                                                        temperature=0.0),
        priority=-1234, session_id="run-1", **kw)


BASE = {"stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "top_p": 1.0,
        "max_tokens": 64}


async def _open(backends: Backends, model: str, req: GenerationRequest) -> None:
    opened = await open_chat(backends, backends.route(model), req)
    assert isinstance(opened, Opened)
    await opened.release()


# -- the pure part ---------------------------------------------------------------------
def test_no_hint_is_written_for_a_backend_that_did_not_opt_in():
    hints = StepHints(priority=-5, session_id="run-1", expected_output_tokens=30,
                      next_turn=True)
    assert hint_fields(spec(), hints, {}, session_open=True) == {}


def test_each_engine_gets_its_own_field():
    hints = StepHints(priority=-5000, session_id="run-1", expected_output_tokens=30,
                      next_turn=True)
    assert hint_fields(spec("vllm-priority"), hints, {}) == {"priority": -5000}
    assert hint_fields(spec("sglang-session"), hints, {}, session_open=True) == {
        "session_id": "run-1"}
    assert hint_fields(spec("dynamo"), hints, {}) == {"nvext": {"agent_hints": {
        "priority": 5000, "osl": 30, "speculative_prefill": True}}}


def test_sglang_gets_no_session_id_for_a_session_that_is_not_open():
    hints = StepHints(priority=0, session_id="run-1")
    assert hint_fields(spec("sglang-session"), hints, {}, session_open=False) == {}


def test_the_clients_own_fields_win():
    hints = StepHints(priority=7, session_id="run-1", expected_output_tokens=9)
    body = {"priority": 3, "session_id": "theirs",
            "nvext": {"greed_sampling": True, "agent_hints": {"osl": 100}}}
    every = spec("vllm-priority", "sglang-session", "dynamo")
    assert hint_fields(every, hints, body, session_open=True) == {"nvext": {
        "greed_sampling": True, "agent_hints": {"priority": -7, "osl": 100}}}


def test_dynamo_priority_is_flowliftss_order_reversed_within_an_i32():
    order = [Priority.of("interactive", 9000.0), Priority.of("interactive", 10.0),
             Priority.of("batch", 9000.0), Priority.of("idle", 0.0)]
    vllm = [p.engine_priority() for p in order]
    dynamo = [hint_fields(spec("dynamo"), StepHints(v), {})["nvext"]["agent_hints"]["priority"]
              for v in vllm]
    assert vllm == sorted(vllm) and dynamo == sorted(dynamo, reverse=True)
    assert all(-2**31 <= d < 2**31 for d in dynamo)
    assert hint_fields(spec("dynamo"), StepHints(-2**40), {})["nvext"]["agent_hints"][
        "priority"] == 2**31 - 1


def test_step_hints_of_a_request():
    plain = request("m")
    assert StepHints.of(plain) == StepHints(-1234, "run-1", 64, False)  # max_tokens: the bound
    learned = request("m", expected_output_tokens=20, tools=(ToolDef("f", "", {}),))
    assert StepHints.of(learned, priority=-99) == StepHints(-99, "run-1", 20, True)
    too_long = request("m", expected_output_tokens=500)
    assert StepHints.of(too_long).expected_output_tokens == 64


@pytest.mark.parametrize("url,root", [("http://h:30000/v1", "http://h:30000"),
                                      ("http://h/v1/", "http://h"),
                                      ("http://h/sglang", "http://h/sglang")])
def test_server_root(url, root):
    assert server_root(url) == root


def test_an_unknown_hint_is_a_config_error():
    with pytest.raises(ConfigError, match="hints"):
        parse_config({"backends": {"a": {"kind": "openai", "base_url": "http://a/v1",
                                         "hints": ["trtllm-priority"]}},
                      "models": {"m": {"backends": ["a"]}}})


# -- exact request bodies ----------------------------------------------------------------
async def test_the_exact_bodies_each_engine_receives():
    engines = Engines()
    backends = Backends({}, config=parse_config(config()),
                        transport=httpx.MockTransport(engines.handler))
    try:
        for name in ENGINES:
            await _open(backends, f"m-{name}", request(f"m-{name}", expected_output_tokens=40))
        assert engines.chats("vllm.invalid") == [
            {**BASE, "model": "m-vllm", "priority": -1234}]
        assert engines.chats("sglang.invalid") == [
            {**BASE, "model": "m-sglang", "session_id": "run-1"}]
        assert engines.chats("dynamo.invalid") == [
            {**BASE, "model": "m-dynamo",
             "nvext": {"agent_hints": {"priority": 1234, "osl": 40}}}]
        assert engines.chats("plain.invalid") == [{**BASE, "model": "m-plain"}]
        assert engines.calls("sglang.invalid")[0] == ("/open_session", {
            "capacity_of_str_len": SESSION_CAPACITY_CHARS, "session_id": "run-1",
            "timeout": SESSION_TIMEOUT_S})
        assert [p for h, p, _ in engines.seen if p != "/v1/chat/completions"] == [
            "/open_session"]  # only the backend that opted in to sessions
    finally:
        await backends.aclose()


async def test_a_session_is_opened_once_and_closed_when_its_run_ends():
    engines = Engines()
    backends = Backends({}, config=parse_config(config()),
                        transport=httpx.MockTransport(engines.handler))
    try:
        for _ in range(3):
            await _open(backends, "m-sglang", request("m-sglang"))
        backends.sessions.end("run-1", backends.upstreams)
        await backends.sessions.aclose()
        paths = [p for p, _ in engines.calls("sglang.invalid")]
        assert paths == ["/open_session"] + ["/v1/chat/completions"] * 3 + ["/close_session"]
        assert engines.calls("sglang.invalid")[-1][1] == {"session_id": "run-1"}
        backends.sessions.end("run-1", backends.upstreams)  # already closed: nothing more
        await backends.sessions.aclose()
        assert len(engines.calls("sglang.invalid")) == 5
    finally:
        await backends.aclose()


async def test_a_session_the_server_will_not_open_is_never_named():
    engines = Engines(open_status=404)  # an SGLang without sessions, or another server
    backends = Backends({}, config=parse_config(config()),
                        transport=httpx.MockTransport(engines.handler))
    try:
        await _open(backends, "m-sglang", request("m-sglang"))
        assert engines.chats("sglang.invalid") == [{**BASE, "model": "m-sglang"}]
        backends.sessions.end("run-1", backends.upstreams)
        await backends.sessions.aclose()
        assert [p for p, _ in engines.calls("sglang.invalid")][-1] == "/v1/chat/completions"
    finally:
        await backends.aclose()


# -- through a workflow run --------------------------------------------------------------
def _chain(model: str, workflow_class: str = "interactive") -> dict[str, Any]:
    """a -> b: a is on the longer remaining path, so it goes first."""
    def llm(step: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"kind": "llm", "id": step, "model": model, "params": {"max_tokens": 24},
                "messages": [{"role": "user", "content": content}]}
    return {"workflow_class": workflow_class, "nodes": [
        llm("a", [{"text": "first"}]),
        llm("b", [{"text": "then "}, {"ref": "a"}])]}


async def _run(client: Any, graph: dict[str, Any]) -> str:
    resp = await client.post("/v1/workflows", json=graph)
    events = parse_sse(await resp.text())
    finished = [d for e, d in events if e == "run.finished"]
    assert finished and finished[0]["status"] == "succeeded", events
    return str(finished[0]["run_id"])


async def test_a_run_carries_its_scheduler_order_and_session_to_the_engines(aiohttp_client):
    engines = Engines()
    app = create_app({}, file_config=parse_config(config()),
                     transport=httpx.MockTransport(engines.handler))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()

    await _run(client, _chain("m-vllm"))
    await _run(client, _chain("m-vllm", "batch"))
    (a, b, batch_a, batch_b) = [body["priority"] for body in engines.chats("vllm.invalid")]
    assert a < b < 0 < batch_a < batch_b  # interactive first, then the critical path

    run_id = await _run(client, _chain("m-sglang"))
    await app[STATE].backends.sessions.aclose()
    sglang = engines.calls("sglang.invalid")
    assert [p for p, _ in sglang] == ["/open_session", "/v1/chat/completions",
                                      "/v1/chat/completions", "/close_session"]
    assert [b.get("session_id") for _, b in sglang] == [run_id] * 4

    await _run(client, _chain("m-dynamo"))
    hints = [body["nvext"]["agent_hints"] for body in engines.chats("dynamo.invalid")]
    assert [h["osl"] for h in hints] == [24, 24] and hints[0]["priority"] > hints[1]["priority"]
    assert all("speculative_prefill" not in h for h in hints)  # no tools: no next turn

    await _run(client, _chain("m-plain"))
    assert all(not {"priority", "session_id", "nvext"} & set(body)
               for body in engines.chats("plain.invalid"))


# -- drop-in requests ----------------------------------------------------------------------
def test_a_request_with_no_order_gets_no_priority_anywhere():
    every = spec("vllm-priority", "sglang-session", "dynamo")
    assert hint_fields(every, StepHints(None), {}) == {}
    assert hint_fields(every, StepHints(None, "s-1"), {}, session_open=True) == {
        "session_id": "s-1"}


async def test_a_drop_in_session_names_its_sglang_session_and_nothing_else(aiohttp_client):
    engines = Engines()
    app = create_app({}, file_config=parse_config(config()),
                     transport=httpx.MockTransport(engines.handler))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    sent = {"messages": [{"role": "user", "content": "hi"}], "stream": False,
            "priority": 3}
    for name in ENGINES:
        for _ in range(2):
            resp = await client.post("/v1/chat/completions",
                                     json={**sent, "model": f"m-{name}"},
                                     headers={"X-Flowlift-Session": "agent-7"})
            assert resp.status == 200, await resp.text()
    assert engines.calls("sglang.invalid") == [
        ("/open_session", {"capacity_of_str_len": SESSION_CAPACITY_CHARS,
                           "session_id": "agent-7", "timeout": SESSION_TIMEOUT_S}),
        *[("/v1/chat/completions", {**sent, "model": "m-sglang", "session_id": "agent-7"})]
        * 2]
    for name in ("vllm", "dynamo", "plain"):  # the client's own priority, nothing added
        assert engines.calls(f"{name}.invalid") == [
            ("/v1/chat/completions", {**sent, "model": f"m-{name}"})] * 2, name


async def test_a_session_unused_for_its_timeout_is_opened_again():
    engines = Engines()
    clock = [0.0]
    backends = Backends({}, config=parse_config(config()),
                        transport=httpx.MockTransport(engines.handler))
    backends.sessions = SessionBook(timer=lambda: clock[0])
    try:
        await _open(backends, "m-sglang", request("m-sglang"))
        clock[0] += SESSION_TIMEOUT_S * 0.8  # used again in time: still open
        await _open(backends, "m-sglang", request("m-sglang"))
        clock[0] += SESSION_TIMEOUT_S * 0.8
        await _open(backends, "m-sglang", request("m-sglang"))
        clock[0] += SESSION_TIMEOUT_S  # idle past it: SGLang closed it, open it again
        await _open(backends, "m-sglang", request("m-sglang"))
        paths = [p for p, _ in engines.calls("sglang.invalid")]
        assert paths == ["/open_session", *["/v1/chat/completions"] * 3, "/open_session",
                         "/v1/chat/completions"]
    finally:
        await backends.aclose()


async def test_dynamo_osl_is_the_plans_expected_length_not_the_cap(aiohttp_client):
    engines = Engines()
    app = create_app({}, file_config=parse_config(config()),
                     transport=httpx.MockTransport(engines.handler))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    graph = {"nodes": [{"kind": "llm", "id": "label", "model": "m-dynamo",
                        "params": {"max_tokens": 64},
                        "contract": {"choices": ["yes", "no"]},
                        "messages": [{"role": "user", "content": [{"text": "ok?"}]}]}]}
    compiled = await (await client.post("/v1/workflows:compile", json=graph)).json()
    planned = next(n["output_tokens"] for n in compiled["nodes"] if n["step_id"] == "label")
    resp = await client.post("/v1/workflows", json=graph)
    await resp.text()
    (body,) = engines.chats("dynamo.invalid")
    assert body["nvext"]["agent_hints"]["osl"] == planned < 64
