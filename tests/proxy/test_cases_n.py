"""Regression tests for the N-series of ``shared/cases`` and issue 16 ("nothing lost,
nobody blacked out"), through flowlift's proxy to a scripted upstream on a real socket."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any

import pytest
from aiohttp import web

from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, capture_spans, parse_sse
from tests.upstream_fake import (
    FakeUpstream,
    Script,
    chat_json,
    chunk,
    sse_bytes,
    upstream_only_proxy,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def by_model(scripts: dict[str, Script]) -> Script:
    """One upstream answering each model with its own script."""
    async def answer(request: web.Request) -> web.StreamResponse:
        return await scripts[json.loads(await request.read())["model"]](request)
    return answer


async def shared_backend_proxy(aiohttp_client: Any, aiohttp_server: Any, fake: FakeUpstream,
                               models: dict[str, dict[str, Any]], **backend: Any) -> Any:
    """A proxy (no embedded engine) whose ``models`` all live on one backend ``b0``."""
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    app = create_app({}, file_config=parse_config({
        "backends": {"b0": {"kind": "openai", "base_url": url, **backend}},
        "models": {m: {"backends": ["b0"], **spec} for m, spec in models.items()}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


def datas(text: str) -> list[Any]:
    return [d for _, d in parse_sse(text)]


async def _keep_asking(client: Any, until: asyncio.Event, model: str = "fast") -> list[int]:
    statuses = []
    while not until.is_set():
        resp = await client.post("/v1/chat/completions",
                                 json={"model": model, "messages": MESSAGES})
        await resp.read()
        statuses.append(resp.status)
        await asyncio.sleep(0.05)
    return statuses


# -- item 1: one request's failures never black out a backend ---------------------------
async def test_one_models_first_token_timeouts_never_black_out_the_backend(
        aiohttp_client, aiohttp_server):
    """A healthy upstream stalls model ``slow`` (headers, then nothing) and answers
    ``fast``: ``slow``'s requests each use all their attempts, and ``fast`` keeps
    succeeding throughout and after (before: three timeouts cooled the backend, and
    ``fast`` got 503 ``backends_unavailable`` for 30 s)."""
    fake = FakeUpstream([by_model({"slow": FakeUpstream.headers_then_stall(30),
                                   "fast": FakeUpstream.json(chat_json("quick"))})])
    client = await shared_backend_proxy(
        aiohttp_client, aiohttp_server, fake,
        {"slow": {"max_attempts": 3, "total_timeout_s": 10}, "fast": {}},
        first_token_timeout_s=0.3, failures_to_cool=2, cooldown_s=30)
    stop = asyncio.Event()
    asking = asyncio.create_task(_keep_asking(client, stop))
    slow = await asyncio.gather(*[client.post("/v1/chat/completions", json={
        "model": "slow", "messages": MESSAGES, "stream": True}) for _ in range(3)])
    stop.set()
    statuses = await asking
    assert {r.status for r in slow} == {504}
    assert sum(r.json()["model"] == "slow" for r in fake.received) == 9  # 3 x 3 attempts
    assert statuses and set(statuses) == {200}, statuses
    # and on its own (no other traffic): one request's three timeouts cool nothing
    alone = await client.post("/v1/chat/completions", json={
        "model": "slow", "messages": MESSAGES, "stream": True})
    assert alone.status == 504
    after = await client.post("/v1/chat/completions", json={"model": "fast",
                                                            "messages": MESSAGES})
    assert after.status == 200, await after.text()


async def test_N6_stalls_after_the_first_chunks_are_cut_and_the_backend_stays_available(
        aiohttp_client, aiohttp_server):
    """8 streams on a pool of 8 send two chunks and stall: each ends about the idle
    timeout after its last chunk with an in-band error and no [DONE]; a request while
    the pool is full gets 429 + Retry-After; once the stalls are cut, everyone is
    served (before: the 8 cut streams cooled the backend for 30 s)."""
    stall = FakeUpstream.stream(sse_bytes(chunk({"content": "one"}), chunk({"content": "two"}),
                                          done=False), then_stall_s=30)
    fake = FakeUpstream([by_model({"slow": stall,
                                   "fast": FakeUpstream.json(chat_json("quick"))})])
    client = await shared_backend_proxy(aiohttp_client, aiohttp_server, fake,
                                        {"slow": {}, "fast": {}}, idle_timeout_s=1,
                                        max_connections=8, failures_to_cool=2)
    t0 = time.monotonic()
    streams = [asyncio.create_task(client.post("/v1/chat/completions", json={
        "model": "slow", "messages": MESSAGES, "stream": True})) for _ in range(8)]
    await asyncio.sleep(0.4)
    full = await client.post("/v1/chat/completions", json={"model": "fast",
                                                           "messages": MESSAGES})
    assert full.status == 429 and int(full.headers["Retry-After"]) >= 1
    for resp in await asyncio.gather(*streams):
        events = datas(await resp.text())
        assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["one", "two"]
        assert "error" in events[-1] and "[DONE]" not in events
        assert sum("error" in e for e in events if isinstance(e, dict)) == 1
    assert 0.9 < time.monotonic() - t0 < 4
    after = await asyncio.gather(*[client.post("/v1/chat/completions", json={
        "model": m, "messages": MESSAGES}) for m in ("fast", "fast", "fast")])
    assert {r.status for r in after} == {200}


async def test_connection_errors_across_requests_still_cool_and_a_probe_reopens(
        aiohttp_client, aiohttp_server):
    """A backend that answers 500 to distinct requests is cooled (503 with
    Retry-After, not hammered); after the cool-down one probe goes through and its
    success reopens the backend."""
    fake = FakeUpstream([FakeUpstream.json({"error": {"message": "down"}}, 500)] * 2
                        + [FakeUpstream.json(chat_json("back"))])
    client = await shared_backend_proxy(aiohttp_client, aiohttp_server, fake,
                                        {"fast": {"max_attempts": 1}},
                                        failures_to_cool=2, cooldown_s=1)
    body = {"model": "fast", "messages": MESSAGES}
    assert [(await client.post("/v1/chat/completions", json=body)).status
            for _ in range(2)] == [502, 502]
    cooled = await client.post("/v1/chat/completions", json=body)
    assert cooled.status == 503 and int(cooled.headers["Retry-After"]) >= 1
    assert len(fake.received) == 2
    await asyncio.sleep(1.1)
    probe = await client.post("/v1/chat/completions", json=body)
    assert probe.status == 200 and len(fake.received) == 3
    assert (await client.post("/v1/chat/completions", json=body)).status == 200



# -- N3 and item 2: usage asked upstream, stripped for who did not ask, always recorded -
USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
         "prompt_tokens_details": {"cached_tokens": 3}}


def usage_when_stream_options() -> Script:
    """An upstream (like some vLLM versions) that sends the usage chunk whenever the
    request has ``stream_options``, whatever it holds."""
    async def answer(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        docs = [chunk({"content": "ok"}), chunk({}, "stop")]
        if "stream_options" in body:
            docs.append({**chunk(), "choices": [], "usage": USAGE})
        return await FakeUpstream.stream(sse_bytes(*docs))(request)
    return answer


@pytest.fixture
def captured():
    with capture_spans() as cap:
        yield cap


async def _span(captured: Any, name: str, n: int) -> list[Any]:
    deadline = time.monotonic() + 3
    while len(captured.named(name)) < n:
        assert time.monotonic() < deadline, "no span"
        await asyncio.sleep(0.01)
    return captured.named(name)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_N3_empty_stream_options(aiohttp_client, aiohttp_server, captured, path):
    fake = FakeUpstream([usage_when_stream_options()])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    base = ({"model": "up", "messages": MESSAGES} if path.endswith("chat/completions")
            else {"model": "up", "prompt": "hi"})
    seen = []
    for options in (None, {}, {"include_usage": True}):
        body = {**base, "stream": True} | ({} if options is None else {"stream_options": options})
        resp = await client.post(path, json=body)
        events = datas(await resp.text())
        assert resp.status == 200 and events[-1] == "[DONE]"
        seen.append([e for e in events if isinstance(e, dict) and e.get("usage")])
    assert seen[0] == [] and seen[1] == []
    assert len(seen[2]) == 1 and seen[2][0]["choices"] == [] and seen[2][0]["usage"] == USAGE
    # the proxy asked the upstream for the usage each time, and recorded it each time
    assert all(r.json()["stream_options"]["include_usage"] is True for r in fake.received)
    operation = "chat" if path.endswith("chat/completions") else "text_completion"
    for span in await _span(captured, f"{operation} up", 3):
        a = span.attributes
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"],
                a["gen_ai.usage.cache_read.input_tokens"]) == (5, 2, 3)
        assert a["flowlift.usage.partial"] is False and a["flowlift.outcome"] == "complete"
    metrics = await (await client.get("/metrics")).text()
    assert 'flowlift_completion_tokens_total{model="up-model"} 6.0' in metrics
    assert 'flowlift_prompt_tokens_total{model="up-model"} 15.0' in metrics


async def test_usage_of_a_stream_cut_before_its_usage_is_estimated_and_flagged_partial(
        aiohttp_client, aiohttp_server, captured):
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(
        *[chunk({"content": f"w{i} "}) for i in range(4)], done=False))])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    resp = await client.post("/v1/chat/completions", json={
        "model": "up", "stream": True, "messages": [{"role": "user", "content": "x" * 400}]})
    assert "error" in datas(await resp.text())[-1]
    (span,) = await _span(captured, "chat up", 1)
    a = span.attributes
    assert a["flowlift.usage.partial"] is True and a["flowlift.outcome"] != "complete"
    assert a["gen_ai.usage.output_tokens"] == 4  # one token per event received
    assert 100 <= a["gen_ai.usage.input_tokens"] <= 130  # ~4 characters a token
    metrics = await (await client.get("/metrics")).text()
    assert 'flowlift_estimated_usage_requests_total{model="up-model"} 1.0' in metrics


def responses_events(terminal: str, status: str) -> list[bytes]:
    usage = {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13,
             "input_tokens_details": {"cached_tokens": 2}}
    docs = [("response.created", {"type": "response.created", "response": {
                "id": "r1", "object": "response", "status": "in_progress", "usage": None}}),
            ("response.output_text.delta", {"type": "response.output_text.delta",
                                            "delta": "Hi"}),
            (terminal, {"type": terminal, "response": {
                "id": "r1", "object": "response", "status": status, "usage": usage}})]
    return [f"event: {name}\ndata: {json.dumps(doc)}\n\n".encode() for name, doc in docs]


@pytest.mark.parametrize("terminal,status,outcome", [
    ("response.completed", "completed", "complete"),
    ("response.incomplete", "incomplete", "incomplete"),
    ("response.failed", "failed", "error")])
async def test_responses_usage_on_every_terminal_event_and_only_completed_is_complete(
        aiohttp_client, aiohttp_server, captured, terminal, status, outcome):
    events = responses_events(terminal, status)
    fake = FakeUpstream([FakeUpstream.stream(events)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    resp = await client.post("/v1/responses", json={"model": "up", "input": "hi",
                                                    "stream": True})
    assert await resp.read() == b"".join(events)  # passed through untouched
    assert "stream_options" not in fake.received[0].json()
    (span,) = await _span(captured, "chat up", 1)
    a = span.attributes
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"],
            a["gen_ai.usage.cache_read.input_tokens"]) == (9, 4, 2)
    assert a["flowlift.outcome"] == outcome and a["flowlift.usage.partial"] is False


async def test_a_responses_stream_that_ends_failed_without_usage_invents_none(
        aiohttp_client, aiohttp_server, captured):
    """Issue 38, item 15: ``response.failed`` with no usage is a failed request with no
    tokens (no estimate, not flagged partial, no spend); ``response.incomplete`` with a
    usage is recorded exactly as given."""
    failed = [e.replace(b'"usage": {"input_tokens": 9, "output_tokens": 4, '
                        b'"total_tokens": 13, "input_tokens_details": {"cached_tokens": 2}}',
                        b'"usage": null') for e in responses_events("response.failed", "failed")]
    assert b'"usage": null' in failed[-1]
    fake = FakeUpstream([FakeUpstream.stream(failed),
                         FakeUpstream.stream(responses_events("response.incomplete",
                                                              "incomplete"))])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    for _ in range(2):
        resp = await client.post("/v1/responses", json={"model": "up", "input": "x" * 400,
                                                        "stream": True})
        await resp.read()
    first, second = await _span(captured, "chat up", 2)
    a = first.attributes
    assert a["flowlift.outcome"] == "error" and a["flowlift.usage.partial"] is False
    assert "gen_ai.usage.input_tokens" not in a and "gen_ai.usage.output_tokens" not in a
    b = second.attributes
    assert b["flowlift.outcome"] == "incomplete" and b["flowlift.usage.partial"] is False
    assert (b["gen_ai.usage.input_tokens"], b["gen_ai.usage.output_tokens"],
            b["gen_ai.usage.cache_read.input_tokens"]) == (9, 4, 2)
    metrics = await (await client.get("/metrics")).text()
    assert "flowlift_estimated_usage_requests_total{" not in metrics


# -- item 8: unknown run ids are 404 run_not_found on every run route; one error event -
async def test_unknown_run_ids_are_404_run_not_found_on_every_run_route(aiohttp_client):
    app = create_app({"fake-model": FakeEngine(["fake-model"])})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    for method, path, body in (
            ("GET", "/v1/workflows/wf-nope", None),
            ("GET", "/v1/workflows/wf-nope/events", None),
            ("GET", "/v1/workflows/wf-nope/progress", None),
            ("DELETE", "/v1/workflows/wf-nope", None),
            ("POST", "/v1/workflows/wf-nope/steps/s/result", {"value": 1})):
        resp = await client.request(method, path, json=body)
        error = (await resp.json())["error"]
        assert (resp.status, error["code"], error["param"]) == (404, "run_not_found",
                                                                "run_id"), path
    page = await client.get("/ui/workflows/wf-nope")
    assert page.status == 404 and "No such run" in await page.text()


async def test_an_upstream_error_event_mid_stream_is_the_only_error_event(
        aiohttp_client, aiohttp_server):
    error = {"error": {"message": "engine died", "type": "server_error", "param": None,
                       "code": None}}
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "par"}), error,
                                                       done=False))])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    resp = await client.post("/v1/chat/completions", json={"model": "up", "stream": True,
                                                           "messages": MESSAGES})
    events = datas(await resp.text())
    assert [e for e in events if isinstance(e, dict) and "error" in e] == [error]
    assert events[-1] == error and "[DONE]" not in events


# -- N9: an upstream 400 in a foreign shape stays a 400 in the OpenAI shape ------------
SGLANG_400 = {"object": "error", "message": "max_tokens must be at least 1, got -3.",
              "type": "BadRequestError", "param": None, "code": 400}


async def test_N9_foreign_error_bodies(aiohttp_client, aiohttp_server):
    import openai

    bad = FakeUpstream([FakeUpstream.json(SGLANG_400, 400)])
    spare = FakeUpstream([FakeUpstream.json(chat_json("should not be asked"))])
    urls = [str((await aiohttp_server(f.app())).make_url("/v1")) for f in (bad, spare)]
    app = create_app({}, file_config=parse_config({
        "backends": {"a": {"kind": "openai", "base_url": urls[0]},
                     "b": {"kind": "openai", "base_url": urls[1]}},
        "models": {"up": {"backends": ["a"], "fallbacks": ["b"], "max_attempts": 3}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    for stream in (False, True):
        resp = await client.post("/v1/chat/completions", json={
            "model": "up", "messages": MESSAGES, "max_tokens": -3, "stream": stream})
        assert resp.status == 400
        assert (await resp.json())["error"] == {
            "message": SGLANG_400["message"], "type": "invalid_request_error", "param": None,
            "code": None}
    assert len(bad.received) == 2 and spare.received == []  # no retry, no fallback
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k")
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        await oa.chat.completions.create(model="up", messages=MESSAGES, max_tokens=-3)
    assert len(bad.received) == 3  # the openai client did not retry it either


# -- N4: SSE framing; keep-alives are no model events ----------------------------------
def _event(doc: Any) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


N4_DOCS = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
           chunk({"content": "lo"}), chunk({}, "stop")]


def _n4_variants() -> dict[str, list[bytes]]:
    whole = [_event(d) for d in N4_DOCS] + [b"data: [DONE]\n\n"]
    first = whole[1]
    crlf = [e.replace(b"\n\n", b"\r\n\r\n") for e in whole]
    two_lines = [b"data: " + json.dumps(d, indent=None).replace(", ", ",\ndata: ", 1).encode()
                 + b"\n\n" for d in N4_DOCS] + [b"data: [DONE]\n\n"]
    named = []
    for e in whole:
        named += [b"event: message\n", e]
    return {"split_json": [whole[0], first[:17], first[17:], *whole[2:]],
            "three_in_one_write": [b"".join(whole[:3]), *whole[3:]],
            "crlf_separators": crlf,
            "event_and_data_lines_apart": named,
            "one_event_on_two_data_lines": two_lines,
            "keep_alives_between": [p for e in whole for p in (b": keep-alive\n\n", e)]}


@pytest.mark.parametrize("variant", list(_n4_variants()))
async def test_N4_sse_framing(aiohttp_client, aiohttp_server, variant):
    fake = FakeUpstream([FakeUpstream.stream(_n4_variants()[variant], gap_s=0.05)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    resp = await client.post("/v1/chat/completions", json={"model": "up", "stream": True,
                                                           "messages": MESSAGES})
    events = datas(await resp.text())
    assert events == [*N4_DOCS, "[DONE]"], variant


async def test_N4_keep_alives_are_no_first_token(aiohttp_client, aiohttp_server):
    """Only keep-alive comments for 3 s, first-token timeout 1 s: the attempt is
    abandoned at ~1 s and the next one answers (before: the comment was the first
    token, and the client waited out the comments)."""
    chatty = FakeUpstream.stream([b": keep-alive\n\n"] * 15, gap_s=0.2)
    fake = FakeUpstream([chatty, FakeUpstream.stream(sse_bytes(chunk({"content": "real"}),
                                                               chunk({}, "stop")))])
    client = await shared_backend_proxy(aiohttp_client, aiohttp_server, fake, {"up": {}},
                                        first_token_timeout_s=1)
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json={"model": "up", "stream": True,
                                                           "messages": MESSAGES})
    events = datas(await resp.text())
    assert events[0]["choices"][0]["delta"]["content"] == "real"
    assert 0.9 < time.monotonic() - t0 < 2.5 and len(fake.received) == 2


async def test_N4_keep_alives_do_not_reset_the_idle_timer(aiohttp_client, aiohttp_server):
    """Two content chunks, then keep-alives every 0.2 s for 6 s, idle timeout 1 s: the
    stream is cut ~1 s after its last chunk with one in-band error and no [DONE]."""
    pieces = sse_bytes(chunk({"content": "a"}), chunk({"content": "b"}), done=False)
    fake = FakeUpstream([FakeUpstream.stream(pieces + [b": keep-alive\n\n"] * 30, gap_s=0.2)])
    client = await shared_backend_proxy(aiohttp_client, aiohttp_server, fake, {"up": {}},
                                        idle_timeout_s=1)
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json={"model": "up", "stream": True,
                                                           "messages": MESSAGES})
    events = datas(await resp.text())
    assert time.monotonic() - t0 < 2.5
    assert [e for e in events if "error" in e] == [events[-1]] and "[DONE]" not in events
    assert "timed out" in events[-1]["error"]["message"]


# -- N10: big, slow and short bodies ----------------------------------------------------
async def _raw_post(client: Any, body: bytes, content_length: int, *, gap_s: float = 0.0,
                    piece: int = 64 * 1024, close: bool = False,
                    read_timeout_s: float = 10.0) -> bytes:
    """POST ``body`` to /v1/chat/completions over a raw socket announcing
    ``content_length``, in ``piece``-byte writes ``gap_s`` apart; ``close``: shut the
    socket's writing half after the body. Returns what the proxy answered (b"": none)."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(content_length).encode() + b"\r\n\r\n")
    for i in range(0, len(body), piece):
        writer.write(body[i:i + piece])
        await writer.drain()
        if gap_s:
            await asyncio.sleep(gap_s)
    if close:
        writer.write_eof()
    async def answer() -> bytes:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            return exc.partial  # closed without an answer
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        return head + await reader.readexactly(length)
    try:
        return await asyncio.wait_for(answer(), read_timeout_s)
    finally:
        writer.close()


