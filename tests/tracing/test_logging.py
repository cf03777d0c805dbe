"""structlog JSON logs: the workflow, step and trace ids on each line; secrets never."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, capture_spans
from flowlift.tracing import configure_logging, get_logger
from flowlift.tracing.logging import REDACTED, RedactSecrets
from tests.tracing.test_tracing import run_span
from tests.upstream_fake import FakeUpstream, chat_json

UPSTREAM_KEY, PROXY_KEY = "sk-upstream-0123456789", "sk-proxy-abcdefgh"


@pytest.fixture
def log_lines():
    """Configure the real JSON logging into a buffer; returns a reader of parsed lines."""
    out = io.StringIO()
    configure_logging("info", secrets={UPSTREAM_KEY, PROXY_KEY}, file=out,
                      cache_loggers=False)
    yield lambda: [json.loads(x) for x in out.getvalue().splitlines()]
    structlog.reset_defaults()


async def test_secrets_never_reach_the_log(aiohttp_client, aiohttp_server, monkeypatch,
                                           log_lines):
    monkeypatch.setenv("UP_KEY", UPSTREAM_KEY)
    monkeypatch.setenv("PROXY_KEYS", PROXY_KEY)
    fake = FakeUpstream([FakeUpstream.json({"error": {"message": "boom"}}, status=500),
                         FakeUpstream.json(chat_json())])
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    file_config = parse_config({
        "server": {"api_keys_env": "PROXY_KEYS"},
        "backends": {"r0": {"kind": "openai", "base_url": url, "api_key_env": "UP_KEY"}},
        "models": {"up": {"backends": ["r0"]}}})
    assert file_config.secrets() == {UPSTREAM_KEY, PROXY_KEY}
    app = create_app({"fake-model": FakeEngine(["fake-model"])},
                     ProxyConfig(api_keys=file_config.proxy_keys()), file_config=file_config)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    resp = await client.post("/v1/chat/completions", json={
        "model": "up", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Flowlift-Workflow": "wf-logs",
                 "X-Flowlift-Step": "ask"})
    assert resp.status == 200  # after one failed attempt (logged), a retry answered
    log = get_logger("test")
    log.warning("careless", headers={"Authorization": f"Bearer {PROXY_KEY}"},
                api_key=UPSTREAM_KEY, note=f"key was {UPSTREAM_KEY}",
                auth_header=f"Bearer {'x' * 20}")
    try:
        raise RuntimeError(f"upstream said no to {UPSTREAM_KEY}")
    except RuntimeError:
        log.exception("failed_with_secret_in_message")
    text = "\n".join(json.dumps(line) for line in log_lines())
    assert UPSTREAM_KEY not in text and PROXY_KEY not in text and "x" * 20 not in text
    lines = {line["event"]: line for line in log_lines()}
    careless = lines["careless"]
    assert careless["headers"]["Authorization"] == careless["api_key"] == REDACTED
    assert careless["note"] == f"key was {REDACTED}"
    assert REDACTED in lines["failed_with_secret_in_message"]["exception"]
    attempt = lines["upstream_attempt_failed"]  # the proxy's own line, with the ids
    assert (attempt["workflow_id"], attempt["step_id"]) == ("wf-logs", "ask")
    assert attempt["backend"] == "r0" and attempt["level"] == "info"


async def test_log_lines_carry_the_trace_and_span_ids(aiohttp_client, log_lines):
    with capture_spans() as captured:
        engine = FakeEngine(["fake-model"], fail_with=RuntimeError("engine broke"))
        app = create_app({"fake-model": engine})
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        graph = {"name": "t", "nodes": [{"kind": "llm", "id": "a", "messages": [
            {"role": "user", "content": [{"text": "x"}]}]}]}
        await (await client.post("/v1/workflows", json=graph)).text()
        await run_span(captured, "t")
    line = next(x for x in log_lines() if x["event"] == "step_error")
    run = await run_span(captured, "t")
    assert line["workflow_id"] == run.attributes["flowlift.workflow.id"]
    assert line["step_id"] == "a"
    assert line["trace_id"] == format(run.context.trace_id, "032x")
    assert line["span_id"] == format(run.context.span_id, "016x")


def test_redactor_masks_names_values_and_nesting():
    redact = RedactSecrets(["hunter22", "abc"])  # under 4 characters: not a secret
    event = redact(None, "info", {"event": "x", "password": "p", "cookie": "c",
                                  "nested": [{"token": "t"}, "say hunter22"], "plain": "abc"})
    assert event == {"event": "x", "password": REDACTED, "cookie": REDACTED,
                     "nested": [{"token": REDACTED}, f"say {REDACTED}"], "plain": "abc"}
