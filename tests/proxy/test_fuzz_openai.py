"""A schema-driven fuzzer (schemathesis over hypothesis) on the OpenAI operations the
proxy serves, on a real port: ``fake-model`` on the embedded path (a FakeEngine),
``up-model`` forwarded to a spec-valid fake upstream.

Bodies come from OpenAI's published request schemas (``tests/openapi_spec.py``), with
``model`` narrowed to the served models so most requests reach an engine; positive
(valid by the spec) and negative (invalid) bodies alike. For each request: no 5xx, an
answer within :data:`TIMEOUT_S`, an error body that is a spec ``ErrorResponse``, a 200
body that is the operation's spec response (each event of a stream a spec chunk, the
stream finished with ``[DONE]`` and no in-band error). A failure prints the request as
a ``curl`` command.
"""

from __future__ import annotations

import copy
import json
import os
import time
from typing import Any

import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from flowlift.testing import parse_sse
from tests.openapi_spec import live_proxy, openapi, validate

MODELS = ["fake-model", "up-model"]
TIMEOUT_S = 10.0
# FLOWLIFT_FUZZ_SCALE=20 multiplies the examples, for a longer hunt than CI's.
SCALE = int(os.environ.get("FLOWLIFT_FUZZ_SCALE", "1"))
# No shrinking: each step is an HTTP round trip and a failure can take minutes to
# shrink; the failing request is printed whole. Add Phase.shrink to minimise one.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
CHAT = ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse")
# (document, operation) -> (examples per generation mode, the spec schema of its 200
# JSON answer, of its stream events)
CASES = {
    ("spec", "POST /chat/completions"): (30, *CHAT),
    ("embedded", "POST /chat/completions"): (40, *CHAT),
    ("spec", "POST /completions"): (30, "CreateCompletionResponse", None),
    ("spec", "POST /embeddings"): (20, "CreateEmbeddingResponse", None),
    ("spec", "GET /models"): (5, "ListModelsResponse", None),
}
# What the embedded engine acts on in a chat request (each field as the spec has it).
EMBEDDED_FIELDS = ("temperature", "top_p", "max_completion_tokens", "max_tokens",
                   "frequency_penalty", "presence_penalty", "response_format", "stream",
                   "stream_options", "stop", "logprobs", "top_logprobs", "n", "seed",
                   "tools", "tool_choice", "parallel_tool_calls")
ROLES = ("User", "Assistant", "Tool")
TEXT_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant"]},
    "content": {"type": "string"}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _properties(schemas: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        node = schemas[node["$ref"].rsplit("/", 1)[1]]
    out: dict[str, Any] = {}
    for sub in node.get("allOf", ()):
        out |= _properties(schemas, sub)
    return out | node.get("properties", {})


def fuzz_document(focus: str) -> dict[str, Any]:
    """The vendored spec with each request's ``model`` narrowed to :data:`MODELS` and
    function names to the characters the spec allows (``focus="spec"``), or also
    (``"embedded"``) with chat requests cut down to ``fake-model``, the
    :data:`EMBEDDED_FIELDS`, 1-4 messages (plain text ones or the spec's user, assistant
    and tool messages), 1-3 function tools, ``n`` up to 8, ``stream`` true or false,
    ``top_p`` above 0 and token limits of 1 or more, so that many reach the engine."""
    doc = copy.deepcopy(openapi())
    schemas = doc["components"]["schemas"]

    def narrow(node: dict[str, Any]) -> None:
        if "model" in node.get("properties", {}):
            node["properties"]["model"] = {"type": "string", "enum": MODELS}
        for sub in node.get("allOf", ()):
            narrow(sub)

    for name in ("CreateChatCompletionRequest", "CreateCompletionRequest",
                 "CreateEmbeddingRequest"):
        narrow(schemas[name])
    # The rule the spec states in words, as a pattern.
    schemas["FunctionObject"]["properties"]["name"]["pattern"] = "^[a-zA-Z0-9_-]{1,64}$"
    if focus == "embedded":
        chat = _properties(schemas, schemas["CreateChatCompletionRequest"])
        schemas["CreateChatCompletionRequest"] = {
            "type": "object", "required": ["model", "messages"], "properties": {
                k: chat[k] for k in EMBEDDED_FIELDS} | {
            "model": {"type": "string", "enum": ["fake-model"]},
            "messages": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"anyOf": [
                TEXT_MESSAGE, *(_ref(f"ChatCompletionRequest{r}Message") for r in ROLES)]}},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            **{k: {"type": "integer", "minimum": 1} for k in ("max_tokens",
                                                              "max_completion_tokens")},
            "tools": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": _ref("ChatCompletionTool")},
            "stream": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 1, "maximum": 8}}}
    return doc


