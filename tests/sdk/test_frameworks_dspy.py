"""DSPy on the proxy (issue 25): the two-module program of examples/frameworks, on
DSPy's OpenAI-compatible LM with the workflow headers, forms one inferred workflow
with the edge extract -> answer. A FakeEngine answers in DSPy's field formats
(ChatAdapter sections; JSONAdapter's JSON under the signature's schema); LiteLLM reads
its local cost map, DSPy's cache is off: nothing leaves the machine."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from examples.frameworks import dspy_program as example
from flowlift.dataflow import dependencies
from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy import create_app
from flowlift.proxy.workflows.inferred import InferredWorkflows, output_pieces
from flowlift.testing import FakeEngine
from tests.openapi_spec import LiveServers

FACTS = "zlib compresses with DEFLATE; compressobj() handles streams in pieces."
ANSWER = "Use compressobj() and decompressobj()."


def _chat(field: str, value: str) -> str:
    return f"[[ ## {field} ## ]]\n{value}\n\n[[ ## completed ## ]]"


def respond(request: GenerationRequest) -> str:
    """The extract call gets FACTS, the answer call ANSWER, in the format asked for."""
    user = request.messages[-1].content
    field, value = ("answer", ANSWER) if "[[ ## question ## ]]" in user else ("facts", FACTS)
    c = request.constraint
    if c is not None and c.json_schema is not None:
        assert field in c.json_schema["properties"], c.json_schema
        return json.dumps({field: value})
    return _chat(field, value)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection but to this machine fails the test (LiteLLM, DSPy telemetry)."""
    real = socket.socket.connect

    def connect(sock: socket.socket, address: object) -> None:
        host = address[0] if isinstance(address, tuple) else None
        if sock.family in (socket.AF_INET, socket.AF_INET6) and host not in (
                "127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"the test tried the network: {address}")
        real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(["fake-model"], responder=respond)
    with LiveServers() as servers:
        yield servers.serve(lambda: create_app({"fake-model": engine})), engine


@pytest.mark.parametrize("adapter", ["chat", "json"])
def test_two_modules_form_one_inferred_workflow_with_their_edge(live, adapter):
    url, engine = live
    before = len(engine.requests)
    prediction, doc = example.run(example.DOCUMENT, example.QUESTION, base_url=url,
                                  model="fake-model", adapter=adapter,
                                  workflow_id=f"dspy-{adapter}")
    assert (prediction.facts, prediction.answer) == (FACTS, ANSWER)
    calls = engine.requests[before:]
    assert len(calls) == 2  # one per module: nothing failed to parse, nothing retried
    assert FACTS in "\n".join(m.content for m in calls[1].messages)
    if adapter == "json":  # the signature's schema went to the engine
        assert all(c.constraint is not None and c.constraint.json_schema for c in calls)
    assert doc["object"] == "workflow.inferred" and doc["id"] == f"dspy-{adapter}"
    assert {s["id"]: s["depends_on"] for s in doc["steps"]} == {
        "extract": [], "answer": ["extract"]}
    assert doc["report"]["critical_path"] == ["extract", "answer"]


def test_the_lm_sends_the_workflow_and_step_headers():
    lm = example.proxy_lm("http://proxy.invalid", "m", "wf-1", step="extract")
    assert lm.model == "openai/m" and lm.cache is False
    assert lm.kwargs["headers"] == {"X-Flowlift-Workflow": "wf-1", "X-Flowlift-Step": "extract"}
    assert lm.kwargs["api_base"] == "http://proxy.invalid/v1"


@pytest.mark.parametrize(("output", "pieces"), [
    (_chat("facts", FACTS), [_chat("facts", FACTS), FACTS]),
    (json.dumps({"facts": FACTS, "n": 2, "empty": " "}), [json.dumps({
        "facts": FACTS, "n": 2, "empty": " "}), FACTS]),
    ("{not json", ["{not json"]),
    ("plain text", ["plain text"]),
])
def test_a_structured_answer_is_quoted_by_its_fields(output, pieces):
    assert output_pieces(output) == pieces


@pytest.mark.parametrize("output", [_chat("facts", FACTS), json.dumps({"facts": FACTS})])
def test_a_field_of_an_earlier_answer_in_a_prompt_is_an_edge(output):
    store = InferredWorkflows()
    for step, out, prompt, at in (("extract", output, "Extract the facts.", (0.0, 1.0)),
                                  ("answer", "ok", f"Facts: {FACTS}\nAnswer.", (1.5, 2.0))):
        store.record("wf", step=step, model="m", messages=[{"role": "user", "content": prompt}],
                     prompt=None, output=out, usage=None, started_at=at[0], finished_at=at[1],
                     backend=None)
    graph = store.graph("wf")
    assert graph is not None
    assert dependencies(graph) == {"extract": frozenset(), "answer": frozenset({"extract"})}


def test_the_example_prints_the_inferred_workflow(live, monkeypatch, capsys):
    url, _ = live
    monkeypatch.setenv("FLOWLIFT_BASE_URL", url)
    assert example.main([]) == 0
    out = capsys.readouterr().out
    assert f"answer: {ANSWER}" in out and "critical path: extract -> answer" in out
    monkeypatch.setenv("FLOWLIFT_BASE_URL", "http://127.0.0.1:9")  # nothing listens
    assert example.main([]) == 2
