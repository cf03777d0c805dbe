"""examples/agents/hosted_mcp_responses.py (issue 34): an Agents SDK agent whose only tool
is ``HostedMCPTool`` (the stdlib docs MCP server of examples/agents/hosted_mcp.toml,
started by the proxy over stdio), on an in-process proxy whose FakeEngine plays the
model: the proxy runs the call and the answer comes back in one response."""

from __future__ import annotations

import json

from examples.agents import hosted_mcp_responses as example


async def test_the_hosted_mcp_example_searches_the_docs_and_answers():
    report = await example._scripted("fake-model")
    assert report.answer == "The csv module reads and writes CSV files."
    ((name, arguments, output),) = report.calls
    assert name == "search" and json.loads(arguments) == {"query": "CSV files comma separated"}
    assert output.startswith("csv")  # the server's own search result
    assert report.response_id is not None and report.response_id.startswith("resp_")
