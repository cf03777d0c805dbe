"""A hosted-MCP agent on flowlift's Responses API (issue 34): an OpenAI Agents SDK agent
whose only tool is ``HostedMCPTool`` -- the standard library docs server
(examples/agents/docs_mcp.py: ``search`` and ``read``) -- so the proxy, not the app,
lists the server's tools, runs every call the model makes and loops until the answer.
One ``/v1/responses`` request per question: its output holds the ``mcp_list_tools``
item, each ``mcp_call`` with its output, and the answer.

The server is the proxy's ``[tools.docs]`` (examples/agents/hosted_mcp.toml), named by
its label; a server reached by URL is named by ``server_url`` too, and must be one the
proxy's config lists (any other URL is refused with 403). ``require_approval`` must be
``"never"``: flowlift runs hosted calls without approval round trips.

Against a proxy started with the config (from the repository root)::

    flowlift run --config examples/agents/hosted_mcp.toml examples/agents/hosted_mcp_responses.py

or with no model, on an in-process proxy whose FakeEngine plays the model from a script
(deterministic; what tests/project/test_example_hosted_mcp.py runs)::

    python examples/agents/hosted_mcp_responses.py --scripted
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from openai import AsyncOpenAI

from agents import (
    Agent,
    HostedMCPTool,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from agents.items import ToolCallItem
from flowlift.local_engine.base import GenerationRequest
from flowlift.testing import tool_calls_text

QUESTION = "Which standard library module reads and writes CSV files?"
INSTRUCTIONS = ("Answer questions about the Python standard library. Search its docs "
                "with your tools first, then answer in one sentence naming the module.")
CONFIG = Path(__file__).with_name("hosted_mcp.toml")


@dataclass
class Report:
    """What one question came to: the answer, the hosted calls (name, arguments,
    output's first 80 characters) and the response id."""

    answer: str
    calls: list[tuple[str, str, str]]
    response_id: str | None


def build_agent(client: AsyncOpenAI, model: str, server_url: str | None = None
                ) -> Agent[Any]:
    """The agent: the docs server as a hosted MCP tool, on ``client``'s proxy."""
    config: dict[str, Any] = {"type": "mcp", "server_label": "docs",
                              "allowed_tools": ["search", "read"],
                              "require_approval": "never"}
    if server_url is not None:
        config["server_url"] = server_url
    return Agent(name="Librarian", instructions=INSTRUCTIONS,
                 model=OpenAIResponsesModel(model=model, openai_client=client),
                 model_settings=ModelSettings(temperature=0.0, max_tokens=300),
                 tools=[HostedMCPTool(tool_config=config)])  # type: ignore[arg-type]


async def run(base_url: str, model: str, api_key: str = "flowlift",
              question: str = QUESTION, server_url: str | None = None) -> Report:
    """Ask ``question`` through the proxy at ``base_url`` (``.../v1``)."""
    set_tracing_disabled(True)  # no export to OpenAI (no network)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        result = await Runner.run(build_agent(client, model, server_url), question)
    finally:
        await client.close()
    calls = [(i.raw_item.name, i.raw_item.arguments, (i.raw_item.output or "")[:80])
             for i in result.new_items if isinstance(i, ToolCallItem)
             and getattr(i.raw_item, "type", None) == "mcp_call"]
    ids = [r.response_id for r in result.raw_responses]
    return Report(str(result.final_output), calls, ids[-1] if ids else None)


def scripted(request: GenerationRequest) -> str:
    """A FakeEngine responder: search the docs, then answer from what came back."""
    last = request.messages[-1].content if request.messages else ""
    if QUESTION in last:
        return tool_calls_text(("search", {"query": "CSV files comma separated"}))
    answer = ("The csv module reads and writes CSV files." if "csv" in last
              else "I could not find it.")
    return json.dumps({"content": answer}) if request.constraint is not None else answer


async def _scripted(model: str) -> Report:
    from aiohttp import web

    from flowlift.proxy import create_app
    from flowlift.proxy.config import load_config
    from flowlift.proxy.state import STATE
    from flowlift.testing import FakeEngine

    config = load_config(CONFIG)
    docs = config.tools["docs"]
    config.tools["docs"] = docs.model_copy(update={"command": [sys.executable,
                                                               *docs.command[1:]]})
    app = create_app({model: FakeEngine([model], responder=scripted)}, file_config=config)
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
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--server-url", default=None,
                        help="name the docs server by this URL (one the config lists)")
    args = parser.parse_args(argv)
    if args.scripted:
        report = asyncio.run(_scripted("fake-model"))
    else:
        base = os.environ.get("FLOWLIFT_BASE_URL", "http://127.0.0.1:8000")
        report = asyncio.run(run(f"{base}/v1", args.model,
                                 os.environ.get("FLOWLIFT_API_KEY", "flowlift"),
                                 args.question, args.server_url))
    for name, arguments, output in report.calls:
        print(f"mcp_call {name}({arguments}) -> {output!r}")
    print(f"answer: {report.answer}")
    print(f"response: {report.response_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
