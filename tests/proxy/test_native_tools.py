"""The tool-call format per model (issue 34, item 1): a model whose ``tool_format`` is
``"native"`` gets its tools through its own chat template and its calls read by vLLM's
parser; a call written as JSON in the content is taken as the call or refused (the turn
runs again constrained), never passed on as the answer; a request that demands a call
is constrained. One path for chat completions, the Responses API and agent steps
(:class:`flowlift.testing.native.QwenStyleFakeEngine`: a Qwen-style template, vLLM's
``hermes`` parser)."""

from __future__ import annotations

import json

import pytest

from flowlift import step, tool, workflow
from flowlift.local_engine.base import ToolDef
from flowlift.proxy import create_app
from flowlift.proxy.state import STATE
from flowlift.proxy.wire.content_calls import fragment, no_answer, recognise, undecided
from flowlift.sdk.agents import tool_spec
from flowlift.testing.native import QwenStyleFakeEngine

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the docs.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}}]
MESSAGES = [{"role": "system", "content": "You answer questions about Python."},
            {"role": "user", "content": "Which module reads CSV files?"}]
FENCED = '```json\n{"name": "search", "arguments": {"query": "csv"}}\n```'
MARKUP = '<tool_call>\n{"name": "search", "arguments": {"query": "csv"}}\n</tool_call>'


def qwen(answer_for):
    """A Qwen-style fake whose answer is ``answer_for(prompt, request)``."""
    engine = QwenStyleFakeEngine(["qwen"])
    engine.responder = lambda r: answer_for(engine.prompt_text(r), r)
    return engine


@pytest.fixture
async def proxy(aiohttp_client):
    async def make(engine):
        app = create_app({"qwen": engine})
        client = await aiohttp_client(app)
        await app[STATE].ready.wait()
        return client
    return make


async def chat(client, **extra):
    resp = await client.post("/v1/chat/completions", json={
        "model": "qwen", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, **extra})
    return resp.status, await resp.json()


@pytest.mark.parametrize("written", [MARKUP, FENCED, '{"name": "search", "arguments": '
                                     '{"query": "csv"}}'])
async def test_native_calls_in_markup_or_written_as_json_are_tool_calls(proxy, written):
    engine = qwen(lambda prompt, r: written)
    status, body = await chat(await proxy(engine))
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"]) == {"query": "csv"}
    assert not choice["message"]["content"]  # the JSON is not passed on as the answer
    (request,) = engine.requests  # one turn, in the model's own format
    assert request.tools and request.constraint is None
    assert "<tools>" in engine.prompt_text(request)


