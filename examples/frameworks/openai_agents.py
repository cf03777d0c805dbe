"""An OpenAI Agents SDK agent on flowlift, through the Responses API (issue 25).

A ``Triage`` agent with two function tools (``get_weather``, ``get_time``) hands off to
a ``Writer`` agent, which answers. Both use ``OpenAIResponsesModel`` on an
``AsyncOpenAI`` client whose ``base_url`` is the proxy; the run continues each turn with
``previous_response_id`` (``auto_previous_response_id``), so the proxy keeps the
conversation and every turn sends only its new items. The SDK's tracing is off (it
would export to OpenAI). Afterwards the script prints the answer, the agents that ran,
each turn's cached input tokens, and the flowlift run the turns formed
(``GET /v1/workflows/{first response id}``).

Run it against a proxy (``flowlift run`` starts one, on the embedded model)::

    flowlift run examples/frameworks/openai_agents.py

or with no model at all, on an in-process proxy whose FakeEngine plays the model from a
script (deterministic; what tests/sdk/test_openai_agents.py runs)::

    python examples/frameworks/openai_agents.py --scripted
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import httpx
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    RunResult,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

from flowlift.local_engine.base import GenerationRequest
from flowlift.testing import tool_calls_text

QUESTION = "I am flying to Paris. What should I pack?"
TRIAGE = ("You are Triage. Look up the weather and the local time of the destination "
          "with your tools, then hand off to the Writer.")
WRITER = "You are the Writer. Answer the traveller in one sentence from the facts above."
WEATHER, TIME = "sunny, 21 C", "12:00 local time"


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city now."""
    return f"{city}: {WEATHER}"


@function_tool
def get_time(city: str) -> str:
    """The local time in a city."""
    return f"{city}: {TIME}"


def build_agents(client: AsyncOpenAI, model: str) -> Agent[Any]:
    """The triage agent (two tools, a handoff to the writer) on ``client``'s proxy."""
    llm = OpenAIResponsesModel(model=model, openai_client=client)
    settings = ModelSettings(temperature=0.0, max_tokens=200)
    writer: Agent[Any] = Agent(name="Writer", instructions=WRITER, model=llm,
                               model_settings=settings)
    return Agent(name="Triage", instructions=TRIAGE, model=llm, model_settings=settings,
                 tools=[get_weather, get_time], handoffs=[writer])


def scripted(request: GenerationRequest) -> str:
    """A FakeEngine responder that plays both agents: Triage calls ``get_weather``, then
    ``get_time``, then hands off; the Writer answers from the tool results it sees."""
    system = request.messages[0].content if request.messages else ""
    seen = "\n".join(m.content for m in request.messages)
    if system.startswith("You are the Writer"):
        return f"Pack light clothes and sunglasses: Paris is {WEATHER} at {TIME}."
    if WEATHER not in seen:
        return tool_calls_text(("get_weather", {"city": "Paris"}))
    if TIME not in seen:
        return tool_calls_text(("get_time", {"city": "Paris"}))
    return tool_calls_text(("transfer_to_writer", {}))


@dataclass
class Report:
    answer: str
    last_agent: str
    response_ids: list[str]
    cached_tokens: list[int]
    run: dict[str, Any] | None


async def run(base_url: str, model: str, api_key: str = "flowlift") -> Report:
    """Run the agents against the proxy at ``base_url`` (``.../v1``)."""
    set_tracing_disabled(True)  # no export to OpenAI (no network)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        result: RunResult = await Runner.run(build_agents(client, model), QUESTION,
                                             max_turns=8, auto_previous_response_id=True)
        answer, last, raw = str(result.final_output), result.last_agent.name, \
            result.raw_responses
    except MaxTurnsExceeded as exc:  # a small real model may never stop calling tools
        details = exc.run_data
        answer = f"(no answer: {exc})"
        last = details.last_agent.name if details else "?"
        raw = details.raw_responses if details else []
    ids = [r.response_id or "" for r in raw]
    cached = [r.usage.input_tokens_details.cached_tokens for r in raw]
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}) as http:
        got = await http.get(f"{base_url}/workflows/{ids[0] if ids else 'none'}")
    return Report(answer, last, ids, cached, got.json() if got.status_code == 200 else None)


async def _scripted(model: str) -> Report:
    from aiohttp import web

    from flowlift.proxy import create_app
    from flowlift.proxy.state import STATE
    from flowlift.testing import FakeEngine

    app = create_app({model: FakeEngine([model], responder=scripted)})
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await app[STATE].ready.wait()
    port = runner.addresses[0][1]
    try:
        return await run(f"http://127.0.0.1:{port}/v1", model)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripted", action="store_true",
                        help="an in-process proxy on a scripted FakeEngine (no model)")
    parser.add_argument("--model", default="default", help="the proxy's model name")
    args = parser.parse_args(argv)
    if args.scripted:
        report = asyncio.run(_scripted("fake-model"))
    else:
        base = os.environ.get("FLOWLIFT_BASE_URL", "http://127.0.0.1:8000")
        report = asyncio.run(run(f"{base}/v1", args.model,
                                 os.environ.get("FLOWLIFT_API_KEY", "flowlift")))
    print(f"answer: {report.answer}")
    print(f"last agent: {report.last_agent}; turns: {len(report.response_ids)}; cached input "
          f"tokens per turn: {report.cached_tokens}")
    if report.run is not None:
        steps = [n["id"] for n in report.run["graph"]["nodes"]]
        print(f"flowlift run {report.response_ids[0]}: steps {json.dumps(steps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
