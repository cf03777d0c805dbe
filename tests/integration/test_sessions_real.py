"""Case W5 on the real engine: turn N+1 of an agent session repeats turn N's prompt plus
the model's answer, and the engine's cached prefix covers the answer's tokens too.

vLLM caches whole blocks only (128 tokens on the CPU build), so the first turn's prompt
is padded to end a few tokens before a block boundary: the boundary then falls inside
the answer, and turn 2 can only report that block as cached if the answer's tokens,
as the chat template writes them back, match the tokens the engine generated.
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.engine

BLOCK = 128  # vLLM CPU's KV block size (prefix caching works in whole blocks)
BEFORE_BOUNDARY = 8  # prompt tokens short of a block boundary; the answer crosses it


def _chat(base: str, model: str, messages: list[dict[str, str]], max_tokens: int,
          session: str) -> tuple[str, dict[str, Any]]:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=300,
                   headers={"X-Flowlift-Session": session},
                   json={"model": model, "messages": messages, "max_tokens": max_tokens,
                         "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def _padded_system(base: str, model: str, user: str) -> list[dict[str, str]]:
    """System + user messages whose prompt ends ``BEFORE_BOUNDARY`` tokens short of a
    block boundary (measured with 1-token requests in a throwaway session)."""
    head = f"[{secrets.token_hex(6)}] You are an agent. Answer with a long numbered list."
    pad = 0
    for _ in range(4):
        msgs = [{"role": "system", "content": head + " ok" * pad},
                {"role": "user", "content": user}]
        _, usage = _chat(base, model, msgs, 1, f"probe-{secrets.token_hex(4)}")
        n = usage["prompt_tokens"]
        target = (n + BEFORE_BOUNDARY) // BLOCK * BLOCK + BLOCK - BEFORE_BOUNDARY \
            if (n + BEFORE_BOUNDARY) % BLOCK else n
        if n == target:
            return msgs
        pad += target - n
    pytest.fail(f"could not pad the prompt to {BEFORE_BOUNDARY} tokens before a block")


def test_w5_next_turn_reuses_the_previous_answer(real_proxy):
    base, model = real_proxy["base_url"], real_proxy["model"]
    session = f"w5-{secrets.token_hex(4)}"
    messages = _padded_system(base, model, "List the numbers from 1 to 40, one per line.")
    answer, first = _chat(base, model, messages, 24, session)
    assert first["completion_tokens"] > BEFORE_BOUNDARY + 4, answer  # crosses the boundary
    boundary = first["prompt_tokens"] + BEFORE_BOUNDARY
    messages = [*messages, {"role": "assistant", "content": answer},
                {"role": "user", "content": "Tool result: ok. Now continue the list."}]
    _, second = _chat(base, model, messages, 4, session)
    cached = second["prompt_tokens_details"]["cached_tokens"]
    # The block that holds the prompt's end and the answer's first tokens is reused: the
    # answer's tokens were cached and the template wrote them back identically.
    assert cached >= boundary > first["prompt_tokens"], (first, second)

    r = httpx.get(f"{base}/v1/sessions/{session}", timeout=30)
    if r.status_code == 404 and r.json()["error"].get("code") != "session_not_found":
        return  # the proxy does not serve the session route
    assert r.status_code == 200, r.text
    turns = r.json()["turns"]
    assert [t["cached_tokens"] for t in turns] == [
        first["prompt_tokens_details"]["cached_tokens"], cached]
    assert turns[1]["previous_answer_cached_tokens"] >= BEFORE_BOUNDARY
