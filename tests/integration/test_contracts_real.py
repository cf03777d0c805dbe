"""Regex contracts, confidence from real token logprobs and escalation, on the real vLLM
engine (the session's one engine; see conftest)."""

from __future__ import annotations

import re

import pytest

from flowlift import Regex, step, workflow

pytestmark = pytest.mark.engine

VERSION = r"[0-9]\.[0-9]{1,2}"


def test_regex_contract_and_confidence_escalation_on_vllm(real_proxy):
    model = real_proxy["model"]

    @step(output=Regex(VERSION), max_tokens=8, retries=1)
    def version(text):
        return f"Which Python version does this note name? {text} Answer with the number."

    # a floor no real output reaches: the first model's label escalates to the second
    # name of the cascade ("default", the same engine), which keeps its answer
    @step(model=[model, "default"], output=re.compile("yes|no"), max_tokens=4,
          min_confidence=0.9999)
    def answer(text):
        return f"Is this note about Python? {text} Answer yes or no."

    note = "Python 3.11 added the tomllib module to the standard library."
    with workflow("it-contracts", base_url=real_proxy["base_url"]) as wf:
        v, a = version(note), answer(note)
    assert wf.status == "succeeded", wf.failures
    assert re.fullmatch(VERSION, v.value)  # vLLM's regex-constrained decoding
    assert a.value in ("yes", "no")
    steps = {r["step_id"]: r for r in wf.trace if r.get("type") == "step"}
    tries = steps[a.step_id]["attempts"]
    assert [t["model"] for t in tries] == [model, "default"]
    assert tries[0]["outcome"] == "low_confidence" and tries[1]["outcome"] == "ok"
    assert 0.0 < tries[0]["confidence"] < 0.9999  # exp(mean logprob) from vLLM
    assert all(t["completion_tokens"] > 0 for t in tries)