async def test_a_plain_native_answer_streams_as_content(proxy):
    engine = qwen(lambda prompt, r: "The csv module reads and writes CSV files.")
    client = await proxy(engine)
    resp = await client.post("/v1/chat/completions", json={
        "model": "qwen", "messages": MESSAGES, "tools": TOOLS, "stream": True})
    text = await resp.text()
    deltas = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    content = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas)
    assert content == "The csv module reads and writes CSV files."
    assert len([d for d in deltas if d["choices"][0]["delta"].get("content")]) > 1
    assert deltas[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_streamed_call_written_as_json_comes_as_tool_call_deltas(proxy):
    engine = qwen(lambda prompt, r: FENCED)
    client = await proxy(engine)
    resp = await client.post("/v1/chat/completions", json={
        "model": "qwen", "messages": MESSAGES, "tools": TOOLS, "stream": True})
    deltas = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
              if line.startswith("data: {")]
    assert not any("```" in (d["choices"][0]["delta"].get("content") or "") for d in deltas)
    calls = [c for d in deltas for c in d["choices"][0]["delta"].get("tool_calls") or ()]
    # a call read from the content at the end comes whole, in OpenAI's two entries
    assert [(c["index"], c["function"].get("name")) for c in calls] == [(0, "search"),
                                                                        (0, None)]
    assert calls[0]["id"] and calls[0]["type"] == "function"
    assert calls[0]["function"]["arguments"] == ""
    assert json.loads(calls[1]["function"]["arguments"]) == {"query": "csv"}
    assert deltas[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_call_to_an_unknown_tool_in_the_content_is_refused_and_run_constrained(
        proxy):
    def answer(prompt, request):
        if request.tools:  # native: a call to a tool the request does not have
            return '```json\n{"name": "delete", "arguments": {}}\n```'
        return json.dumps({"tool_calls": [{"name": "search", "arguments": {"query": "x"}}]})
    engine = qwen(answer)
    status, body = await chat(await proxy(engine))
    assert status == 200, body
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "search"
    native, constrained = engine.requests
    assert native.tools and not constrained.tools
    assert constrained.constraint is not None and constrained.constraint.json_schema
    assert body["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "search"}}])
async def test_a_request_that_demands_a_call_is_constrained(proxy, choice):
    engine = qwen(lambda prompt, r: json.dumps(
        {"tool_calls": [{"name": "search", "arguments": {"query": "q"}}]}))
    status, body = await chat(await proxy(engine), tool_choice=choice)
    assert status == 200, body
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "search"
    (request,) = engine.requests
    assert not request.tools and request.constraint is not None


async def test_history_goes_to_the_template_as_calls_and_results(proxy):
    engine = qwen(lambda prompt, r: "It is csv.")
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "search", "arguments": '{"query": "csv"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "csv: CSV file reading"}]
    status, body = await chat(await proxy(engine), messages=messages)
    assert status == 200 and body["choices"][0]["message"]["content"] == "It is csv."
    prompt = engine.prompt_text(engine.requests[0])
    assert '<tool_call>\n{"name": "search", "arguments": {"query": "csv"}}' in prompt
    assert "<tool_response>\ncsv: CSV file reading\n</tool_response>" in prompt


async def test_a_responses_turn_takes_the_same_native_path(proxy):
    engine = qwen(lambda prompt, r: FENCED)
    client = await proxy(engine)
    resp = await client.post("/v1/responses", json={
        "model": "qwen", "input": "Which module reads CSV files?",
        "tools": [{"type": "function", **TOOLS[0]["function"]}]})
    body = await resp.json()
    assert resp.status == 200, body
    calls = [o for o in body["output"] if o["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["search"]
    assert engine.requests[0].tools


@tool
def search(query: str) -> str:
    """Search the docs."""
    return f"csv: CSV file reading and writing (query {query})"


@step(tools=[search], max_turns=3)
def research(question: str):
    return [*MESSAGES[:1], {"role": "user", "content": question}]


async def test_an_agent_step_makes_the_same_first_call_as_a_chat_completion(proxy):
    """At temperature 0 the model sees the same prompt (messages and tools) on both
    paths, so it makes the same first call."""
    def answer(prompt, request):
        if "<tool_response>" in prompt:
            return "The csv module."
        return FENCED if "CSV" in prompt else "no"
    engine = qwen(answer)
    client = await proxy(engine)
    spec = tool_spec(search)
    search_tool = {"type": "function", "function": {
        "name": spec.name, "description": spec.description, "parameters": spec.parameters}}
    status, body = await chat(client, tools=[search_tool])
    assert status == 200, body
    async with workflow("agent", base_url=str(client.make_url("")).rstrip("/")):
        out = research(MESSAGES[1]["content"])
    assert out.value == "The csv module."
    chat_request, step_first = engine.requests[0], engine.requests[1]
    assert engine.prompt_text(chat_request) == engine.prompt_text(step_first)
    step_call = json.loads(engine.prompt_text(engine.requests[2]).split(
        "<tool_call>\n")[1].split("\n</tool_call>")[0])
    chat_call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert step_call == {"name": chat_call["name"],
                         "arguments": json.loads(chat_call["arguments"])}


def test_recognise_and_fragment():
    tools = [ToolDef("search", "", TOOLS[0]["function"]["parameters"])]
    found = recognise(f"I will search.\n{FENCED}", tools)
    assert found.kind == "calls" and found.content == "I will search."
    assert recognise('{"answer": "csv"}', tools).kind == "answer"
    assert recognise('{"name": "search", "arguments": {"q": 1}}', tools).kind == "refused"
    assert recognise("The csv module.", tools).kind == "answer"
    for bad in ("{", ":[", "```json\n{", '<tool_call>\n{"name"', '{"content": "cut',
                '{"tool_calls": [{"name": "search", "arguments": {}}]}',
                "<tool_response> error: no module </tool_response>"):
        assert fragment(bad), bad
    for good in ("csv", "The answer is csv.", '{"module": "csv"}', ""):
        assert fragment(good) is None, good


def test_no_answer_and_what_streamed_text_may_still_be():
    """The check a loop the proxy runs shares (agent steps, the hosted-MCP loop): an
    empty answer is no answer only after tool results; streamed text is held back while
    it may still be one."""
    assert no_answer(" \n", after_tools=True) == "the answer is empty"
    assert no_answer("", after_tools=False) is None
    assert "markup" in (no_answer("<tool_response>42</tool_response>", after_tools=True) or "")
    assert no_answer("It is 42.", after_tools=True) is None
    for held in ("", "  ", "<tool_", "{", "```", "..."):
        assert undecided(held), held
    for sent in ("It", "42 is", "The answer: {x}"):
        assert not undecided(sent), sent



def test_tool_format_from_the_config_file_to_the_engine(engine_configs, tmp_path):
    from flowlift import cli
    from flowlift.errors import ConfigError
    from flowlift.local_engine.models import default_tool_format
    from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine
    from flowlift.proxy.config import parse_config

    config = parse_config({"backends": {"big": {
        "kind": "embedded", "model": "Qwen2.5-Coder-1.5B-Instruct",
        "tool_format": "constrained"}}})
    assert config.tool_formats() == {"Qwen2.5-Coder-1.5B-Instruct": ("constrained", None)}
    args = cli.build_parser().parse_args(["serve", "--model", "Qwen2.5-Coder-1.5B-Instruct"])
    args.tool_formats = config.tool_formats()
    cli._engines(args)
    assert engine_configs[-1].tool_format == "constrained"
    assert default_tool_format("Qwen2.5-Coder-0.5B-Instruct") == ("native", "hermes")
    assert default_tool_format("SmolLM2-135M-Instruct") == ("constrained", None)
    native = VLLMEngine(VLLMConfig(model=str(tmp_path), served_model_name="m",
                                   tool_format="native", tool_parser="hermes"))
    assert native.capabilities.native_tools
    assert not VLLMEngine(VLLMConfig(model=str(tmp_path),
                                     served_model_name="m")).capabilities.native_tools
    with pytest.raises(ConfigError, match="tool_parser"):
        VLLMEngine(VLLMConfig(model=str(tmp_path), served_model_name="m",
                              tool_format="native"))


# Call-shaped content that is not JSON, as the 1.5B wrote it (bench/RESULTS.md,
# "Tool-call format per model"): it passed the check and came back as the answer.
LEAKS = {
    "doubled braces": '{{"name": "search", "arguments": {"query": "csv"}}}',
    "doubled braces throughout": '{{"name": "search", "arguments": {{"query": "csv"}}}}',
    "python literals": '```json\n{"name": "search", "arguments": {"query": "csv"}, '
                       '"id": None, "strict": True}\n```',
    "// comment": '```json\n{"name": "search", // the docs\n'
                  '  "arguments": {"query": "csv"}  // what to look for\n}\n```',
}


@pytest.mark.parametrize("written", LEAKS.values(), ids=LEAKS.keys())
async def test_call_shaped_content_that_is_not_json_is_the_call(proxy, written):
    engine = qwen(lambda prompt, r: written)
    status, body = await chat(await proxy(engine))
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"])["query"] == "csv"
    assert not choice["message"]["content"]


@pytest.mark.parametrize("written", LEAKS.values(), ids=LEAKS.keys())
async def test_call_shaped_content_that_is_not_json_is_the_call_of_a_responses_turn(
        proxy, written):
    engine = qwen(lambda prompt, r: written)
    resp = await (await proxy(engine)).post("/v1/responses", json={
        "model": "qwen", "input": "Which module reads CSV files?",
        "tools": [{"type": "function", **TOOLS[0]["function"]}]})
    body = await resp.json()
    assert resp.status == 200, body
    assert [o["name"] for o in body["output"] if o["type"] == "function_call"] == [
        "search"]
    assert not any(o["type"] == "message" for o in body["output"])


async def test_a_doubled_brace_call_to_an_unknown_tool_is_refused_and_run_constrained(
        proxy):
    def answer(prompt, request):
        if request.tools:  # the measured leak: a module written as the tool
            return '{{"name": "subprocess", "arguments": {}}}'
        return json.dumps({"content": "The subprocess module."})
    engine = qwen(answer)
    status, body = await chat(await proxy(engine))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "The subprocess module."
    native, constrained = engine.requests
    assert native.tools and not constrained.tools


@pytest.mark.parametrize("written", LEAKS.values(), ids=LEAKS.keys())
async def test_call_shaped_content_that_is_not_json_is_the_call_of_an_agent_step(
        proxy, written):
    def answer(prompt, request):
        return "The csv module." if "<tool_response>" in prompt else written
    engine = qwen(answer)
    client = await proxy(engine)
    async with workflow("agent", base_url=str(client.make_url("")).rstrip("/")):
        out = research(MESSAGES[1]["content"])
    assert out.value == "The csv module."  # the call ran; its text was not the answer
    assert "csv: CSV file reading" in engine.prompt_text(engine.requests[-1])


def test_recognise_reads_call_shaped_text_tolerantly_but_not_prose():
    tools = [ToolDef("search", "", TOOLS[0]["function"]["parameters"])]
    found = recognise("```python\n{'name': 'search', 'arguments': {'query': 'x',},}\n```",
                      tools)
    assert found.kind == "calls" and json.loads(found.calls[0].arguments) == {"query": "x"}
    found = recognise('{"name": "search", "arguments": {"query": "http://x"}} // ok', tools)
    assert found.kind == "calls" and json.loads(found.calls[0].arguments) == {
        "query": "http://x"}  # a // inside a string is no comment
    for prose in ("See https://docs.python.org // csv", '{"module": None}', "{1, 2}",
                  "{{not a call}}", "[1, 2] // two"):
        assert recognise(prose, tools).kind == "answer", prose
