"""Regression tests for ``shared/cases``: inputs that broke other gateways (S1-S7 streaming,
B1-B4 bodies and headers, R1-R3 retries and timeouts), run through flowlift's proxy to a
scripted upstream on a real socket."""

from __future__ import annotations

import asyncio
import json
import time
from email.utils import formatdate
from typing import Any

import pytest

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes

CHAT = {"model": "up", "messages": [{"role": "user", "content": "hi"}]}


def upstream_config(*urls: str, model: dict[str, Any] | None = None,
                    **backend: Any) -> dict[str, Any]:
    backends = {f"b{i}": {"kind": "openai", "base_url": url, "api_key_env": "UP_KEY",
                          **backend} for i, url in enumerate(urls)}
    return {"backends": backends,
            "models": {"up": {"backends": ["b0"], "fallbacks": [f"b{i}" for i in
                                                                 range(1, len(urls))],
                              **(model or {})}}}


@pytest.fixture(autouse=True)
def _upstream_key(monkeypatch):
    monkeypatch.setenv("UP_KEY", "sk-upstream-secret")


@pytest.fixture
def proxy(aiohttp_client, aiohttp_server):
    """``await proxy(fake, ..., config=..., **backend_settings)`` -> client of a proxy whose
    model ``up`` is served by the given fake upstreams (first: replica, rest: fallbacks)."""
    async def make(*fakes: FakeUpstream, config: ProxyConfig | None = None,
                   model: dict[str, Any] | None = None, **backend: Any):
        urls = []
        for fake in fakes:
            server = await aiohttp_server(fake.app())
            urls.append(str(server.make_url("/v1")))
        file_config = parse_config(upstream_config(*urls, model=model, **backend))
        app = create_app({"fake-model": FakeEngine(["fake-model"])}, config,
                         file_config=file_config)
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        return client
    return make


def datas(text: str) -> list[Any]:
    return [d for _, d in parse_sse(text)]


# -- S: streaming -----------------------------------------------------------------------
TOOL_CALL = {"index": 0, "id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


async def test_S1_whole_tool_call_in_one_chunk(proxy):
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(
        chunk({"role": "assistant", "tool_calls": [TOOL_CALL]}), chunk({}, "tool_calls")))])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    text = await resp.text()
    assert resp.status == 200, text
    events = datas(text)
    call = events[0]["choices"][0]["delta"]["tool_calls"][0]
    assert call == TOOL_CALL
    assert events[-1] == "[DONE]"


async def test_S2_parallel_tool_calls_stay_separate(proxy):
    calls = [{"index": i, "id": f"call_{i}", "type": "function",
              "function": {"name": f"f{i}", "arguments": json.dumps({"n": i})}} for i in range(3)]
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(
        *[chunk({"tool_calls": [c]}) for c in calls], chunk({}, "tool_calls")))])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    got = [e["choices"][0]["delta"]["tool_calls"][0] for e in datas(await resp.text())
           if e != "[DONE]" and e["choices"][0]["delta"].get("tool_calls")]
    assert got == calls
    assert [json.loads(c["function"]["arguments"]) for c in got] == [{"n": 0}, {"n": 1}, {"n": 2}]


