"""OpenTelemetry spans: workflow runs (SDK and proxy in one trace, the stage split,
attempts), OpenAI API requests, W3C trace context in and out, streams (cases T1, T2),
export."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

from flowlift import workflow
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, capture_spans
from flowlift.tracing import AttemptTrace, RunTrace
from flowlift.tracing.run_spans import RunSpans
from flowlift.tracing.spans import JsonLinesSpanExporter, _otlp_exporter, proxy_tracer_provider
from tests.sdk.test_sdk_end_to_end import alookup, pipeline
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes, upstream_only_proxy

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CALLER_TRACE, CALLER_SPAN = int("0af7651916cd43dd8448eb211c80319c", 16), 0xb7ad6b7169203331
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def captured():
    with capture_spans() as cap:
        yield cap


@pytest.fixture
async def traced(aiohttp_client, captured):
    """(client, engine) of a proxy created inside ``capture_spans``."""
    engine = FakeEngine(["fake-model"])
    app = create_app({"fake-model": engine})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client, engine


async def _until(predicate, timeout_s: float = 3.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def run_span(captured, name: str):
    """The proxy's ``invoke_workflow {name}`` span (built off the loop once the run
    ended: wait for it)."""
    def found():
        return [s for s in captured.named(f"invoke_workflow {name}")
                if s.kind is SpanKind.SERVER]
    await _until(found)
    return found()[0]


def _within(child, parent) -> bool:
    return parent.start_time <= child.start_time <= child.end_time <= parent.end_time


async def test_sdk_and_proxy_spans_join_one_trace_with_the_stage_split(traced, captured):
    client, _ = traced
    base = str(client.make_url("")).rstrip("/")
    async with workflow("e2e", base_url=base) as wf:
        pipeline(["d1"], alookup)
    proxy_run = await run_span(captured, "e2e")
    spans = captured.spans
    assert len({s.context.trace_id for s in spans}) == 1  # one trace
    sdk_run = next(s for s in spans if s.name == "invoke_workflow e2e" and s.parent is None)
    assert sdk_run.kind is SpanKind.CLIENT
    assert proxy_run.parent.span_id == sdk_run.context.span_id
    assert proxy_run.attributes["flowlift.workflow.id"] == wf.run_id
    assert sdk_run.attributes["flowlift.workflow.id"] == wf.run_id
    steps = captured.children(proxy_run)
    assert sorted(s.name for s in steps) == ["chat fake-model"] * 3 + ["execute_tool alookup"]
    for step in steps:
        assert _within(step, proxy_run)
        assert step.attributes["flowlift.workflow.id"] == wf.run_id
        assert step.attributes["flowlift.step.id"]
    extract = next(s for s in steps if s.attributes["flowlift.step.id"] == "extract_1")
    a = extract.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.provider.name"]) == ("chat", "vllm")
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "fake-model"
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
    assert "gen_ai.usage.cache_read.input_tokens" in a
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    stages = captured.children(extract)
    assert [s.name for s in stages] == ["queue", "attempt 1", "validate"]
    assert [s.name for s in captured.children(stages[1])] == ["prefill", "decode"]
    assert stages[1].attributes["gen_ai.response.finish_reasons"] == ("stop",)
    for stage in [*stages, *captured.children(stages[1])]:
        assert _within(stage, extract)
        assert stage.attributes["flowlift.step.id"] == "extract_1"
    queue, attempt, validate = stages
    assert queue.end_time <= attempt.start_time and validate.start_time >= queue.end_time
    tool = next(s for s in steps if s.name == "execute_tool alookup")
    assert [c.name for c in captured.children(tool)] == ["tool_wait"]
    # the SDK ran the tool in its own span, a child of its workflow span
    sdk_tool = next(s for s in spans if s.name == "execute_tool alookup" and s is not tool)
    assert sdk_tool.parent.span_id == sdk_run.context.span_id
    assert _within(sdk_tool, sdk_run) and _within(proxy_run, sdk_run)
    # a dependent step starts after what it read finished: the chain is on the trace
    summarize = next(s for s in steps if s.attributes["flowlift.step.id"] == "summarize_1")
    assert summarize.start_time >= tool.end_time >= extract.end_time


async def test_sync_sdk_tool_spans_in_worker_threads_join_the_workflow_span(traced,
                                                                            captured):
    from tests.sdk.test_sdk_end_to_end import lookup

    client, _ = traced
    base = str(client.make_url("")).rstrip("/")

    def run():
        with workflow("sync", base_url=base) as wf:
            pipeline(["a", "b"], lookup)
        return wf

    wf = await asyncio.to_thread(run)
    await run_span(captured, "sync")
    sdk_run = next(s for s in captured.named("invoke_workflow sync")
                   if s.kind is SpanKind.CLIENT)
    tools = [s for s in captured.named("execute_tool lookup") if s.parent is not None
             and s.parent.span_id == sdk_run.context.span_id]
    assert len(tools) == 2 and {t.attributes["flowlift.workflow.id"] for t in tools} == {
        wf.run_id}


async def test_workflow_continues_the_callers_traceparent(traced, captured):
    client, _ = traced
    graph = {"name": "g", "nodes": [{"kind": "llm", "id": "a", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]}
    resp = await client.post("/v1/workflows", json=graph, headers={"traceparent": CALLER})
    await resp.text()
    run = await run_span(captured, "g")
    assert run.context.trace_id == CALLER_TRACE and run.parent.span_id == CALLER_SPAN
    assert run.parent.is_remote


async def test_failed_step_spans_carry_error_type(traced, captured):
    client, engine = traced
    engine.responder = lambda req: "not json"
    graph = {"name": "bad", "nodes": [
        {"kind": "llm", "id": "a", "messages": [{"role": "user", "content": [{"text": "x"}]}],
         "contract": {"json_schema": {"type": "object"}}},
        {"kind": "llm", "id": "b", "messages": [{"role": "user", "content": [
            {"ref": "a", "path": []}]}]}]}
    await (await client.post("/v1/workflows", json=graph)).text()
    run = await run_span(captured, "bad")
    assert run.status.status_code is StatusCode.ERROR
    assert run.attributes["error.type"] == "step_failed"
    by_id = {s.attributes["flowlift.step.id"]: s for s in captured.children(run)}
    assert by_id["a"].attributes["error.type"] == "contract_failed"
    assert by_id["b"].attributes["error.type"] == "upstream_step_failed"
    attempt = next(c for c in captured.children(by_id["a"]) if c.name == "attempt 1")
    assert attempt.attributes["flowlift.attempt.outcome"] == "contract_failed"


def test_every_attempt_is_a_child_span_and_retries_are_marked(captured):
    trace = RunTrace("wf-1", "cascade")
    st = trace.add_step("s", "llm", "s", "small")
    st.ready_ms, st.started_ms, st.first_token_ms = 0.0, 1.0, 5.0
    st.generated_ms, st.finished_ms, st.status, st.model = 30.0, 31.0, "done", "large"
    st.attempts = [AttemptTrace(1, "small", 1.0, 5.0, 12.0, "contract_failed", 9, 4, 0, "bad"),
                   AttemptTrace(2, "large", 13.0, 20.0, 31.0, "ok", 9, 6, 8)]
    trace.finish("succeeded")
    spans = RunSpans(captured.provider.get_tracer("t"), trace, None, lambda m: "vllm",
                     {"s": "small"})
    spans.close()
    step = captured.named("chat large")[0]
    assert step.attributes["gen_ai.request.model"] == "small"
    assert step.attributes["gen_ai.response.model"] == "large"
    first, second = (s for s in captured.children(step) if s.name.startswith("attempt"))
    assert first.status.status_code is StatusCode.ERROR
    assert first.attributes["error.type"] == "contract_failed"
    assert second.attributes["flowlift.retry"] is True
    assert second.attributes["gen_ai.request.model"] == "large"
    assert second.attributes["gen_ai.usage.cache_read.input_tokens"] == 8
    assert (second.start_time - first.end_time) == pytest.approx(1e6, abs=10)  # 1 ms apart


async def test_openai_request_span_continues_the_caller_and_goes_upstream(
        aiohttp_client, aiohttp_server, captured, monkeypatch):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "up"},
                             headers={"traceparent": CALLER, "X-Flowlift-Workflow": "wf-x",
                                      "X-Flowlift-Step": "draft"})
    assert resp.status == 200
    span = captured.named("chat up")[0]
    assert span.kind is SpanKind.SERVER
    assert span.context.trace_id == CALLER_TRACE and span.parent.span_id == CALLER_SPAN
    sent = fake.received[0].headers["traceparent"].split("-")
    assert int(sent[1], 16) == CALLER_TRACE and int(sent[2], 16) == span.context.span_id
    a = span.attributes
    assert a["gen_ai.provider.name"] == "openai" and a["gen_ai.response.model"] == "up-model"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (3, 1)
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert (a["flowlift.workflow.id"], a["flowlift.step.id"]) == ("wf-x", "draft")
    assert span.attributes["flowlift.routing_ms"] > 0 and not captured.children(span)


async def test_upstream_workflow_step_sends_the_runs_span_upstream(
        aiohttp_client, aiohttp_server, captured):
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(
        chunk({"content": "hi"}), chunk({}, "stop"),
        {**chunk(), "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}))])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    graph = {"name": "u", "nodes": [{"kind": "llm", "id": "a", "model": "up", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]}
    await (await client.post("/v1/workflows", json=graph)).text()
    run = await run_span(captured, "u")
    sent = fake.received[0].headers["traceparent"].split("-")
    assert int(sent[1], 16) == run.context.trace_id and int(sent[2], 16) == run.context.span_id
    step = captured.children(run)[0]
    assert step.kind is SpanKind.CLIENT and step.attributes["gen_ai.provider.name"] == "openai"


async def test_T1_stream_span_stays_open_until_the_stream_is_exhausted(traced, captured):
    client, engine = traced
    engine.delay_s, engine.chunk_chars = 0.02, 4
    engine.responder = lambda req: "one two three four five six seven eight"
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    body = await resp.text()
    read_at = time.time_ns()
    assert body.rstrip().endswith("data: [DONE]")
    span = captured.named("chat fake-model")[0]
    assert span.end_time <= read_at + 50_000_000
    assert (span.end_time - span.start_time) / 1e9 >= 10 * 0.02  # ten chunks, 20 ms each
    a = span.attributes
    assert a["flowlift.outcome"] == "complete" and a["flowlift.usage.partial"] is False
    assert a["gen_ai.usage.output_tokens"] == 8 and a["gen_ai.response.finish_reasons"] == (
        "stop",)
    assert {"flowlift.queue_ms", "flowlift.prefill_ms"} <= set(a)
    assert a["flowlift.decode_ms"] >= 8 * 20  # first to last chunk
    (first,) = span.events
    assert first.name == "first_token" and span.start_time < first.timestamp < span.end_time


async def test_T1_forwarded_stream_span_ends_at_done_with_the_upstreams_usage(
        aiohttp_client, aiohttp_server, captured):
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 4}}
    pieces = sse_bytes(*[chunk({"content": f"w{i} "}) for i in range(3)], chunk({}, "stop"),
                       {**chunk(), "choices": [], "usage": usage})
    fake = FakeUpstream([FakeUpstream.stream(pieces, gap_s=0.03)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    resp = await client.post("/v1/chat/completions", headers={"X-Flowlift-Workflow": "wf-s"},
                             json={**CHAT, "model": "up", "stream": True})
    assert (await resp.text()).rstrip().endswith("data: [DONE]")
    span = captured.named("chat up")[0]
    assert (span.end_time - span.start_time) / 1e9 >= 5 * 0.03  # open for the whole stream
    a = span.attributes
    assert a["flowlift.outcome"] == "complete" and a["flowlift.stream.events"] == 6
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"],
            a["gen_ai.usage.cache_read.input_tokens"]) == (7, 3, 4)
    assert a["gen_ai.response.model"] == "up-model"
    assert a["flowlift.workflow.id"] == "wf-s" and a["flowlift.decode_ms"] >= 3 * 30


async def test_T2_abandoned_stream_ends_its_span_with_partial_usage(traced, captured):
    client, engine = traced
    engine.delay_s, engine.chunk_chars = 0.01, 6
    full = " ".join(f"word{i}" for i in range(200))
    engine.responder = lambda req: full
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    got = b""
    while got.count(b"data:") < 6:
        got += await resp.content.readany()
    resp.close()  # the client stops reading halfway and drops the connection
    await _until(lambda: captured.named("chat fake-model"))
    span = captured.named("chat fake-model")[0]
    a = span.attributes
    assert a["flowlift.outcome"] == "abandoned" and a["flowlift.usage.partial"] is True
    assert 0 < a["gen_ai.usage.output_tokens"] < 200
    assert span.status.status_code is not StatusCode.ERROR  # the client left; no failure
    await _until(lambda: engine.aborted)  # and the generation was stopped
    assert engine.running() == 0


async def test_T2_abandoned_upstream_stream_ends_its_span(aiohttp_client, aiohttp_server,
                                                          captured):
    pieces = sse_bytes(*[chunk({"content": f"w{i} "}) for i in range(50)], chunk({}, "stop"))
    fake = FakeUpstream([FakeUpstream.stream(pieces, gap_s=0.01)])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    resp = await client.post("/v1/chat/completions",
                             json={**CHAT, "model": "up", "stream": True})
    got = b""
    while got.count(b"data:") < 5:
        got += await resp.content.readany()
    resp.close()
    await _until(lambda: captured.named("chat up"))
    a = captured.named("chat up")[0].attributes
    assert a["flowlift.outcome"] == "abandoned" and 5 <= a["flowlift.stream.events"] < 51


async def test_tracing_failures_never_reach_the_request(traced, captured, monkeypatch):
    client, engine = traced
    engine.delay_s = 0.01
    engine.responder = lambda req: " ".join(["w"] * 100)

    def broken(*_):
        raise RuntimeError("tokenizer gone")
    monkeypatch.setattr(engine, "count_tokens", broken)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    await resp.content.readany()
    resp.close()
    await _until(lambda: captured.named("chat fake-model"))  # the span still ended
    engine.delay_s = 0.0
    ok = await client.post("/v1/chat/completions", json=CHAT)
    assert ok.status == 200


def test_jsonl_exporter_failure_is_reported_not_raised(tmp_path, captured):
    (tmp_path / "file").write_text("")
    exporter = JsonLinesSpanExporter(tmp_path / "file" / "spans.jsonl")  # a file as a dir
    with captured.provider.get_tracer("t").start_as_current_span("x"):
        pass
    assert exporter.export(captured.spans) is SpanExportResult.FAILURE


def test_exporter_choice_follows_the_otel_environment(tmp_path):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as Grpc,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    assert _otlp_exporter({}) is None
    assert isinstance(_otlp_exporter({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}), Http)
    assert isinstance(_otlp_exporter({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                                      "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}), Grpc)
    provider = proxy_tracer_provider(tmp_path, env={})
    (processor,) = provider._active_span_processor._span_processors
    assert isinstance(processor, BatchSpanProcessor)  # export in the background
    assert isinstance(processor.span_exporter, JsonLinesSpanExporter)
    provider.shutdown()


async def test_spans_go_to_json_lines_in_the_trace_dir_by_default(tmp_path, monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    app = create_app({"fake-model": FakeEngine(["fake-model"])},
                     ProxyConfig(trace_dir=tmp_path))
    client = TestClient(TestServer(app))
    await client.start_server()
    await app[STATE].ready.wait()
    await (await client.post("/v1/chat/completions", json=CHAT)).read()
    await client.close()  # app shutdown flushes the batch processor
    lines = [json.loads(x) for x in (tmp_path / "spans.jsonl").read_text().splitlines()]
    (server,) = (x for x in lines if x["kind"] == "SERVER")
    assert server["name"] == "chat fake-model" and server["service"] == "flowlift-proxy"
    assert server["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
    assert [e["name"] for e in server["events"]] == ["first_token"]
    assert server["end_time_unix_nano"] > server["start_time_unix_nano"] > 0


async def test_spans_go_to_an_otlp_collector_when_configured(aiohttp_server, tmp_path):
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    got: list[bytes] = []

    async def collect(request: web.Request) -> web.Response:
        got.append(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")
    collector = web.Application()
    collector.router.add_post("/v1/traces", collect)
    server = await aiohttp_server(collector)
    provider = proxy_tracer_provider(None, env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": str(server.make_url("/")).rstrip("/")})
    assert isinstance(provider, TracerProvider)
    app = create_app({"fake-model": FakeEngine(["fake-model"])}, tracer_provider=provider)
    client = TestClient(TestServer(app))
    await client.start_server()
    await app[STATE].ready.wait()
    await (await client.post("/v1/chat/completions", json=CHAT)).read()
    await client.close()
    await asyncio.to_thread(provider.shutdown)  # not the app's: shut down here
    names = set()
    for body in got:
        req = ExportTraceServiceRequest.FromString(body)
        names |= {s.name for r in req.resource_spans for ss in r.scope_spans for s in ss.spans}
    assert "chat fake-model" in names