@pytest.fixture(scope="module")
def base_url():
    for live in live_proxy():
        yield f"{live.url}/v1"


@pytest.fixture(scope="module")
def schemas():
    return {focus: schemathesis.openapi.from_dict(fuzz_document(focus))
            for focus in ("spec", "embedded")}


def check_stream(text: str, chunk_schema: str | None) -> None:
    events = [d for _, d in parse_sse(text)]
    assert events and events[-1] == "[DONE]", f"stream not finished: {events[-2:]}"
    for event in events[:-1]:
        assert isinstance(event, dict) and "error" not in event, f"in-band error: {event}"
        if chunk_schema is not None:
            validate(event, chunk_schema)


def check_answer(resp: requests.Response, body_schema: str, chunk_schema: str | None) -> None:
    """The checks of the module docstring on one answer."""
    assert resp.status_code < 500, f"server error {resp.status_code}: {resp.text[:2000]}"
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        assert resp.status_code == 200
        check_stream(resp.text, chunk_schema)
        return
    doc = resp.json()
    validate(doc, body_schema if resp.status_code < 300 else "ErrorResponse")


@pytest.mark.timeout(180 * SCALE)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=lambda m: m.value)
@pytest.mark.parametrize(("focus", "label"), [pytest.param(*k, id=" ".join(k)) for k in CASES])
def test_no_server_error_no_hang_spec_shaped_answers(schemas, base_url, focus, label, mode):
    examples, body_schema, chunk_schema = CASES[focus, label]
    operation = schemas[focus].find_operation_by_label(label)
    assert operation is not None, label
    session = requests.Session()
    seen: dict[int, int] = {}

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=examples * SCALE, deadline=None, suppress_health_check=list(HealthCheck),
              phases=PHASES)
    def fuzz(case: schemathesis.Case) -> None:
        # Sent with requests itself: schemathesis' own call keeps only 20 stream events.
        request = case.as_transport_kwargs(base_url=base_url)
        try:
            t0 = time.monotonic()
            resp = session.request(**request, timeout=TIMEOUT_S)
            assert time.monotonic() - t0 < TIMEOUT_S, "answer took too long"
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            check_answer(resp, body_schema, chunk_schema)
        except (AssertionError, ValueError, requests.RequestException) as exc:
            raise AssertionError(f"{type(exc).__name__}: {exc}\nrequest: "
                                 f"{case.as_curl_command()[:4000]}") from None

    fuzz()
    if mode is GenerationMode.POSITIVE:  # it reached the engines, not only validation
        assert seen.get(200, 0) > 0, seen


# Valid JSON Schemas in `response_format` / tool parameters that the fuzzing hunt found
# answered with a 500 by the FakeEngine (fixed: local $ref pointers, recursion, required
# keys without properties), and unsatisfiable ones that must be a 400, not a 500.
def _ask_for(base_url, schema):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "out", "schema": schema}}}
    return requests.post(f"{base_url}/chat/completions", json=body, timeout=TIMEOUT_S)


@pytest.mark.parametrize("schema", [
    pytest.param({"definitions": {"n": {"type": "integer"}}, "type": "object",
                  "properties": {"x": {"$ref": "#/definitions/n"}}, "required": ["x"]},
                 id="definitions-ref"),
    pytest.param({"type": "object", "properties": {"child": {"$ref": "#"}}},
                 id="recursive"),
    pytest.param({"type": "object", "required": ["a"]}, id="required-only"),
    pytest.param({"$defs": {"n": {"type": "integer"}}, "type": "object",
                  "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"]},
                 id="defs-ref"),
])
def test_valid_output_schemas_are_answered(base_url, schema):
    resp = _ask_for(base_url, schema)
    assert resp.status_code == 200, resp.text
    answer = json.loads(resp.json()["choices"][0]["message"]["content"])
    jsonschema.Draft202012Validator(schema).validate(answer)


@pytest.mark.parametrize("schema", [{"$ref": "#/$defs/missing"}, {"enum": []}])
def test_unsatisfiable_output_schemas_are_a_400(base_url, schema):
    resp = _ask_for(base_url, schema)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith("response_format")