async def test_S3_continuation_deltas_keyed_by_index_arrive_in_order(proxy):
    deltas = [chunk({"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                     "function": {"name": "lookup", "arguments": ""}}]})]
    deltas += [chunk({"tool_calls": [{"index": 0, "id": None, "function": {"arguments": part}}]})
               for part in ['{"q"', ': "flow', 'lift"}']]
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(*deltas, chunk({}, "tool_calls")))])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = datas(await resp.text())
    assert events[:4] == deltas
    args = "".join(e["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                   for e in events[:4])
    assert json.loads(args) == {"q": "flowlift"}


async def test_S4_split_multibyte_characters_survive(proxy):
    text = "日本語 🎉 ünïcode"
    event = b"data: " + json.dumps(chunk({"content": text}), ensure_ascii=False).encode()
    cut = event.index("本".encode()) + 1  # inside a 3-byte character
    cut2 = event.index("🎉".encode()) + 2  # inside a 4-byte emoji
    pieces = [event[:cut], event[cut:cut2], event[cut2:] + b"\n\n",
              *sse_bytes(chunk({}, "stop"))]
    fake = FakeUpstream([FakeUpstream.stream(pieces, gap_s=0.02)])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    raw = await resp.read()
    assert json.dumps(text, ensure_ascii=False).encode() in raw
    assert datas(raw.decode())[0]["choices"][0]["delta"]["content"] == text


async def test_S5_events_are_forwarded_as_they_arrive(proxy):
    n, gap = 5, 0.2
    fake = FakeUpstream([FakeUpstream.stream(
        sse_bytes(*[chunk({"content": f"t{i}"}) for i in range(n)], chunk({}, "stop")),
        gap_s=gap)])
    client = await proxy(fake)
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    arrivals = []
    buf = b""
    async for piece in resp.content.iter_any():
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            arrivals.append((time.monotonic() - t0, event))
    # Each event reaches the client before upstream sends the next one (gap_s later).
    for i in range(n):
        assert arrivals[i][0] < (i + 1) * gap, (i, arrivals[i][0])
    assert arrivals[-2][0] >= (n - 1) * gap * 0.9  # really spread out over time


async def test_S6_cut_before_any_byte_is_retried(proxy):
    fake = FakeUpstream([FakeUpstream.stream([]),  # headers, then closes: no event at all
                         FakeUpstream.stream(sse_bytes(chunk({"content": "whole"}),
                                                       chunk({}, "stop")))])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = datas(await resp.text())
    assert events[0]["choices"][0]["delta"]["content"] == "whole"
    assert events[-1] == "[DONE]" and len(fake.received) == 2


async def test_S6_cut_after_bytes_ends_with_in_band_error_never_a_clean_finish(proxy):
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "half an"}),
                                                       chunk({"content": " answ"}), done=False))])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = datas(await resp.text())
    assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["half an", " answ"]
    assert "error" in events[-1] and "incomplete" in events[-1]["error"]["message"]
    assert "[DONE]" not in events
    assert len(fake.received) == 1  # bytes were out: no retry


async def test_S6_official_client_raises_on_a_truncated_stream(proxy):
    import openai

    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "half"}), done=False))])
    client = await proxy(fake)
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
    stream = await oa.chat.completions.create(model="up", messages=CHAT["messages"],
                                              stream=True)
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass


@pytest.mark.parametrize("path,obj", [("/v1/chat/completions", "chat.completion.chunk"),
                                      ("/v1/completions", "text_completion")])
async def test_S7_usage_chunk_reaches_the_client(proxy, path, obj):
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    first = ({"object": obj, "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
             if obj == "text_completion" else chunk({"content": "ok"}, "stop"))
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(
        first, {"id": "x", "object": obj, "created": 1, "model": "up-model", "choices": [],
                "usage": usage}))])
    client = await proxy(fake)
    body = ({"model": "up", "prompt": "hi"} if obj == "text_completion" else dict(CHAT))
    resp = await client.post(path, json={**body, "stream": True,
                                         "stream_options": {"include_usage": True}})
    events = datas(await resp.text())
    assert events[-2]["choices"] == [] and events[-2]["usage"] == usage
    assert fake.received[0].json()["stream_options"] == {"include_usage": True}


