"""The research agent as LangGraph's react agent, through flowlift.

The same twelve questions and the same two tools as examples/agents/research.py
(``search(query)`` and ``read(module)`` over the stdlib_docs corpus), written the way a
LangGraph user writes an agent: ``create_react_agent(llm, ToolNode([...]))`` with
:class:`flowlift.sdk.langchain.FlowliftChat` as the model. ``bind_tools`` makes each
model turn a chat completion on the flowlift proxy with OpenAI ``tools``, answered in
the model's own tool-call format (docs/agents.md); LangGraph's ``ToolNode`` runs the
calls in the app and loops.

    flowlift run --config examples/stdlib_docs/flowlift.toml \\
        examples/agents/langgraph_react.py [--limit N] [--model NAME]
    flowlift run --engine fake examples/agents/langgraph_react.py   # plumbing only

Prints each question's answer, whether it names the expected module, and the tool
calls it made. Exit status 0, or 2 when no proxy could be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples.agents` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langgraph.prebuilt import ToolNode, create_react_agent

from examples.agents import docs_tools
from examples.agents.research import MAX_TURNS, QUESTIONS, SYSTEM, Outcome, agent_model
from flowlift import ProxyUnavailable
from flowlift.sdk.langchain import FlowliftChat
from flowlift.sdk.workflow import DEFAULT_BASE_URL

TOOLS = [StructuredTool.from_function(docs_tools.search, name="search"),
         StructuredTool.from_function(docs_tools.read, name="read")]


def build_agent(model: str | None, base_url: str) -> Any:
    """LangGraph's prebuilt react agent on a flowlift model, with the two tools."""
    llm = FlowliftChat(model=model, base_url=base_url, max_tokens=128)
    return create_react_agent(llm, ToolNode(TOOLS), prompt=SYSTEM)


async def ask(agent: Any, question: str) -> tuple[str, int]:
    """The agent's answer to ``question`` and the tool calls it made."""
    state = await agent.ainvoke({"messages": [("user", question)]},
                                {"recursion_limit": 2 * MAX_TURNS + 1})
    calls = sum(len(m.tool_calls) for m in state["messages"] if isinstance(m, AIMessage))
    return str(state["messages"][-1].content), calls


async def run(model: str | None, base_url: str, limit: int | None) -> int:
    """Ask every question at once; print the rows; the number answered right."""
    agent = build_agent(model, base_url)
    questions = list(QUESTIONS[:limit])
    answers = await asyncio.gather(*(ask(agent, q.text) for q in questions),
                                   return_exceptions=True)
    right = 0
    for q, got in zip(questions, answers, strict=True):
        if isinstance(got, BaseException):
            print(f"  {q.module:<10} FAILED: {type(got).__name__}: {got}")
            continue
        text, calls = got
        ok = Outcome(q, answer=text).correct
        right += ok
        print(f"  {q.module:<10} {'yes' if ok else 'no ':<3} calls {calls}  "
              f"{' '.join(text.split())[:100]}")
    print(f"{right}/{len(questions)} answers name the expected module")
    return right


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    base_url = os.environ.get("FLOWLIFT_BASE_URL", DEFAULT_BASE_URL)
    model = args.model or agent_model(base_url)
    try:
        asyncio.run(run(model, base_url, args.limit))
    except ProxyUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
