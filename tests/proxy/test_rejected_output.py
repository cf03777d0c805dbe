"""A failed contract's rejected output is kept, bounded, where the user looks: the
trace's attempt, ``flowlift export`` (``rejected_output``) and ``flowlift show``; the
JSON error reads "starting at char N", not "at at" (issue 38, item 2)."""

from __future__ import annotations

import pytest

from flowlift.cli.runs import export_rows, show_text
from flowlift.errors import ContractError
from flowlift.graph import Contract
from flowlift.proxy.state import STATE
from flowlift.proxy.workflows.contracts import check_output
from flowlift.testing import parse_sse
from flowlift.tracing.recorder import REJECTED_OUTPUT_CHARS

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def test_the_json_error_says_at_once():
    with pytest.raises(ContractError) as failed:
        check_output(Contract(json_schema=SCHEMA), '{"a": "cut', step_id="s")
    assert "starting at char 6" in failed.value.message
    assert "at at" not in failed.value.message and "at at" not in str(failed.value.errors)


@pytest.mark.parametrize("answer", ['{"a": "cut off', "x" * 5000])
async def test_the_rejected_output_is_in_the_trace_export_and_show(aiohttp_client, make_app,
                                                                   engine, answer):
    engine.responder = lambda request: answer
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    graph = {"id": "wf-rejected", "nodes": [{
        "kind": "llm", "id": "extract", "model": "fake-model", "retries": 1,
        "messages": [{"role": "user", "content": [{"text": "facts?"}]}],
        "contract": {"json_schema": SCHEMA}}]}
    parse_sse(await (await client.post("/v1/workflows", json=graph)).text())
    doc = await (await client.get("/v1/workflows/wf-rejected")).json()
    assert doc["status"] == "failed"
    (record,) = [r for r in doc["trace"] if r.get("step_id") == "extract"]
    outputs = [a["output"] for a in record["attempts"]]
    assert len(outputs) == 2 and all(o is not None for o in outputs)
    kept = outputs[-1]
    if len(answer) <= REJECTED_OUTPUT_CHARS:
        assert kept == answer
    else:  # bounded: the start, and how much was left out
        assert kept.startswith("x" * REJECTED_OUTPUT_CHARS)
        assert kept.endswith(f"[{len(answer) - REJECTED_OUTPUT_CHARS} more characters]")
    (row,) = export_rows(doc)
    assert row["output"] is None and row["rejected_output"] == kept
    assert "last rejected output: " in show_text(doc)