# -- B: bodies and headers --------------------------------------------------------------
async def test_B1_unknown_fields_reach_upstream_and_client_unchanged(proxy):
    answer = chat_json(system_fingerprint=None, vendor_extra={"reasoning": None, "k": [1, 2]})
    answer["choices"][0]["message"]["reasoning_content"] = None
    fake = FakeUpstream([FakeUpstream.json(answer)])
    client = await proxy(fake)
    sent = (b'{"model": "up", "messages": [{"role": "user", "content": "hi"}], '
            b'"chat_template_kwargs": {"enable_thinking": false}, "vendor_x": null, '
            b'"temperature": 0.70, "top_k": 20}')
    resp = await client.post("/v1/chat/completions", data=sent,
                             headers={"Content-Type": "application/json"})
    assert fake.received[0].body == sent  # byte for byte
    assert await resp.json() == answer


async def test_B1_unknown_stream_fields_pass_through(proxy):
    last = chunk({}, "stop", service_tier=None)
    last["choices"][0]["logprobs"] = {"content": [{"token": "x", "logprob": -0.1, "bytes": [120],
                                                   "top_logprobs": []}]}
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "x"}), last))])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert datas(await resp.text())[1] == last


async def test_B2_client_credentials_stay_home_trace_context_passes(proxy):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await proxy(fake, config=ProxyConfig(api_keys=frozenset({"sk-proxy-key"})))
    headers = {"Authorization": "Bearer sk-proxy-key", "X-Api-Key": "secret-1",
               "X-Internal-Token": "secret-2", "Cookie": "session=secret-3",
               "OpenAI-Organization": "org-client",
               "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
               "tracestate": "congo=t61rcWkgMzE"}
    resp = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert resp.status == 200
    got = {k.lower(): v for k, v in fake.received[0].headers.items()}
    assert got["authorization"] == "Bearer sk-upstream-secret"
    # the trace continues: same trace id and flags, the proxy's own span as the parent
    version, trace_id, parent_id, flags = got["traceparent"].split("-")
    _, sent_trace, sent_parent, sent_flags = headers["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", sent_trace, sent_flags)
    assert parent_id != sent_parent and int(parent_id, 16) != 0
    assert got["tracestate"] == headers["tracestate"]
    for secret in ("secret-1", "secret-2", "secret-3", "sk-proxy-key", "org-client"):
        assert secret not in json.dumps(got)
    denied = await client.post("/v1/chat/completions", json=CHAT,
                               headers={"Authorization": "Bearer wrong"})
    assert denied.status == 401
    assert (await denied.json())["error"]["code"] == "invalid_api_key"


async def test_B3_non_ascii_header_values_never_500(proxy):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await proxy(fake)
    host, port = client.server.host, client.server.port
    body = json.dumps(CHAT).encode()
    for name in (b"traceparent", b"X-Custom", b"X-Flowlift-Session"):
        reader, writer = await asyncio.open_connection(host, port)
        value = "café ☃".encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n" + name + b": " + value + b"\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        status_line = await reader.readline()
        writer.close()
        status = int(status_line.split()[1])
        assert status < 500, (name, status_line)
        assert status == 200 or 400 <= status < 500


