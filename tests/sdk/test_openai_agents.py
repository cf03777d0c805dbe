"""The OpenAI Agents SDK against the proxy's Responses API (issue 25): an agent with two
function tools and a handoff to a second agent (examples/frameworks/openai_agents.py),
``OpenAIResponsesModel`` on an ``AsyncOpenAI`` pointed at the proxy, tracing off, the
model a scripted FakeEngine (deterministic)."""

from __future__ import annotations

from examples.frameworks import openai_agents as example
from flowlift.proxy import create_app
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine


async def test_an_agent_calls_two_tools_and_hands_off_over_previous_response_id(
        aiohttp_client):
    engine = FakeEngine(["fake-model"], responder=example.scripted)
    app = create_app({"fake-model": engine})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    report = await example.run(str(client.make_url("/v1")), "fake-model")
    assert report.last_agent == "Writer"
    assert report.answer == ("Pack light clothes and sunglasses: Paris is sunny, 21 C at "
                             "12:00 local time.")
    assert len(report.response_ids) == 4  # weather, time, handoff, answer
    prompts = ["\n".join(m.content for m in r.messages) for r in engine.requests]
    assert example.WEATHER in prompts[1] and example.TIME in prompts[2]
    assert prompts[3].startswith("You are the Writer")
    # the SDK sent only each turn's new items; the proxy kept the conversation, and the
    # turns of the same agent reused their cached prefix
    assert all(c > 0 for c in report.cached_tokens[1:3])
    for before, turn in zip(report.response_ids, report.response_ids[1:], strict=False):
        stored = await (await client.get(f"/v1/responses/{turn}")).json()
        assert stored["previous_response_id"] == before
    assert report.run is not None and len(report.run["graph"]["nodes"]) == 4


async def test_a_streamed_agent_run_gets_its_calls_as_argument_deltas(aiohttp_client):
    """``Runner.run_streamed``: the Responses stream's function calls arrive as
    ``response.function_call_arguments.delta`` events (in pieces: the engine writes
    4 characters a chunk), and the run ends as the unstreamed run does."""
    from agents import Runner
    from openai import AsyncOpenAI

    app = create_app({"fake-model": FakeEngine(["fake-model"], responder=example.scripted)})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    oai = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="flowlift",
                      max_retries=0)
    result = Runner.run_streamed(example.build_agents(oai, "fake-model"), example.QUESTION,
                                 max_turns=8, auto_previous_response_id=True)
    deltas: dict[str, str] = {}
    done: dict[str, str] = {}
    pieces: dict[str, int] = {}
    async for event in result.stream_events():
        data = getattr(event, "data", None)
        kind = getattr(data, "type", "")
        if kind == "response.function_call_arguments.delta":
            deltas[data.item_id] = deltas.get(data.item_id, "") + data.delta
            pieces[data.item_id] = pieces.get(data.item_id, 0) + 1
        elif kind == "response.function_call_arguments.done":
            done[data.item_id] = data.arguments
    assert result.last_agent.name == "Writer"
    assert str(result.final_output).startswith("Pack light clothes")
    assert len(done) == 3 and deltas == done  # weather, time, the handoff
    assert '{"city": "Paris"}' in done.values()
    assert sum(n > 1 for n in pieces.values()) >= 2  # both city calls came in pieces
