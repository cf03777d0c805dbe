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