async def test_B4_large_body_under_the_limit_is_forwarded(proxy):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await proxy(fake, config=ProxyConfig(max_body_bytes=32 * 1024 * 1024))
    image = "data:image/png;base64," + "A" * (20 * 1024 * 1024)
    body = {"model": "up", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": image}}]}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    assert len(fake.received[0].body) > 20 * 1024 * 1024


async def test_B4_body_over_the_limit_is_413_in_openai_shape(proxy):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await proxy(fake, config=ProxyConfig(max_body_bytes=1024 * 1024))
    resp = await client.post("/v1/chat/completions",
                             json={**CHAT, "pad": "x" * (2 * 1024 * 1024)})
    assert resp.status == 413
    err = (await resp.json())["error"]
    assert err["code"] == "payload_too_large" and "--max-body-mb" in err["message"]
    assert fake.received == []


# -- R: retries and timeouts ------------------------------------------------------------
RATE_LIMITED = {"error": {"message": "slow down", "type": "requests", "param": None,
                          "code": "rate_limit_exceeded"}}


async def test_R1_retry_after_seconds_is_honoured(proxy):
    fake = FakeUpstream([FakeUpstream.json(RATE_LIMITED, 429, {"Retry-After": "2"}),
                         FakeUpstream.json(chat_json("after the wait"))])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert (await resp.json())["choices"][0]["message"]["content"] == "after the wait"
    assert fake.received[1].at - fake.received[0].at >= 2.0


async def test_R1_retry_after_http_date_is_honoured(proxy):
    fake = FakeUpstream([])
    fake.scripts = [lambda req: FakeUpstream.json(
        RATE_LIMITED, 429, {"Retry-After": formatdate(time.time() + 2, usegmt=True)})(req),
        FakeUpstream.json(chat_json())]
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 200
    assert fake.received[1].at - fake.received[0].at >= 1.0  # HTTP-dates have 1 s steps


async def test_R1_retry_after_past_the_deadline_fails_fast_with_the_upstreams_answer(proxy):
    fake = FakeUpstream([FakeUpstream.json(RATE_LIMITED, 429, {"Retry-After": "30"})])
    client = await proxy(fake, model={"total_timeout_s": 3})
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert time.monotonic() - t0 < 2.5
    assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 29
    assert (await resp.json()) == RATE_LIMITED
    assert len(fake.received) == 1


async def test_R1_without_header_backoff_is_bounded_in_attempts(proxy):
    fake = FakeUpstream([FakeUpstream.json({"error": {"message": "boom", "type": "server_error",
                                                      "param": None, "code": None}}, 503)])
    client = await proxy(fake, model={"max_attempts": 3}, failures_to_cool=10)
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 503 and (await resp.json())["error"]["message"] == "boom"
    assert len(fake.received) == 3
    assert time.monotonic() - t0 < 20  # two jittered waits, each at most a few seconds


async def test_R1_client_errors_are_not_retried(proxy):
    bad = {"error": {"message": "bad field", "type": "invalid_request_error",
                     "param": "messages", "code": None}}
    fake = FakeUpstream([FakeUpstream.json(bad, 400)])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 400 and await resp.json() == bad
    assert len(fake.received) == 1


async def test_R2_proxy_503_carries_retry_after_when_every_backend_cools(proxy):
    fake = FakeUpstream([FakeUpstream.json({"error": {"message": "down"}}, 500)])
    client = await proxy(fake, model={"max_attempts": 1}, failures_to_cool=1, cooldown_s=30)
    first = await client.post("/v1/chat/completions", json=CHAT)
    assert first.status == 502  # the upstream's 500: the backend's fault, not flowlift's
    second = await client.post("/v1/chat/completions", json=CHAT)
    assert second.status == 503
    assert 1 <= int(second.headers["Retry-After"]) <= 30
    assert (await second.json())["error"]["code"] == "backends_unavailable"
    assert len(fake.received) == 1  # the cooling backend was not hammered


async def test_R2_proxy_429_carries_retry_after_when_it_sheds_load(proxy):
    slow = FakeUpstream.stream(sse_bytes(chunk({"content": "a"}), chunk({}, "stop")),
                               first_delay_s=0.5)
    fake = FakeUpstream([slow])
    client = await proxy(fake, max_connections=1)
    busy = asyncio.create_task(client.post("/v1/chat/completions",
                                           json={**CHAT, "stream": True}))
    await asyncio.sleep(0.2)
    shed = await client.post("/v1/chat/completions", json=CHAT)
    assert shed.status == 429 and int(shed.headers["Retry-After"]) >= 1
    assert (await shed.json())["error"]["type"] == "rate_limit_error"
    assert (await busy).status == 200


async def test_R3_first_token_timeout_abandons_the_attempt_and_fails_over(proxy):
    stalled = FakeUpstream([FakeUpstream.headers_then_stall(10)])
    healthy = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "fallback"}),
                                                          chunk({}, "stop")))])
    client = await proxy(stalled, healthy, first_token_timeout_s=2)
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = datas(await resp.text())
    elapsed = time.monotonic() - t0
    assert events[0]["choices"][0]["delta"]["content"] == "fallback"
    assert 1.9 <= elapsed < 4
    assert resp.headers["X-Flowlift-Backend"] == "b1"