@pytest.mark.parametrize("size_mb", [1.9, 20])
async def test_N10_big_bodies_sent_slowly_reach_upstream_byte_identical(
        aiohttp_client, aiohttp_server, size_mb):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    image = "A" * int(size_mb * 1024 * 1024)
    body = json.dumps({"model": "up", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}],
        "vendor_field": None}).encode()
    answer = await _raw_post(client, body, len(body), gap_s=0.002, read_timeout_s=60)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    got = fake.received[0].body
    assert (len(got), hashlib.sha256(got).hexdigest()) == (len(body),
                                                            hashlib.sha256(body).hexdigest())


async def test_N10_a_body_shorter_than_its_content_length_is_named_and_logged(
        aiohttp_client, aiohttp_server, capsys):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    body = json.dumps({"model": "up", "messages": MESSAGES}).encode()
    await _raw_post(client, body[:20], len(body), close=True)  # the socket closes early
    await asyncio.sleep(0.2)
    logged = capsys.readouterr()
    assert "incomplete_request_body" in logged.out + logged.err
    assert "unhandled_error" not in logged.out + logged.err
    assert fake.received == []
    ok = await client.post("/v1/chat/completions", json={"model": "up", "messages": MESSAGES})
    assert ok.status == 200  # and the proxy serves the next request as ever


