"""End to end on the real proxy + vLLM CPU engine + SmolLM2-135M-Instruct.

Greedy decoding, so outputs are stable, but tests assert shapes and contracts, not
exact text (float32 vs bf16 and kernel choices change tokens).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field, StringConstraints

from flowlift import GraphError, step, tool, workflow

pytestmark = pytest.mark.engine

Short = Annotated[str, StringConstraints(max_length=24)]
PREAMBLE = ("You are a careful assistant that reads short technical notes about Python "
            "modules and answers briefly and precisely. ")


class Note(BaseModel):
    module: Short
    purpose: str = Field(max_length=80)


@step(output=Note, max_tokens=64)
def extract(text):
    return [{"role": "system", "content": PREAMBLE},
            {"role": "user", "content": f"Return JSON with the module name and its purpose.\n"
                                        f"Note: {text}"}]


@step(output=Literal["data formats", "networking", "math"], max_tokens=8)
def classify(note):
    return [{"role": "system", "content": PREAMBLE},
            {"role": "user", "content": f"Which area fits best? {note.purpose}"}]


@tool
def related(note: Note, area: str):
    return {"module": note.module, "area": area, "see_also": ["csv", "pickle"]}


@step(max_tokens=24)
def summarize(note, area, rel):
    return [{"role": "system", "content": PREAMBLE},
            {"role": "user", "content": f"In one sentence: {note.module} ({area}); see {rel}."}]


NOTES = ["The json module encodes and decodes JSON, a lightweight data interchange format.",
         "The socket module gives access to the BSD socket interface for networking."]


def test_small_workflow_end_to_end(real_proxy, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with workflow("it-small", base_url=real_proxy["base_url"], trace_path=trace) as wf:
        outs = []
        for text in NOTES:
            note = extract(text)
            area = classify(note)
            outs.append((note, area, summarize(note, area, related(note, area))))
    assert wf.status == "succeeded", wf.failures
    for note, area, summary in outs:
        assert isinstance(note.value, Note)
        assert area.value in ("data formats", "networking", "math")
        assert isinstance(summary.value, str) and summary.value.strip()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    llm_steps = [r for r in records if r["type"] == "step" and r["kind"] == "llm"]
    assert len(llm_steps) == 6
    assert all(r["model"] == real_proxy["model"] and r["completion_tokens"] > 0
               for r in llm_steps)
    assert all({"queue", "prefill", "decode", "validate"} <= set(r["stages_ms"])
               for r in llm_steps)
    # the proxy wrote the same run's trace on its side
    assert (real_proxy["trace_dir"] / f"{wf.run_id}.jsonl").exists()


def test_openai_client_plain_and_streaming(real_proxy):
    client = openai.OpenAI(base_url=real_proxy["base_url"] + "/v1", api_key="unused",
                           max_retries=0)
    model = real_proxy["model"]
    assert [m.id for m in client.models.list().data] == [model]
    msgs = [{"role": "user", "content": "Say hello in three words."}]
    out = client.chat.completions.create(model=model, messages=msgs, max_tokens=12,
                                         temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens <= 12
    assert out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content  # greedy: same text both ways
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_prefix_cache_is_reported(real_proxy):
    client = openai.OpenAI(base_url=real_proxy["base_url"] + "/v1", api_key="unused",
                           max_retries=0)
    shared = PREAMBLE * 8
    usages = []
    for question in ("What is JSON?", "What is a socket?"):
        out = client.chat.completions.create(
            model=real_proxy["model"], max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": shared},
                      {"role": "user", "content": question}])
        usages.append(out.usage)
    assert usages[1].prompt_tokens_details.cached_tokens >= 100


def test_structured_output_on_real_engine(real_proxy):
    client = openai.OpenAI(base_url=real_proxy["base_url"] + "/v1", api_key="unused",
                           max_retries=0)
    schema = Note.model_json_schema()
    out = client.chat.completions.create(
        model=real_proxy["model"], max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Describe the csv module as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "note", "schema": schema}})
    Note.model_validate_json(out.choices[0].message.content)


def test_bad_input_gets_4xx_and_the_proxy_keeps_serving(real_proxy):
    base = real_proxy["base_url"]
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": real_proxy["model"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{base}/v1/workflows", json={"nodes": [
        {"kind": "llm", "id": "a", "messages": [{"role": "user", "content": [{"ref": "b"}]}]},
        {"kind": "llm", "id": "b", "messages": [{"role": "user", "content": [{"ref": "a"}]}]}]})
    assert r.status_code == 400 and "cycle" in r.json()["error"]["message"]
    too_long = "word " * 6000
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": real_proxy["model"], "max_tokens": 4,
        "messages": [{"role": "user", "content": too_long}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"

    @step(model="no-such-model")
    def bad():
        return "x"

    with pytest.raises(GraphError, match="unknown model"), workflow("bad", base_url=base):
        bad()
    ok = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": real_proxy["model"], "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert ok.status_code == 200


def test_tool_call_logprobs_and_raw_prompt_on_real_engine(real_proxy):
    """OpenAI parity of the embedded engine on vLLM: a constrained tool call, chat
    logprobs (greedy: the sampled token ranks first) and a legacy completion of a raw
    prompt (no chat template: a handful of prompt tokens)."""
    client = openai.OpenAI(base_url=real_proxy["base_url"] + "/v1", api_key="unused",
                           max_retries=0)
    model = real_proxy["model"]
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 24}}}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.chat.completions.create(model=model, messages=ask, tools=[weather],
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=64, temperature=0)
    calls = out.choices[0].message.tool_calls
    assert calls and len(calls) == 1, out.model_dump_json()
    assert out.choices[0].finish_reason == "tool_calls" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
    # parallel calls allowed: a small model may repeat them until max_tokens; the
    # complete ones are kept
    out = client.chat.completions.create(model=model, messages=ask, tools=[weather],
                                         tool_choice="required", max_tokens=40,
                                         temperature=0)
    calls = out.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather", out.model_dump_json()

    # streamed: an opening entry, then the arguments in pieces as vLLM decodes them;
    # the SDK's stream helper adds them up to the call the request got unstreamed
    once = dict(model=model, messages=ask, tools=[weather], tool_choice="required",
                parallel_tool_calls=False, max_tokens=64, temperature=0)
    whole = client.chat.completions.create(**once).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(**once) as stream:
        pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in final] == \
        [(whole.function.name, whole.function.arguments)]
    assert len(pieces) > 1 and "".join(p.arguments_delta for p in pieces) == \
        whole.function.arguments

    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count from 1 to 20."}],
        logprobs=True, top_logprobs=3, max_tokens=8, temperature=0)
    tokens = out.choices[0].logprobs.content
    assert len(tokens) == out.usage.completion_tokens, out.model_dump_json()
    content = out.choices[0].message.content
    assert "".join(t.token for t in tokens)[:len(content)] == content
    for t in tokens:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0

    comp = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=6, temperature=0, logprobs=2)
    choice = comp.choices[0]
    assert choice.text and len(choice.logprobs.tokens) == comp.usage.completion_tokens, (
        comp.model_dump_json())
    assert comp.usage.prompt_tokens < 10  # the raw prompt, not a chat-templated one