async def test_R3_the_last_attempt_gets_what_is_left_of_the_budget(proxy):
    """Issue 38, item 12: the first-token timeout is for an attempt that can still fail
    over; the chain's last attempt waits for its first token within the request's
    remaining budget instead of being cut off with nothing to replace it."""
    stalled = FakeUpstream([FakeUpstream.headers_then_stall(10)])
    slow = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "late"}),
                                                       chunk({}, "stop")), first_delay_s=1.6)])
    client = await proxy(stalled, slow, first_token_timeout_s=0.8,
                         model={"max_attempts": 2, "total_timeout_s": 8})
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = datas(await resp.text())
    assert resp.status == 200 and resp.headers["X-Flowlift-Backend"] == "b1"
    assert events[0]["choices"][0]["delta"]["content"] == "late"
    assert 2.3 <= time.monotonic() - t0 < 6
    # the budget still bounds it: a last attempt slower than what is left fails in time
    stalled2 = FakeUpstream([FakeUpstream.headers_then_stall(10)])
    slower = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "x"}),
                                                         chunk({}, "stop")), first_delay_s=9)])
    client = await proxy(stalled2, slower, first_token_timeout_s=0.8,
                         model={"max_attempts": 2, "total_timeout_s": 2.5})
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status >= 500 and time.monotonic() - t0 < 4


# -- other endpoints pass through -------------------------------------------------------
async def test_responses_api_stream_passes_through_with_named_events(proxy):
    events = [b'event: response.created\ndata: {"type":"response.created","response":{"id":"r1"}}'
              b'\n\n',
              b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
              b'"delta":"Hi \xc3\xa9"}\n\n',
              b'event: response.completed\ndata: {"type":"response.completed",'
              b'"response":{"id":"r1","status":"completed"}}\n\n']
    fake = FakeUpstream([FakeUpstream.stream(events)])
    client = await proxy(fake)
    resp = await client.post("/v1/responses", json={"model": "up", "input": "hi",
                                                    "stream": True})
    assert await resp.read() == b"".join(events)
    assert fake.received[0].path == "/v1/responses"


async def test_embeddings_pass_through_and_the_embedded_engine_says_it_cannot(proxy):
    vectors = {"object": "list", "model": "up-embed", "usage": {"prompt_tokens": 2,
                                                                "total_tokens": 2},
               "data": [{"object": "embedding", "index": 0, "embedding": [0.1, -0.2]}]}
    fake = FakeUpstream([FakeUpstream.json(vectors)])
    client = await proxy(fake)
    resp = await client.post("/v1/embeddings", json={"model": "up", "input": "hello"})
    assert await resp.json() == vectors and fake.received[0].path == "/v1/embeddings"
    local = await client.post("/v1/embeddings", json={"model": "fake-model", "input": "hi"})
    assert local.status == 400 and (await local.json())["error"]["param"] == "model"
    # the embedded engine now serves the Responses API itself (tests/proxy/test_responses_api.py)
    responses = await client.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
    assert responses.status == 200 and (await responses.json())["object"] == "response"


async def one_slot_proxy(aiohttp_client, delay_s):
    """A proxy on a FakeEngine with one engine slot and room for one waiting request."""
    engine = FakeEngine(["fake-model"], delay_s=delay_s)
    app = create_app({"fake-model": engine}, ProxyConfig(max_concurrency=1, max_queue=1))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def test_R2_embedded_queue_full_is_429_with_retry_after(aiohttp_client):
    client = await one_slot_proxy(aiohttp_client, 0.1)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "a b c d"}]}
    running = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await asyncio.sleep(0.05)
    shed = await client.post("/v1/chat/completions", json=body)
    assert shed.status == 429 and shed.headers["Retry-After"] == "1"
    assert (await shed.json())["error"]["code"] == "rate_limit_exceeded"
    assert (await running).status == 200 and (await queued).status == 200


