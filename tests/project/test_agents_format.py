"""bench/agents_format.py (issue 34): an answer that is no prose (empty, tool markup, a
call-shaped JSON) is counted apart, without changing the right/wrong scoring; the
smoke's scripted model calls a tool once, then answers from the result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.agents_format import Row, not_prose, scripted, summary
from flowlift.local_engine.base import ChatMessage, GenerationRequest, ToolDef

TOOLS = (ToolDef("search"), ToolDef("read"))


@pytest.mark.parametrize("answer", [
    "", "\n", None, '```json\n{\n  "name": "csv",\n  "arguments": {}\n}\n```',
    '{{"name": "subprocess", "arguments": {"args": ["python"]}}}',
    "<tool_response>\nerror: no module 'gzip' in the docs\n</tool_response>",
    '<tool_call>{"name": "read", "arguments": {"module": "re"}}</tool_call>'])
def test_not_prose(answer):
    assert not_prose(answer)


@pytest.mark.parametrize("answer", [
    "The `csv` module reads and writes CSV files.",
    'Use csv: `csv.reader(f)` reads rows; its "name" field is the file\'s.'])
def test_prose(answer):
    assert not not_prose(answer)


def test_summary_counts_not_prose_apart_from_right():
    rows = [Row("csv", True, '```json\n{"name": "csv", "arguments": {}}\n```'),
            Row("re", True, "The re module.", calls=1, valid_calls=1, ok_results=1),
            Row("uuid", False, None, error="no answer after 6 turns")]
    s = summary(rows)
    assert (s["right"], s["right_after_a_tool_result"], s["failed"]) == (2, 1, 1)
    assert (s["answers_not_prose"], s["right_in_prose"]) == (1, 1)


def test_scripted_model_searches_then_answers_from_the_result():
    question = [ChatMessage("system", "s"), ChatMessage("user", "Which module ...?")]
    first = json.loads(scripted(GenerationRequest("r1", "large", question, tools=TOOLS)))
    assert first["tool_calls"][0]["name"] == "search"
    after = [*question, ChatMessage("assistant", ""),
             ChatMessage("tool", '[["heapq", "Heap queue algorithm."]]')]
    assert scripted(GenerationRequest("r2", "large", after, tools=TOOLS)) == "The heapq module."
