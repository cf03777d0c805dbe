"""The contract with llm-d's gateway, against a fake upstream that answers as llm-d's
endpoint picker does (issue 37 item 4): every answer sets the ``llm-d-session`` cookie
pinning its session to a pod. With the ``llm-d`` hints, each request names its own
session (``x-session-id``, for llm-d's ``session-id-producer``), its program as the
fairness id and its class as the objective; no request ever carries a cookie, so no
session and no tenant is pinned to another's pod."""

from __future__ import annotations

from typing import Any

from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse
from tests.upstream_fake import FakeUpstream, chat_answer

LLMD = {"x-session-id", "x-llm-d-inference-fairness-id", "x-llm-d-inference-objective",
        "cookie"}


async def test_llm_d_headers_and_no_cookie(aiohttp_client, aiohttp_server):
    fake = FakeUpstream([chat_answer("ok", cookie=("llm-d-session", "pod-7"))])
    server = await aiohttp_server(fake.app())
    app = create_app({}, file_config=parse_config({  # a host name: the jar would keep it
        "backends": {"gw": {"kind": "openai", "hints": ["llm-d"],
                            "base_url": f"http://localhost:{server.port}/v1"}},
        "models": {"m": {"backends": ["gw"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    for session in ("tenant-a:s1", "tenant-b:s2", "tenant-a:s1"):
        resp = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Flowlift-Session": session})
        assert resp.status == 200, await resp.text()

    def step(name: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"kind": "llm", "id": name, "model": "m", "params": {"max_tokens": 8},
                "messages": [{"role": "user", "content": content}]}
    resp = await client.post("/v1/workflows", json={"workflow_class": "batch", "nodes": [
        step("a", [{"text": "x"}]), step("b", [{"ref": "a"}])]})
    run_id = next(d for e, d in parse_sse(await resp.text())
                  if e == "run.finished")["run_id"]

    seen = [{k.lower(): v for k, v in r.headers.items() if k.lower() in LLMD}
            for r in fake.received]
    assert seen == [
        {"x-session-id": "tenant-a:s1", "x-llm-d-inference-fairness-id": "tenant-a:s1"},
        {"x-session-id": "tenant-b:s2", "x-llm-d-inference-fairness-id": "tenant-b:s2"},
        {"x-session-id": "tenant-a:s1", "x-llm-d-inference-fairness-id": "tenant-a:s1"},
        *[{"x-session-id": run_id, "x-llm-d-inference-fairness-id": run_id,
           "x-llm-d-inference-objective": "batch"}] * 2]