async def test_R2_a_simultaneous_burst_cannot_slip_past_the_queue_limit(aiohttp_client):
    client = await one_slot_proxy(aiohttp_client, 0.2)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "a b"}]}
    answers = await asyncio.gather(*[client.post("/v1/chat/completions", json=body)
                                     for _ in range(5)])
    assert sorted(a.status for a in answers) == [200, 200, 429, 429, 429]


async def test_B2_an_upstream_rejecting_the_configured_key_is_a_502_not_the_clients_401(proxy):
    fake = FakeUpstream([FakeUpstream.json({"error": {"message": "bad key"}}, 401)])
    client = await proxy(fake)
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 502
    assert "api_key_env" in (await resp.json())["error"]["message"]


# -- what a fresh-clone user broke ------------------------------------------------------
async def test_S6_a_finish_reason_without_done_is_still_cut_short(proxy):
    # n=2: choice 0 finished, choice 1 never did; include_usage: the usage never came
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "a"}),
                                                       chunk({}, "stop"), done=False))])
    client = await proxy(fake)
    events = datas(await (await client.post("/v1/chat/completions", json={
        **CHAT, "n": 2, "stream": True})).text())
    assert "error" in events[-1] and "[DONE]" not in events


async def test_S6_bytes_dribbling_without_an_event_end_at_the_idle_timeout(proxy):
    fake = FakeUpstream([FakeUpstream.stream(
        sse_bytes(chunk({"content": "a"}), done=False) + [b"d", b"a", b"t", b"a"] * 20,
        gap_s=0.2)])
    client = await proxy(fake, idle_timeout_s=1)
    t0 = time.monotonic()
    events = datas(await (await client.post("/v1/chat/completions",
                                            json={**CHAT, "stream": True})).text())
    assert time.monotonic() - t0 < 5
    assert "error" in events[-1] and "timed out" in events[-1]["error"]["message"]


async def test_R3_a_whole_answer_waits_at_most_the_response_timeout(proxy):
    stalled = FakeUpstream([FakeUpstream.headers_then_stall(10)])
    client = await proxy(stalled, response_timeout_s=1, model={"max_attempts": 1})
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 504 and time.monotonic() - t0 < 3


@pytest.mark.parametrize("answer,status", [
    (FakeUpstream.json(b"{not json"), 502), (FakeUpstream.json(b"", 204), 502),
    (FakeUpstream.json(b"<html>Not Found</html>", 404), 502),
    (FakeUpstream.json({"error": {"message": "overloaded"}}, 503), 503)])
async def test_broken_upstream_answers_are_the_backends_fault(proxy, answer, status):
    client = await proxy(FakeUpstream([answer]), model={"max_attempts": 1})
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == status
    assert "error" in await resp.json()
    if status == 503:
        assert resp.headers["Retry-After"] == "1"


async def test_deeply_nested_json_is_a_400_not_a_500(proxy):
    client = await proxy(FakeUpstream([FakeUpstream.json(chat_json())]))
    body = '{"model": "up", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    resp = await client.post("/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "body"


async def test_models_retrieve_and_request_field_checks(proxy):
    client = await proxy(FakeUpstream([FakeUpstream.json(chat_json())]))
    assert (await (await client.get("/v1/models/up")).json())["id"] == "up"
    assert (await client.get("/v1/models/nope")).status == 404
    bad_stream = await client.post("/v1/chat/completions", json={**CHAT, "stream": "yes"})
    assert bad_stream.status == 400 and (await bad_stream.json())["error"]["param"] == "stream"
    bad_session = await client.post("/v1/chat/completions", json=CHAT,
                                    headers={"X-Flowlift-Session": "has space"})
    assert bad_session.status == 400
