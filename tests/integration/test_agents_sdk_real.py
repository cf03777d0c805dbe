"""An OpenAI Agents SDK agent with two function tools on the real embedded engine
(issue 34, item 4): the SDK drives ``/v1/responses`` turn by turn (its default model,
``OpenAIResponsesModel``), the proxy's engine answers with function calls, the SDK runs
the tools and sends their outputs back, and the run ends with the agent's answer. The
default model (SmolLM2-135M) is too small to choose tools well or to stop calling them
(measured: with ``run_llm_again`` it called tools until ``max_turns``), so the turn is
``tool_choice="required"`` and the agent stops on its first tool result
(``tool_use_behavior="stop_on_first_tool"``): the test pins the plumbing (a call made
and valid, the SDK ran it, its result is the run's output), not the model's judgement."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytestmark = pytest.mark.engine

CALLED: list[tuple[str, str]] = []


def test_an_agents_sdk_agent_with_two_function_tools_answers(real_proxy: dict[str, Any]):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        CALLED.append(("weather", city))
        return f"sunny, 21 C in {city}"

    @function_tool
    def local_time(city: str) -> str:
        """The local time in a city."""
        CALLED.append(("local_time", city))
        return f"12:00 in {city}"

    async def run() -> Any:
        set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=f"{real_proxy['base_url']}/v1", api_key="k",
                             max_retries=0, timeout=300)
        agent = Agent(name="Travel", instructions="Answer with the tools' results.",
                      tools=[weather, local_time],
                      tool_use_behavior="stop_on_first_tool",
                      model=OpenAIResponsesModel(model=real_proxy["model"],
                                                 openai_client=client),
                      model_settings=ModelSettings(temperature=0.0, max_tokens=256,
                                                   parallel_tool_calls=False,
                                                   tool_choice="required"))
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=6)

    result = asyncio.run(run())
    assert CALLED and all(name in ("weather", "local_time") for name, _ in CALLED)
    assert all(city for _, city in CALLED)  # the arguments fit the schema
    calls = [i for i in result.new_items if type(i).__name__ == "ToolCallItem"]
    outputs = [i for i in result.new_items if type(i).__name__ == "ToolCallOutputItem"]
    assert len(calls) == len(outputs) == len(CALLED)
    assert result.final_output in (f"sunny, 21 C in {CALLED[0][1]}",
                                   f"12:00 in {CALLED[0][1]}")
