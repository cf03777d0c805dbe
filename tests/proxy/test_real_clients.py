"""Real clients against the proxy on a real port: the official ``openai`` package (sync
and async, streaming, tool calls, structured outputs, ``with_raw_response``, errors) and
LangChain's ``ChatOpenAI``. ``fake-model`` is the embedded path (a FakeEngine: it echoes
the last message, or the smallest instance of a JSON Schema); ``up-model`` goes to a
fake upstream whose answers are spec-valid (``tests/openapi_spec.py``)."""

from __future__ import annotations

import json

import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.openapi_spec import Live, live_proxy

MESSAGES = [{"role": "user", "content": "hello there"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
BOTH = pytest.mark.parametrize("model", ["fake-model", "up-model"])


class City(BaseModel):
    """A city and how many people live there."""

    name: str = Field(min_length=2)
    population: int


@pytest.fixture(scope="module")
def live():
    yield from live_proxy()


@pytest.fixture(scope="module")
def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="sk-unused", max_retries=0,
                         timeout=10)


# -- openai, sync -----------------------------------------------------------------------
def test_sync_chat_stream_and_usage(client):
    out = client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert out.choices[0].message.content == "echo: hello there"
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    stream = client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "echo: hello there"
    assert chunks[-1].usage.completion_tokens == 3


@BOTH
def test_tool_calls_whole_and_streamed(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER],
                                         tool_choice="required")
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # The SDK's stream helper reassembles tool-call deltas into the same final message.
    with client.chat.completions.stream(model=model, messages=MESSAGES, tools=[WEATHER],
                                        tool_choice="required") as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls[0]
    assert (streamed.function.name, streamed.function.arguments) == \
        (call.function.name, call.function.arguments)


def test_n_choices_logprobs_and_legacy_completions(client):
    out = client.chat.completions.create(model="fake-model", messages=MESSAGES, n=2,
                                         logprobs=True, top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    tokens = out.choices[0].logprobs.content
    assert "".join(t.token for t in tokens) == "echo: hello there"
    assert all(len(t.top_logprobs) == 2 and t.logprob < 0 for t in tokens)
    text = client.completions.create(model="fake-model", prompt="Say hi", max_tokens=8)
    assert text.choices[0].text == "echo: Say hi"


def test_structured_output_parsed_by_the_sdk(client):
    out = client.chat.completions.parse(model="fake-model", messages=MESSAGES,
                                        response_format=City)
    city = out.choices[0].message.parsed
    assert isinstance(city, City) and len(city.name) >= 2


def test_models_and_embeddings(client):
    assert {m.id for m in client.models.list()} == {"fake-model", "up-model"}
    emb = client.embeddings.create(model="up-model", input=["a", "b"],
                                   encoding_format="float")
    assert [d.index for d in emb.data] == [0, 1] and emb.data[0].embedding[0] == 0.1
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="fake-model", input="a")
    assert info.value.code == "model_not_supported"


def test_with_raw_response_headers_and_parse(client):
    raw = client.chat.completions.with_raw_response.create(model="fake-model",
                                                           messages=MESSAGES)
    assert raw.status_code == 200 and "engine;dur=" in raw.headers["server-timing"]
    assert raw.parse().choices[0].message.content == "echo: hello there"
    raw = client.chat.completions.with_raw_response.create(model="up-model", messages=MESSAGES)
    assert raw.headers["x-flowlift-backend"] == "up"
    assert raw.parse().choices[0].message.content == "upstream says hi"


@pytest.mark.parametrize(("exc", "kwargs", "param"), [
    (openai.BadRequestError, {"messages": []}, "messages"),
    (openai.BadRequestError, {"temperature": 5}, "temperature"),
    (openai.NotFoundError, {"model": "gpt-nope"}, "model"),
    (openai.RateLimitError, {"model": "up-model", "user": "status-429"}, None),
])
def test_errors_raise_the_sdk_exception_with_the_body(client, exc, kwargs, param):
    with pytest.raises(exc) as info:
        client.chat.completions.create(**{"model": "fake-model", "messages": MESSAGES,
                                          **kwargs})
    assert info.value.param == param and info.value.message
    assert info.value.response.headers["content-type"].startswith("application/json")


# -- openai, async ----------------------------------------------------------------------
async def test_async_client(live):
    oa = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="sk-unused", max_retries=0)
    out = await oa.chat.completions.create(model="up-model", messages=MESSAGES)
    assert out.choices[0].message.content == "upstream says hi"
    stream = await oa.chat.completions.create(model="fake-model", messages=MESSAGES,
                                              stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == \
        "echo: hello there"
    with pytest.raises(openai.BadRequestError):
        await oa.chat.completions.create(model="fake-model", messages=MESSAGES, n=0)
    await oa.close()


# -- LangChain --------------------------------------------------------------------------
def chat_model(live: Live, model: str = "fake-model") -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=f"{live.url}/v1", api_key="sk-unused",
                      max_retries=0, timeout=10)


def test_langchain_invoke_and_stream(live):
    llm = chat_model(live)
    reply = llm.invoke("hello there")
    assert isinstance(reply, AIMessage) and reply.content == "echo: hello there"
    assert reply.usage_metadata["total_tokens"] > 0
    assert "".join(c.content for c in llm.stream("hello there")) == "echo: hello there"


async def test_langchain_async(live):
    llm = chat_model(live, "up-model")
    assert (await llm.ainvoke("hi")).content == "upstream says hi"
    assert "".join([c.content async for c in llm.astream("hi")]) == "upstream says hi"


@BOTH
def test_langchain_tool_call_round_trip(live, model):
    llm = chat_model(live, model).bind_tools([WEATHER], tool_choice="get_weather")
    question = HumanMessage("Weather in Paris?")
    first = llm.invoke([question])
    call = first.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    answer = chat_model(live, model).invoke(
        [question, first, ToolMessage("sunny, 21 C", tool_call_id=call["id"])])
    assert answer.content and not answer.tool_calls
    if model == "fake-model":  # the tool's result reached the engine's prompt
        prompt = "\n".join(m.content for m in live.engine.requests[-1].messages)
        assert "sunny, 21 C" in prompt and call["id"] in prompt
    else:  # and the upstream got the history in OpenAI's shape
        sent = live.upstream.received[-1].json()["messages"]
        assert sent[1]["tool_calls"][0]["id"] == call["id"]
        assert sent[2] == {"role": "tool", "content": "sunny, 21 C",
                           "tool_call_id": call["id"]}


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(live, method):
    city = chat_model(live).with_structured_output(City, method=method).invoke("Paris?")
    assert isinstance(city, City) and len(city.name) >= 2
