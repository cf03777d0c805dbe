"""A two-module DSPy program on the proxy: its calls form one inferred workflow.

``extract`` (``document -> facts``) and then ``answer`` (``facts, question -> answer``),
each a ``dspy.Predict`` on DSPy's OpenAI-compatible LM (``dspy.LM("openai/<model>",
api_base=<proxy>/v1)``, DSPy's cache off). Every request carries the workflow's id
(``X-Flowlift-Workflow``) and its module's name (``X-Flowlift-Step``) as HTTP headers,
so the proxy keeps the program's calls on one replica and infers its graph from the
traffic (README "Drop-in OpenAI proxy", ``proxy/workflows/inferred.py``): ``answer``'s
prompt holds ``extract``'s output, so the graph has the edge extract -> answer.

Run it through the proxy (one is started for you when none answers)::

    flowlift run examples/frameworks/dspy_program.py [--adapter chat|json]
    flowlift run --engine fake examples/frameworks/dspy_program.py   # without a model

``--adapter json`` uses DSPy's JSONAdapter with JSON Schema structured outputs (the
embedded engine then constrains the output to the signature's fields: what a small
model needs); the default is DSPy's ChatAdapter (``[[ ## field ## ]]`` sections), which
falls back to the JSONAdapter on an answer it cannot parse (that call is a step too).
It prints the answer, then the inferred workflow: its steps with their dependencies,
the critical path and the compiler's report. Exit status: 0; 1 when the program or the
proxy failed; 2 when no proxy could be reached.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path
from typing import Any

# DSPy's LiteLLM reads its model-cost map from the network unless told not to; the
# program's calls go to the proxy only.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")

if __package__ in (None, ""):  # run as a script: make `examples.frameworks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dspy
import httpx
import litellm
from dspy.utils.exceptions import AdapterParseError

from flowlift.credentials import default_api_key
from flowlift.sdk.workflow import default_base_url

DOCUMENT = ("The zlib module provides functions for compression and decompression "
            "using the zlib library, which implements the DEFLATE algorithm. Its "
            "compress() and decompress() functions work on whole byte strings; "
            "compressobj() and decompressobj() handle data streams in pieces.")
QUESTION = "Which functions should I use to compress a stream that arrives in pieces?"
WORKFLOW_HEADER, STEP_HEADER = "X-Flowlift-Workflow", "X-Flowlift-Step"


class ExtractFacts(dspy.Signature):
    """Extract the facts a reader needs from the document."""

    document: str = dspy.InputField()
    facts: str = dspy.OutputField(desc="the key facts, in one or two sentences")


class AnswerQuestion(dspy.Signature):
    """Answer the question from the facts only."""

    facts: str = dspy.InputField()
    question: str = dspy.InputField()
    answer: str = dspy.OutputField(desc="a short answer")


class FactsThenAnswer(dspy.Module):
    """Two modules: ``extract`` feeds ``answer``."""

    def __init__(self) -> None:
        super().__init__()
        self.extract = dspy.Predict(ExtractFacts)
        self.answer = dspy.Predict(AnswerQuestion)

    def forward(self, document: str, question: str) -> dspy.Prediction:
        facts = self.extract(document=document).facts
        answer = self.answer(facts=facts, question=question).answer
        return dspy.Prediction(facts=facts, answer=answer)


def proxy_lm(base_url: str, model: str, workflow_id: str, *, step: str | None = None,
             api_key: str | None = None, max_tokens: int = 128) -> dspy.LM:
    """DSPy's OpenAI-compatible LM pointed at the proxy, every request joining workflow
    ``workflow_id`` (as step ``step``). DSPy's cache and retries are off: the proxy
    retries model calls itself (one layer of retries only)."""
    headers = {WORKFLOW_HEADER: workflow_id, **({STEP_HEADER: step} if step else {})}
    return dspy.LM(f"openai/{model}", api_base=f"{base_url}/v1",
                   api_key=api_key or default_api_key() or "unused", cache=False,
                   num_retries=0, temperature=0.0, max_tokens=max_tokens, headers=headers)


def program_on_proxy(base_url: str, model: str, workflow_id: str) -> FactsThenAnswer:
    """The program with each module on its own step of workflow ``workflow_id``."""
    program = FactsThenAnswer()
    for name, predictor in (("extract", program.extract), ("answer", program.answer)):
        predictor.lm = proxy_lm(base_url, model, workflow_id, step=name)
    return program


def json_schema_outputs(model: str) -> None:
    """Tell LiteLLM that ``openai/<model>`` takes JSON Schema ``response_format``s (the
    proxy does, on every backend), so DSPy's JSONAdapter sends the signature's schema."""
    litellm.register_model({f"openai/{model}": {
        "litellm_provider": "openai", "mode": "chat", "supports_response_schema": True}})


def inferred(base_url: str, workflow_id: str) -> dict[str, Any]:
    """``GET /v1/workflows/{id}``: the workflow the proxy inferred from the calls.

    Raises:
        httpx.HTTPError: the proxy could not be reached or answered an error.
    """
    r = httpx.get(f"{base_url}/v1/workflows/{workflow_id}", timeout=30,
                  headers=_auth())
    r.raise_for_status()
    doc: dict[str, Any] = r.json()
    return doc


def _auth() -> dict[str, str]:
    key = default_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(base_url: str) -> str:
    """The proxy's first served model (``GET /v1/models``)."""
    r = httpx.get(f"{base_url}/v1/models", timeout=30, headers=_auth())
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def run(document: str, question: str, *, base_url: str, model: str,
        adapter: str = "chat", workflow_id: str | None = None
        ) -> tuple[dspy.Prediction, dict[str, Any]]:
    """Run the program once as workflow ``workflow_id`` (default: a fresh id).

    Returns:
        The program's prediction and the inferred workflow document.
    """
    workflow_id = workflow_id or f"dspy-{uuid.uuid4().hex[:12]}"
    json_schema_outputs(model)  # also for ChatAdapter's fallback to JSONAdapter
    chosen = dspy.JSONAdapter() if adapter == "json" else dspy.ChatAdapter()
    program = program_on_proxy(base_url, model, workflow_id)
    with dspy.context(adapter=chosen):
        prediction = program(document=document, question=question)
    return prediction, inferred(base_url, workflow_id)


def _print(prediction: dspy.Prediction, doc: dict[str, Any]) -> None:
    print(f" facts: {' '.join(str(prediction.facts).split())}")
    print(f"answer: {' '.join(str(prediction.answer).split())}")
    print(f"\nworkflow {doc['id']} inferred from {len(doc['steps'])} calls:")
    for s in doc["steps"]:
        print(f"  {s['id']:<10} {s['latency_ms']:8.1f} ms   after "
              f"{', '.join(s['depends_on']) or '-'}")
    report = doc["report"]
    print(f"critical path: {' -> '.join(report['critical_path'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--document", default=DOCUMENT)
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--model", default=None, help="served model (default: the first)")
    parser.add_argument("--adapter", choices=("chat", "json"), default="chat")
    args = parser.parse_args(argv)
    base_url = default_base_url()
    try:
        model = args.model or served_model(base_url)
    except httpx.TransportError as exc:
        print(f"no proxy at {base_url}: {exc}", file=sys.stderr)
        return 2
    try:
        prediction, doc = run(args.document, args.question, base_url=base_url,
                              model=model, adapter=args.adapter)
    except (httpx.HTTPError, litellm.exceptions.APIError, AdapterParseError) as exc:
        print(f"the program failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    _print(prediction, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
