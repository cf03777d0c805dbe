"""Responses API correctness (issue 34 item 6): calls and outputs that do not pair are a
400 naming the ``call_id`` before any generation; streamed ``function_call`` items are
opened and closed one after another with the final ids; ``truncation``; usage details
from the upstream; a turn on either kind of backend is accounted and traced like a chat
completion; unknown request fields are refused. FakeEngine and a mocked upstream."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from flowlift.errors import ContextLengthExceeded
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.proxy.tenants import Tenant
from flowlift.testing import FakeEngine, capture_spans, default_responder, tool_calls_text
from tests.openapi_spec import validate, validate_event

TOOLS = [{"type": "function", "name": n, "description": n, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}} for n in ("weather", "time")]


def two_calls(request: GenerationRequest) -> str:
    if request.constraint is not None and "tool_calls" in json.dumps(
            request.constraint.json_schema):
        if request.messages[-1].role == "tool" or "tool result" in request.messages[-1].content:
            return json.dumps({"content": "done"})
        return tool_calls_text(("weather", {"city": "Oslo"}), ("time", {"city": "Oslo"}))
    return default_responder(request)


@pytest.fixture
async def served(aiohttp_client):
    engine = FakeEngine(["fake-model"], responder=two_calls, chunk_chars=3)
    app = create_app({"fake-model": engine})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client, engine


def events_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


async def _error(resp: Any) -> dict[str, Any]:
    body = await resp.json()
    validate(body, "ErrorResponse")
    return dict(body["error"])


async def test_calls_and_outputs_that_do_not_pair_are_400s_naming_the_call(served):
    client, engine = served
    call = {"type": "function_call", "call_id": "call_a", "name": "weather",
            "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "call_a", "output": "sunny"}
    cases = [
        ([{**out, "call_id": "call_zz"}], "input[0].call_id", "call_zz"),
        ([{"role": "user", "content": "hi"}, call, {"role": "user", "content": "and?"}],
         "input", "call_a"),
        ([call, out, out], "input[2].call_id", "call_a")]
    for items, param, named in cases:
        for stream in (False, True):
            resp = await client.post("/v1/responses", json={
                "model": "fake-model", "input": items, "tools": TOOLS, "stream": stream})
            error = await _error(resp)
            assert resp.status == 400 and error["type"] == "invalid_request_error", error
            assert error["param"] == param and named in error["message"], error
    assert engine.requests == []  # refused before any generation
    # across turns: the stored call must get its output, once
    first = await (await client.post("/v1/responses", json={
        "model": "fake-model", "input": "weather and time?", "tools": TOOLS})).json()
    ids = [o["call_id"] for o in first["output"] if o["type"] == "function_call"]
    asked = len(engine.requests)
    missing = await client.post("/v1/responses", json={
        "model": "fake-model", "previous_response_id": first["id"], "tools": TOOLS,
        "input": [{**out, "call_id": ids[0]}]})
    error = await _error(missing)
    assert missing.status == 400 and ids[1] in error["message"]
    both = [{**out, "call_id": i} for i in ids]
    second = await (await client.post("/v1/responses", json={
        "model": "fake-model", "previous_response_id": first["id"], "tools": TOOLS,
        "input": both})).json()
    assert second["status"] == "completed"
    twice = await client.post("/v1/responses", json={
        "model": "fake-model", "previous_response_id": second["id"], "tools": TOOLS,
        "input": both[:1]})
    error = await _error(twice)
    assert twice.status == 400 and error["param"] == "input[0].call_id"
    assert ids[0] in error["message"] and len(engine.requests) == asked + 1


def call_pieces(data: dict[str, Any]) -> list[dict[str, Any]]:
    """An upstream's stream of two tool calls, each one's arguments in three pieces."""
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    deltas: list[dict[str, Any]] = []
    for i, name in enumerate(("weather", "time")):
        deltas.append({"index": i, "id": f"call_up{i}", "type": "function",
                       "function": {"name": name, "arguments": ""}})
        deltas += [{"index": i, "function": {"arguments": p}}
                   for p in ('{"ci', 'ty": "Os', 'lo"}')]
    docs = [{**head, "choices": [{"index": 0, "delta": {"tool_calls": [d]},
                                  "finish_reason": None}]} for d in deltas]
    docs.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    if (data.get("stream_options") or {}).get("include_usage"):
        docs.append({**head, "choices": [], "usage": USAGE})
    return docs


@pytest.mark.parametrize("model", ["fake-model", "up-model"])
async def test_streamed_calls_open_and_close_in_order_with_the_final_ids(aiohttp_client,
                                                                         model):
    client = await aiohttp_client(upstream_app(USAGE, answer=call_pieces,
                                               responder=two_calls))
    await client.app[STATE].ready.wait()
    resp = await client.post("/v1/responses", json={
        "model": model, "input": "weather and time?", "tools": TOOLS, "stream": True})
    events = events_of(await resp.text())
    for event in events:
        validate_event(event)
    final = events[-1]["response"]
    calls = [o for o in final["output"] if o["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["weather", "time"]
    lifecycle = [(e["type"], e.get("item", {}).get("id") or e.get("item_id"))
                 for e in events if e["type"].startswith(("response.output_item",
                                                          "response.function_call"))]
    open_now = None
    for kind, item_id in lifecycle:
        assert item_id in {c["id"] for c in calls}  # stream ids are the final ids
        if kind == "response.output_item.added":
            assert open_now is None, lifecycle  # the last item was closed first
            open_now = item_id
        else:
            assert item_id == open_now, lifecycle
            if kind == "response.output_item.done":
                open_now = None
    for call in calls:
        deltas = [e["delta"] for e in events if e.get("item_id") == call["id"]
                  and e["type"] == "response.function_call_arguments.delta"]
        assert "".join(deltas) == call["arguments"]
        if model == "up-model":  # as the upstream streamed them: in pieces
            assert len(deltas) == 3 and call["call_id"] in ("call_up0", "call_up1")
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"
                and e["item"]["id"] == call["id"]]
        assert done == [call]


def long_context(limit: int):
    """A responder whose model takes prompts of at most ``limit`` characters."""
    def respond(request: GenerationRequest) -> str:
        size = sum(len(m.content) for m in request.messages)
        if size > limit:
            raise ContextLengthExceeded(f"{size} characters, over {limit}", param="messages")
        return two_calls(request)
    return respond


async def test_truncation_auto_drops_the_oldest_items_never_a_call_from_its_output(
        aiohttp_client):
    engine = FakeEngine(["fake-model"], responder=two_calls)
    app = create_app({"fake-model": engine})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
    first = await oa.responses.create(model="fake-model", input="x " * 200 + "weather?",
                                      tools=TOOLS)
    ids = [o.call_id for o in first.output if o.type == "function_call"]
    second = await oa.responses.create(
        model="fake-model", previous_response_id=first.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": i, "output": "tool result " * 20}
               for i in ids])
    engine.responder = long_context(900)
    for stream in (False, True):  # disabled (the default): a 400 before any event
        resp = await client.post("/v1/responses", json={
            "model": "fake-model", "previous_response_id": second.id, "input": "more?",
            "stream": stream, "truncation": "disabled"})
        assert resp.status == 400 and resp.content_type == "application/json"
        assert (await resp.json())["error"]["code"] == "context_length_exceeded"
    third = await oa.responses.create(model="fake-model", previous_response_id=second.id,
                                      input="more?", truncation="auto")
    assert third.status == "completed" and third.truncation == "auto"
    sent = engine.requests[-1].messages
    assert sent[-1].content == "more?" and "x x x" not in "".join(m.content for m in sent)
    assert sent[0].role != "tool"  # the outputs went with their calls, or stayed with them
    calls_kept = "weather" in "".join(m.content for m in sent)
    assert calls_kept == ("tool result" in "".join(m.content for m in sent))
    engine.responder = long_context(3)  # the turn's own input does not fit: still a 400
    with pytest.raises(openai.BadRequestError):
        await oa.responses.create(model="fake-model", input="too long", truncation="auto")
    await oa.close()


def text_pieces(usage: dict[str, Any]) -> Any:
    def docs_for(data: dict[str, Any]) -> list[dict[str, Any]]:
        head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        docs = [{**head, "choices": [{"index": 0, "delta": {"content": w},
                                      "finish_reason": None}]} for w in ("up", " there")]
        docs.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if (data.get("stream_options") or {}).get("include_usage"):
            docs.append({**head, "choices": [], "usage": usage})
        return docs
    return docs_for


def upstream_app(usage: dict[str, Any], tenants: tuple[Tenant, ...] = (), *,
                 answer: Any = None, responder: Any = default_responder) -> Any:
    docs_for = answer or text_pieces(usage)

    def respond(request: httpx.Request) -> httpx.Response:
        docs = docs_for(json.loads(request.content))
        body = b"".join(f"data: {json.dumps(d)}\n\n".encode() for d in docs)
        return httpx.Response(200, content=body + b"data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    return create_app({"fake-model": FakeEngine(["fake-model"], responder=responder,
                                                chunk_chars=3)},
                      ProxyConfig(tenants=tenants),
                      file_config=parse_config({
                          "backends": {"up": {"kind": "openai", "base_url": "http://up.test/v1",
                                              "responses_api": "chat"}},
                          "models": {"up-model": {"backends": ["up"],
                                                  "price_per_1k_tokens": 2.0}}}),
                      transport=httpx.MockTransport(respond))


USAGE = {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52,
         "prompt_tokens_details": {"cached_tokens": 32},
         "completion_tokens_details": {"reasoning_tokens": 7}}


async def test_usage_carries_cached_and_reasoning_tokens_from_the_upstream(aiohttp_client):
    client = await aiohttp_client(upstream_app(USAGE))
    await client.app[STATE].ready.wait()
    for stream in (False, True):
        resp = await client.post("/v1/responses", json={"model": "up-model", "input": "hi",
                                                        "stream": stream})
        body = events_of(await resp.text())[-1]["response"] if stream else await resp.json()
        assert body["usage"]["input_tokens_details"]["cached_tokens"] == 32
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 7
        assert (body["usage"]["input_tokens"], body["usage"]["output_tokens"]) == (40, 12)


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f"{name}{{{want}}} "))


async def test_a_turn_is_accounted_and_traced_like_a_chat_completion_on_both_backends(
        aiohttp_client):
    tenant = Tenant("acme", frozenset({"sk-acme"}))
    with capture_spans() as captured:
        client = await aiohttp_client(upstream_app(USAGE, (tenant,)))
        await client.app[STATE].ready.wait()
        headers = {"Authorization": "Bearer sk-acme"}
        for model in ("up-model", "fake-model"):
            for stream in (False, True):
                resp = await client.post("/v1/responses", headers=headers, json={
                    "model": model, "input": "hello there", "stream": stream})
                assert resp.status == 200
                await resp.read()
        metrics = await (await client.get("/metrics", headers=headers)).text()
        spans = [s for s in captured.spans if s.name.startswith("chat ")]
    assert len(spans) == 4
    for span in spans:
        attrs = span.attributes
        assert attrs["flowlift.outcome"] == "complete", attrs
        assert "error.type" not in attrs and attrs["gen_ai.usage.input_tokens"] > 0
        assert attrs["flowlift.usage.partial"] is False
    up = [s for s in spans if s.name == "chat up-model"]
    assert [s.attributes["gen_ai.usage.output_tokens"] for s in up] == [12, 12]
    prompt = _metric(metrics, "flowlift_tenant_tokens_total", tenant="acme", kind="prompt")
    assert prompt > 2 * 40  # the upstream's twice, and the embedded engine's
    assert _metric(metrics, "flowlift_tenant_spend_total", tenant="acme") == pytest.approx(
        2 * 52 / 1000 * 2.0)
    assert _metric(metrics, "flowlift_spend_total", model="up-model") == pytest.approx(
        2 * 52 / 1000 * 2.0)


async def test_unknown_fields_are_refused_and_the_ignored_ones_are_listed(served):
    client, engine = served
    for body, param in (({"temprature": 0.5}, "temprature"),
                        ({"background": True}, "background"),
                        ({"conversation": "conv_1"}, "conversation")):
        resp = await client.post("/v1/responses", json={"model": "fake-model", "input": "x",
                                                        **body})
        error = await _error(resp)
        assert resp.status == 400 and error["param"] == param, error
    assert engine.requests == []
    fine = await client.post("/v1/responses", json={
        "model": "fake-model", "input": "x", "include": [], "reasoning": None,
        "service_tier": "auto", "prompt_cache_key": "k", "background": False,
        "truncation": "disabled", "safety_identifier": "u1"})
    assert fine.status == 200, await fine.text()
