"""The Responses API on the real embedded engine (issue 25), with the official ``openai``
client: ``create``, ``previous_response_id`` (the second turn sends only its new input;
the engine's prefix cache serves the stored conversation: vLLM caches whole 128-token
blocks, so the instructions are long enough to fill some), ``stream``, a forced
function call and its output, ``retrieve`` and ``delete``."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.engine

INSTRUCTIONS = ("You are a terse assistant for a travel desk. " * 30).strip()
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


@pytest.fixture
def oa(real_proxy: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_proxy['base_url']}/v1", api_key="k",
                         max_retries=0, timeout=300)


def test_a_conversation_continues_by_id_and_reuses_its_cached_prefix(oa, real_proxy):
    model = real_proxy["model"]
    first = oa.responses.create(model=model, instructions=INSTRUCTIONS, input="Say hello.",
                                max_output_tokens=8, temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text
    second = oa.responses.create(model=model, instructions=INSTRUCTIONS,
                                 input="Now say goodbye.", max_output_tokens=8,
                                 temperature=0, previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens  # the history came along
    assert second.usage.input_tokens_details.cached_tokens >= 128
    assert oa.responses.retrieve(second.id).previous_response_id == first.id
    with oa.responses.stream(model=model, input="Count to three.", max_output_tokens=8,
                             temperature=0, previous_response_id=second.id) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert "response.output_text.delta" in kinds and final.usage.output_tokens > 0
    oa.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(first.id)


def test_a_forced_function_call_and_its_output(oa, real_proxy):
    model = real_proxy["model"]
    call_turn = oa.responses.create(model=model, input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, temperature=0)
    calls = [o for o in call_turn.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments), dict)
    answer = oa.responses.create(
        model=model, previous_response_id=call_turn.id, tools=[WEATHER],
        tool_choice="none", max_output_tokens=16, temperature=0,
        input=[{"type": "function_call_output", "call_id": c.call_id,  # every call's
                "output": "sunny, 21 C"} for c in calls])  # (one left out: a 400)
    assert answer.output_text
