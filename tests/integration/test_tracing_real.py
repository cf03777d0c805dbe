"""Tracing and metrics on the real vLLM engine (the session's proxy): an abandoned stream
(case T2) ends its span with output tokens counted by the model's own tokenizer, and
``/metrics`` parses with prometheus_client's parser."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.engine


def _samples(base: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_T2_real_engine_abandoned_stream_span_and_metrics(real_proxy):
    base, model = real_proxy["base_url"], real_proxy["model"]
    body = {"model": model, "max_tokens": 200, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Count from one to one hundred."}]}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        got = b""
        for piece in r.iter_raw():
            got += piece
            if got.count(b"data:") >= 6:
                break  # leave halfway: the block closes the connection
    key = ("flowlift_openai_requests_total", (("operation", "chat"), ("outcome", "abandoned")))
    deadline = time.monotonic() + 30
    while _samples(base).get(key, 0) < 1:
        assert time.monotonic() < deadline, "the abandoned request was never counted"
        time.sleep(0.2)
    samples = _samples(base)
    ttft = ("gen_ai_server_time_to_first_token_seconds_count",
            (("model", model), ("source", "openai")))
    assert samples[ttft] >= 1
    assert ("flowlift_queue_depth", (("backend", "engine-0"), ("class", "interactive"))) \
        in samples
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return  # the spans go to that collector, not to the trace dir
    spans = real_proxy["trace_dir"] / "spans.jsonl"
    deadline = time.monotonic() + 15  # the batch processor writes every 5 s
    abandoned: list[dict] = []
    while not abandoned:
        assert time.monotonic() < deadline, "no abandoned span was exported"
        time.sleep(0.5)
        if spans.exists():
            lines = [json.loads(x) for x in spans.read_text().splitlines()]
            abandoned = [x for x in lines if x["attributes"].get("flowlift.outcome")
                         == "abandoned"]
    a = abandoned[-1]["attributes"]
    assert a["gen_ai.provider.name"] == "vllm" and a["flowlift.usage.partial"] is True
    assert 0 < a["gen_ai.usage.output_tokens"] < 200