async def test_N10_a_half_sent_body_that_stalls_is_cut_by_the_body_read_timeout(
        aiohttp_client, aiohttp_server):
    from flowlift.proxy import ProxyConfig

    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    app = create_app({}, ProxyConfig(body_idle_timeout_s=0.5), file_config=parse_config({
        "backends": {"r0": {"kind": "openai", "base_url": url}},
        "models": {"up": {"backends": ["r0"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    body = json.dumps({"model": "up", "messages": MESSAGES}).encode()
    t0 = time.monotonic()
    answer = await _raw_post(client, body[:20], len(body), read_timeout_s=5)
    assert 0.4 < time.monotonic() - t0 < 3
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    error = json.loads(payload)["error"]
    assert error["code"] == "incomplete_body" and "20 of the" in error["message"]
    assert fake.received == []


# -- N11: a step attempt's upstream request carries Idempotency-Key run:step:attempt ---
def _step(node_id: str, *content: Any, **extra: Any) -> dict[str, Any]:
    parts = [c if isinstance(c, dict) else {"text": c} for c in content]
    return {"kind": "llm", "id": node_id, "model": "up",
            "messages": [{"role": "user", "content": parts}], **extra}


def stream_answer(text: str) -> Script:
    return FakeUpstream.stream(sse_bytes(chunk({"content": text}), chunk({}, "stop"),
                                         {**chunk(), "choices": [], "usage": USAGE}))


async def test_N11_step_attempts_carry_idempotency_keys(aiohttp_client, aiohttp_server):
    fake = FakeUpstream([stream_answer("alpha"), stream_answer("not a number"),
                         stream_answer("42")])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    graph = {"id": "wf-n11:x", "nodes": [
        _step("a", "first"),
        _step("b", "after ", {"ref": "a", "path": []}, contract={"regex": r"\d+"},
              retries=2)]}
    events = parse_sse(await (await client.post("/v1/workflows", json=graph)).text())
    assert events[-1][1]["status"] == "succeeded", events[-1]
    keys = [{k.lower(): v for k, v in r.headers.items()}.get("idempotency-key")
            for r in fake.received]
    assert keys == ["wf-n11:x:a:1", "wf-n11:x:b:1", "wf-n11:x:b:2"]
    # a drop-in client's own key passes through unchanged
    await client.post("/v1/chat/completions", json={"model": "up", "messages": MESSAGES},
                      headers={"Idempotency-Key": "client-key-7"})
    assert {k.lower(): v for k, v in fake.received[-1].headers.items()}[
        "idempotency-key"] == "client-key-7"


# -- N5: tool-call arguments under any chunking -----------------------------------------
CALL_ARGS = {"city": "Paris", "units": "metric", "days": [1, 2, 3], "note": "naïve \"q\""}


def _tool_call_stream(pieces: list[str]) -> list[bytes]:
    head = {"index": 0, "id": "call_7", "type": "function",
            "function": {"name": "forecast", "arguments": pieces[0]}}
    docs = [chunk({"role": "assistant", "content": None, "tool_calls": [head]})]
    docs += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]})
             for p in pieces[1:]]
    docs.append(chunk({}, "tool_calls"))
    return sse_bytes(*docs)


def _chunkings(text: str) -> list[list[str]]:
    """One delta, 3-character deltas, completed by the final delta, and 25 random
    chunkings (seeded: a failure names its chunking)."""
    import random

    out = [[text], [text[i:i + 3] for i in range(0, len(text), 3)], ["", text]]
    rng = random.Random(16)
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


async def test_N5_tool_call_arguments_under_any_chunking(aiohttp_client, aiohttp_server):
    text = json.dumps(CALL_ARGS, ensure_ascii=False)
    whole = chat_json(None)
    whole["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function",
         "function": {"name": "forecast", "arguments": text}}]}
    whole["choices"][0]["finish_reason"] = "tool_calls"
    fake = FakeUpstream([FakeUpstream.json(whole)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    body = {"model": "up", "messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "forecast", "parameters": {"type": "object"}}}]}
    plain = (await (await client.post("/v1/chat/completions", json=body)).json())
    expected = json.loads(plain["choices"][0]["message"]["tool_calls"][0]["function"][
        "arguments"])
    assert expected == CALL_ARGS
    for pieces in _chunkings(text):
        fake.scripts.append(FakeUpstream.stream(_tool_call_stream(pieces)))
        resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
        events = [e for e in datas(await resp.text()) if isinstance(e, dict)]
        deltas = [e["choices"][0]["delta"] for e in events]
        calls = [c for d in deltas for c in d.get("tool_calls") or []]
        assert {c["index"] for c in calls} == {0}, pieces
        assert [c["id"] for c in calls if c.get("id")] == ["call_7"], pieces
        assert [c["function"]["name"] for c in calls if c["function"].get("name")] == [
            "forecast"], pieces
        args = "".join(c["function"].get("arguments") or "" for c in calls)
        assert json.loads(args) == expected, pieces
        assert not any(d.get("content") for d in deltas), pieces  # no JSON in content
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


# -- N12: retries of streamed structured output -----------------------------------------
async def test_N12_retries_of_streamed_structured_output(aiohttp_client, aiohttp_server):
    def answer(text: str, completion: int) -> Script:
        usage = {"prompt_tokens": 11, "completion_tokens": completion, "total_tokens": 0}
        return FakeUpstream.stream(sse_bytes(*[chunk({"content": text[i:i + 5]})
                                               for i in range(0, len(text), 5)],
                                             chunk({}, "stop"),
                                             {**chunk(), "choices": [], "usage": usage}))
    fake = FakeUpstream([answer('{"name": "Jason", "age": 25}', 9),
                         answer('{"name": "Jason Liu", "age": 25}', 10)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    schema = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "pattern": "^\\S+ \\S+$"}, "age": {"type": "integer"}}}
    graph = {"id": "wf-n12", "nodes": [_step("person", "Who?", contract={
        "json_schema": schema}, retries=2)]}
    events = parse_sse(await (await client.post("/v1/workflows", json=graph)).text())
    assert events[-1][1]["status"] == "succeeded", events[-1]
    finished = [d for e, d in events if e == "step.finished"]
    assert [d["value"] for d in finished] == [{"name": "Jason Liu", "age": 25}]
    assert len(fake.received) == 2  # attempt 1 read to its end, then fed back
    retry_prompt = json.dumps(fake.received[1].json()["messages"])
    assert "Jason" in retry_prompt and "pattern" in retry_prompt.lower(), retry_prompt
    run = await (await client.get("/v1/workflows/wf-n12")).json()
    (step,) = [s for s in run["trace"] if s.get("step_id", s.get("id")) == "person"]
    attempts = step["attempts"]
    assert [(a["prompt_tokens"], a["completion_tokens"]) for a in attempts] == [(11, 9),
                                                                                (11, 10)]
    assert attempts[0]["outcome"] != "ok" and attempts[1]["outcome"] == "ok"
    assert (step["prompt_tokens"], step["completion_tokens"]) == (22, 19)  # the total, once


async def test_spend_is_counted_once_per_request_and_per_step_attempt(aiohttp_client,
                                                                      aiohttp_server):
    """Item 2's cost accounting: (prompt + completion) / 1000 x the model's price, for a
    drop-in stream whose client did not ask for usage and for a workflow step."""
    fake = FakeUpstream([usage_when_stream_options()])
    client = await shared_backend_proxy(aiohttp_client, aiohttp_server, fake,
                                        {"up": {"price_per_1k_tokens": 2.0}})
    resp = await client.post("/v1/chat/completions", json={"model": "up", "stream": True,
                                                           "messages": MESSAGES})
    await resp.read()
    events = parse_sse(await (await client.post("/v1/workflows", json={
        "nodes": [_step("a", "hi")]})).text())
    assert events[-1][1]["status"] == "succeeded"
    metrics = await (await client.get("/metrics")).text()
    spend = next(line for line in metrics.splitlines()
                 if line.startswith('flowlift_spend_total{model="up"}'))
    assert float(spend.split()[-1]) == pytest.approx(2 * (5 + 2) / 1000 * 2.0)


async def test_N9_a_workflow_step_keeps_the_upstreams_message_and_is_not_retried(
        aiohttp_client, aiohttp_server):
    fake = FakeUpstream([FakeUpstream.json(SGLANG_400, 400)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    events = parse_sse(await (await client.post("/v1/workflows", json={
        "nodes": [_step("a", "hi")]})).text())
    assert events[-1][1]["status"] == "failed"
    assert SGLANG_400["message"] in json.dumps(events[-1][1]["failures"])
    assert len(fake.received) == 1


async def test_N3_empty_stream_options_on_the_embedded_engine(aiohttp_client, captured):
    app = create_app({"fake-model": FakeEngine(["fake-model"])})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    seen = []
    for options in (None, {}, {"include_usage": True}):
        body = {"model": "fake-model", "stream": True, "messages": MESSAGES} | (
            {} if options is None else {"stream_options": options})
        events = datas(await (await client.post("/v1/chat/completions", json=body)).text())
        seen.append([e for e in events if isinstance(e, dict) and e.get("usage")])
    assert seen[0] == [] and seen[1] == [] and len(seen[2]) == 1
    for span in await _span(captured, "chat fake-model", 3):
        assert span.attributes["gen_ai.usage.output_tokens"] > 0
        assert span.attributes["flowlift.usage.partial"] is False


async def test_a_backend_that_rejects_stream_options_can_be_left_unasked(aiohttp_client,
                                                                         aiohttp_server):
    fake = FakeUpstream([usage_when_stream_options()])
    client = await shared_backend_proxy(aiohttp_client, aiohttp_server, fake, {"up": {}},
                                        stream_usage=False)
    resp = await client.post("/v1/chat/completions", json={"model": "up", "stream": True,
                                                           "messages": MESSAGES})
    assert datas(await resp.text())[-1] == "[DONE]"
    assert "stream_options" not in fake.received[0].json()  # the body as the client sent it
