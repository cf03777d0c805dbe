"""Graphs the browser compiler's tests compile both in the page and with
``flowlift compile --local``: valid ones using every kind of node and option the report
shows, and invalid ones (their problems must read the same)."""

from __future__ import annotations

from typing import Any

from flowlift.proxy.ui.pages import example_graph


def llm(node_id: str, *parts: str | dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = [p if isinstance(p, dict) else {"text": p} for p in parts]
    return {"kind": "llm", "id": node_id, "messages": [{"role": "user", "content": content}],
            **extra}


PREAMBLE = ("You label Python standard library modules by what they are for. Answer with "
            "one label from the list, nothing else, in lower case, for the module: ")
LABELS = {"choices": ["text", "data formats", "networking", "concurrency"]}


def rich_graph() -> dict[str, Any]:
    """Inputs, shared prefixes, identical calls, a cascade, contracts of each kind, a
    tool step, an agent step, a deadline."""
    return {"name": "rich", "class": "batch", "deadline_s": 30, "nodes": [
        {"kind": "input", "id": "doc", "value": "json: encode and decode JSON"},
        llm("label_1", PREAMBLE, {"ref": "doc"}, contract=LABELS, retries=1,
            cascade=["small", "large"], min_confidence=0.5, params={"max_tokens": 8}),
        llm("label_2", PREAMBLE, "re", contract=LABELS, params={"max_tokens": 8}),
        llm("label_3", PREAMBLE, "re", contract=LABELS, params={"max_tokens": 8}),
        llm("facts", "Facts of ", {"ref": "doc"}, model="large", params={"max_tokens": 64},
            contract={"json_schema": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 40},
                "uses": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
                "required": ["name", "uses"]}}),
        {"kind": "tool", "id": "lookup", "name": "lookup",
         "args": [{"ref": "facts", "path": ["name"]}], "kwargs": {"k": {"value": 3}}},
        llm("agent", "Answer with the tools: ", {"ref": "lookup"}, max_turns=4,
            tools=[{"name": "search", "description": "Search the docs.",
                    "parameters": {"type": "object", "properties": {
                        "q": {"type": "string"}}, "required": ["q"]}}]),
        llm("year", "The year of ", {"ref": "label_1"}, contract={"regex": "[0-9]{4}"},
            params={"max_tokens": 6}),
        llm("summary", "Summarize ", {"ref": "facts", "path": ["uses"]}, " and ",
            {"ref": "agent"}, params={"max_tokens": 120, "temperature": 0.7})]}


def wide_graph(n: int = 30) -> dict[str, Any]:
    """``n`` steps over one input, each with the same long preamble, and a reduce."""
    return {"name": "wide", "nodes": [
        {"kind": "input", "id": "doc", "value": "one two three"},
        *(llm(f"map_{i}", PREAMBLE * 2, f"part {i} of ", {"ref": "doc"},
              params={"max_tokens": 16 + i}) for i in range(n)),
        llm("reduce", "Join: ", *({"ref": f"map_{i}"} for i in range(n)))]}


VALID = {"example": example_graph(None), "rich": rich_graph(), "wide": wide_graph()}
INVALID = {
    "no nodes": {"name": "empty", "nodes": []},
    "unknown ref": {"nodes": [llm("a", "x ", {"ref": "nope"})]},
    "cycle": {"nodes": [llm("a", {"ref": "b"}), llm("b", {"ref": "a"})]},
    "bad contract": {"nodes": [llm("a", "x", contract={"choices": ["a"], "regex": "a"})]},
    "bad field": {"nodes": [llm("a", "x", retries=99, params={"max_tokens": 0})]},
    "bad tool schema": {"nodes": [llm("a", "x", tools=[
        {"name": "t", "parameters": {"type": "no-such-type"}}])]},
}
