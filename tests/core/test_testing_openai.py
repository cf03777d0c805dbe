"""flowlift.testing.openai: the fake OpenAI provider (chat for standard and flex, the
Batch API) that the one-command tiers demo runs as a process."""

from __future__ import annotations

import json
import re
from typing import Any

from flowlift.testing import parse_sse
from flowlift.testing.openai import build, constrained_responder


def test_answers_follow_the_constraints_the_proxy_sends_upstream() -> None:
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
    assert json.loads(str(constrained_responder({"messages": [
        {"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "o", "schema": schema}}}))) == {
        "n": 1}
    labels = ["data formats", "networking", "math and algorithms"]
    picked = {constrained_responder({"messages": [
        {"role": "system", "content": f"Answer with exactly one of: {', '.join(labels)}. "
                                      "Nothing else."},
        {"role": "user", "content": f"module {i}"}]}) for i in range(12)}
    assert picked <= set(labels) and len(picked) > 1  # one of them, not always the first
    matched = constrained_responder({"messages": [
        {"role": "system", "content": "Answer with text that matches the regular "
                                      "expression [a-z]{3}[0-9] as a whole. Nothing else."},
        {"role": "user", "content": "go"}]})
    assert re.fullmatch("[a-z]{3}[0-9]", str(matched))
    assert constrained_responder({"messages": [{"role": "user", "content": "a b\nc d e"}],
                                  "stop": ["\n"], "max_tokens": 2}) == "echo: a"


async def test_chat_streams_with_usage_and_says_which_tier_served_it(
        aiohttp_client: Any) -> None:
    fake = build(time_scale=1000.0)
    client = await aiohttp_client(fake.app())
    body = {"model": "small", "messages": [{"role": "user", "content": "one two"}],
            "stream": True, "stream_options": {"include_usage": True},
            "service_tier": "flex"}
    events = [d for _, d in parse_sse(await (await client.post(
        "/v1/chat/completions", json=body)).text()) if isinstance(d, dict)]
    assert "".join(c["delta"].get("content", "") for e in events
                   for c in e["choices"]) == "echo: one two"
    assert events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                   "total_tokens": 5}
    assert {e["service_tier"] for e in events} == {"flex"}
    whole = await (await client.post("/v1/chat/completions", json={
        **body, "stream": False, "service_tier": None})).json()
    assert whole["service_tier"] == "default"
    assert whole["choices"][0]["message"]["content"] == "echo: one two"
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["small"]
    refused = await client.post("/v1/chat/completions", json={"model": "small"})
    assert refused.status == 400 and (await refused.json())["error"]["param"] == "messages"
    # the Batch API half is served by the same app
    assert (await client.get("/v1/batches")).status == 200
