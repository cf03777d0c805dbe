"""The ``vllm-priority`` hint against a real vLLM OpenAI server (the CPU build, the default
model): a server started with ``--scheduling-policy priority`` serves a workflow whose
steps carry flowlift's order as ``priority``, and one started without it takes a
non-zero ``priority`` and ignores it (vLLM 0.32). Each server start takes 20-60 s here;
run under ``flock /tmp/bench.lock`` with ``FLOWLIFT_CACHE_DIR`` set."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from flowlift.local_engine.models import cache_dir
from flowlift.proxy import create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import parse_sse

pytestmark = pytest.mark.engine
MODEL = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(policy: str) -> Iterator[str]:
    model_dir = cache_dir() / "models" / MODEL
    if not (model_dir / "config.json").is_file():
        pytest.skip(f"the default model is not converted yet ({model_dir}); run flowlift once")
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache_dir() / "torchinductor")}
    proc = subprocess.Popen(
        # the API server module, not the `vllm` CLI: the CLI asks the metadata of a
        # package named vllm, and the CPU build's is vllm-cpu
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(model_dir), "--served-model-name", "m", "--host",
         "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "1024", "--scheduling-policy", policy],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited: {proc.stderr.read().decode()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("vllm serve did not become healthy in 420 s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def priority_server() -> Iterator[str]:
    yield from _serve("priority")


@pytest.fixture
def fcfs_server() -> Iterator[str]:
    yield from _serve("fcfs")


def _chat(priority: int) -> dict:
    return {"model": "m", "max_tokens": 4, "temperature": 0.0, "priority": priority,
            "messages": [{"role": "user", "content": "Say hi."}]}


def test_a_server_without_the_priority_policy_takes_and_ignores_a_priority(fcfs_server):
    """vLLM 0.32 (the V1 engine) answers a non-zero ``priority`` on an ``fcfs`` server
    (measured here), although the field's description says it "will raise an error"
    (the V0 engine's behaviour). The hint stays opt-in for the other OpenAI-compatible
    servers, which may reject a field they do not know."""
    for priority in (0, -5, 7):
        answer = httpx.post(f"{fcfs_server}/v1/chat/completions", json=_chat(priority),
                            timeout=120)
        assert answer.status_code == 200, answer.text


async def test_a_workflow_runs_on_a_priority_server_with_the_hint(priority_server,
                                                                  aiohttp_client):
    sent: list[dict] = []

    class Recording(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            sent.append(json.loads(await request.aread()))  # a stream: read it once
            return await super().handle_async_request(request)

    app = create_app({}, file_config=parse_config({
        "backends": {"vllm": {"kind": "openai", "base_url": f"{priority_server}/v1",
                              "hints": ["vllm-priority"], "first_token_timeout_s": 300}},
        "models": {"m": {"backends": ["vllm"]}}}), transport=Recording())
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    graph = {"nodes": [
        {"kind": "llm", "id": "a", "model": "m", "params": {"max_tokens": 4},
         "messages": [{"role": "user", "content": [{"text": "Name a colour."}]}]},
        {"kind": "llm", "id": "b", "model": "m", "params": {"max_tokens": 4},
         "messages": [{"role": "user", "content": [{"text": "Repeat: "}, {"ref": "a"}]}]}]}
    events = parse_sse(await (await client.post("/v1/workflows", json=graph)).text())
    finished = [d for e, d in events if e == "run.finished"]
    assert finished and finished[0]["status"] == "succeeded", events
    priorities = [body["priority"] for body in sent]
    assert len(priorities) == 2 and priorities[0] < priorities[1] < 0
