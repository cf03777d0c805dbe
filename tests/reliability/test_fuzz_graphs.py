"""Hypothesis over what ``tests/proxy/test_fuzz_openai.py`` (schemathesis, spec-shaped OpenAI
bodies) does not reach: graph documents on ``POST /v1/workflows:compile`` and ``POST
/v1/workflows`` (runs followed to their end, ``@tool`` results posted, some of them
malformed), and chat bodies that are *not* spec-shaped (wrong types, junk JSON, odd
headers) on both the embedded and the upstream path.

For every case: no 5xx, an answer within :data:`TIMEOUT_S`, and every rejection names
the problem -- the OpenAI error shape with a ``message`` and a ``param`` or a
``problems`` list. ``FLOWLIFT_FUZZ_SCALE=N`` multiplies the examples.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.openapi_spec import live_proxy

SCALE = int(os.environ.get("FLOWLIFT_FUZZ_SCALE", "1"))
TIMEOUT_S = 10.0
SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck),
            "phases": (Phase.explicit, Phase.reuse, Phase.generate)}
RAN: Counter[str] = Counter()

# strings include lone surrogates now and then (json.dumps writes them as "\ud800"
# escapes) and floats NaN and Infinity (written as such): neither is JSON
surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                     max_size=2)
junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats()
                    | st.text(max_size=8) | surrogates,
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
ids = st.sampled_from(["a", "b", "c", "d", "", "x" * 201]) | st.text(max_size=4)
ref = st.fixed_dictionaries({"ref": ids}, optional={
    "path": st.lists(st.text(max_size=4) | st.integers(-1, 3), max_size=2)})
part = st.fixed_dictionaries({"text": st.text(max_size=24)}) | ref | junk
message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]),
    "content": st.lists(part, max_size=3) | st.text(max_size=8)})
schema = st.sampled_from([
    {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    {"type": "string", "maxLength": 5}, {"enum": ["red", "blue"]}, {"enum": []},
    {"$ref": "#/$defs/missing"}, {"type": "bogus"}, {"minLength": -1},
    {"type": "object", "properties": {"child": {"$ref": "#"}}}]) | junk
contract = (st.fixed_dictionaries({"json_schema": schema})
            | st.fixed_dictionaries({"choices": st.lists(st.text(max_size=6), max_size=3)})
            | junk)
params = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-2, 40_000) | junk, "temperature": st.floats() | junk,
    "top_p": st.floats(-1, 2), "stop": st.lists(st.text(max_size=3), max_size=2),
    "seed": st.integers(-2**70, 2**70)})
llm = st.fixed_dictionaries({"kind": st.just("llm"), "id": ids,
                             "messages": st.lists(message, max_size=3)}, optional={
    "model": st.sampled_from(["fake-model", "up-model", "nope", "http://127.0.0.1:9/v1"])
    | st.none(), "params": params, "contract": contract, "name": st.text(max_size=4)})
arg = ref | st.fixed_dictionaries({"value": junk}) | st.fixed_dictionaries(
    {"template": st.lists(part, max_size=2)}) | junk
tool = st.fixed_dictionaries({"kind": st.just("tool"), "id": ids, "name": st.text(max_size=6)},
                             optional={"args": st.lists(arg, max_size=2),
                                       "kwargs": st.dictionaries(st.text(max_size=3), arg,
                                                                 max_size=2)})
inp = st.fixed_dictionaries({"kind": st.just("input"), "id": ids, "value": junk})
node = llm | tool | inp | st.fixed_dictionaries({"kind": st.text(max_size=5), "id": ids}) | junk
graph = st.fixed_dictionaries({"nodes": st.lists(node, max_size=5)}, optional={
    "version": st.just("1") | st.text(max_size=2), "name": st.text(max_size=8),
    "class": st.sampled_from(["interactive", "batch", "urgent"]),
    "deadline_s": st.floats(1e-3, 1e6) | st.integers(-1, 10) | junk,
    "metadata": junk, "id": st.none() | st.text(max_size=6)})


@st.composite
def valid_graph(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed graph (ids unique, references only to earlier nodes), often run to
    its end, with a JSON value anywhere a value may be."""
    nodes: list[dict[str, Any]] = []
    for i in range(draw(st.integers(1, 5))):
        earlier = [{"ref": n["id"]} for n in nodes]
        refs = st.sampled_from(earlier) if earlier else st.nothing()
        kind = draw(st.sampled_from(["llm", "llm", "tool", "input"]))
        if kind == "llm":
            text = st.fixed_dictionaries({"text": st.text(min_size=1, max_size=12)})
            content = draw(st.lists(text | refs, min_size=1, max_size=3))
            n: dict[str, Any] = {"kind": "llm", "id": f"n{i}", "messages": [
                {"role": "user", "content": content}],
                "params": {"max_tokens": draw(st.integers(1, 16))}}
            if draw(st.booleans()):
                n["contract"] = draw(st.fixed_dictionaries({"json_schema": schema})
                                     | st.fixed_dictionaries({"choices": st.lists(
                                         st.text(min_size=1, max_size=6), min_size=1,
                                         max_size=3)}))
        elif kind == "tool":
            n = {"kind": "tool", "id": f"n{i}", "name": "t",
                 "args": draw(st.lists(refs | st.fixed_dictionaries({"value": junk}),
                                       max_size=2))}
        else:
            n = {"kind": "input", "id": f"n{i}", "value": draw(junk)}
        nodes.append(n)
    return {"nodes": nodes, **draw(st.fixed_dictionaries({}, optional={
        "class": st.sampled_from(["interactive", "batch"]),
        "deadline_s": st.floats(0.001, 60)}))}


documents = valid_graph() | graph | junk


@pytest.fixture(scope="module")
def base():
    for live in live_proxy():
        yield live.url


def assert_named_rejection(resp: httpx.Response) -> None:
    """No 5xx; a 4xx in the OpenAI error shape that names the problem."""
    assert resp.status_code < 500, f"{resp.status_code}: {resp.text[:2000]}"
    if resp.status_code < 400:
        return
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    if "X-Flowlift-Backend" in resp.headers:
        return  # an upstream's own 4xx, passed on as it came (the README's promise)
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["param"] or err.get("problems"), f"the rejection names no problem: {err}"


def follow_run(client: httpx.Client, base: str, resp: httpx.Response, answer: Any) -> str:
    """Read a run's event stream to its end, posting each wanted tool's result
    (``answer``; when that is malformed, a named 400, then a well-formed one)."""
    run_id, status = None, None
    event = None
    for line in resp.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = orjson.loads(line[5:])  # strict JSON (no NaN): what any client parses
            run_id = run_id or data.get("run_id")
            if event == "tool.wanted":
                url = f"{base}/v1/workflows/{run_id}/steps/{quote(data['step_id'], safe='')}/result"
                got = _post(client, url, answer)
                assert_named_rejection(got)
                not_waiting = got.status_code == 400 and "is not waiting" in got.text
                if got.status_code == 400 and not not_waiting:  # malformed: still waits
                    answer = {"value": "a well-formed result"}
                    again = _post(client, url, answer)
                    assert again.status_code == 200 or "is not waiting" in again.text, \
                        again.text  # taken, or the run ended between the two posts
                # not waiting: the run ended meanwhile (its deadline, a failed input)
            elif event == "run.finished":
                status = data["status"]
    assert status is not None, "the run's stream ended without run.finished"
    return status


def _post(client: httpx.Client, url: str, doc: Any) -> httpx.Response:
    t0 = time.monotonic()
    resp = client.post(url, content=json.dumps(doc), headers={"Content-Type":
                                                              "application/json"})
    assert time.monotonic() - t0 < TIMEOUT_S
    return resp


@pytest.mark.timeout(300 * SCALE)
def test_graph_documents_compile_or_are_rejected_by_name(base):
    client = httpx.Client(timeout=TIMEOUT_S)

    @given(doc=documents)
    @settings(max_examples=300 * SCALE, **SETTINGS)
    def fuzz(doc: Any) -> None:
        RAN["compile"] += 1
        resp = _post(client, f"{base}/v1/workflows:compile", doc)
        assert_named_rejection(resp)
        RAN[f"compile {resp.status_code}"] += 1
        if resp.status_code == 200:
            assert "steps" in resp.json() or resp.json(), resp.text

    fuzz()
    assert RAN["compile 200"] > 10 and RAN["compile 400"] > 10, RAN


@pytest.mark.timeout(300 * SCALE)
def test_graph_documents_run_to_their_end_or_are_rejected_by_name(base):
    client = httpx.Client(timeout=TIMEOUT_S)

    @given(doc=valid_graph() | graph, answer=st.fixed_dictionaries({"value": junk})
           | st.fixed_dictionaries({"error": st.text(max_size=8)}) | junk)
    @settings(max_examples=200 * SCALE, **SETTINGS)
    def fuzz(doc: dict[str, Any], answer: Any) -> None:
        try:
            run_one(doc, answer)
        except (AssertionError, httpx.HTTPError, ValueError) as exc:
            raise AssertionError(f"{type(exc).__name__}: {exc}\ngraph: {json.dumps(doc)}"
                                 f"\ntool answer: {json.dumps(answer)}") from None

    def run_one(doc: dict[str, Any], answer: Any) -> None:
        RAN["workflows"] += 1
        t0 = time.monotonic()
        with client.stream("POST", f"{base}/v1/workflows", content=json.dumps(doc),
                           headers={"Content-Type": "application/json"}) as resp:
            if resp.status_code != 200:
                resp.read()
                assert_named_rejection(resp)
                RAN[f"workflows {resp.status_code}"] += 1
                return
            status = follow_run(client, base, resp, answer)
        assert time.monotonic() - t0 < 2 * TIMEOUT_S, "the run took too long"
        RAN[f"workflows ran {status}"] += 1

    fuzz()
    # (the fake engine cuts constrained outputs at max_tokens, 1-16 here, as vLLM does:
    # some runs end failed on their contracts; both kinds ran to their end)
    ran = RAN["workflows ran succeeded"] + RAN["workflows ran failed"]
    assert RAN["workflows 400"] > 10 and ran > 40 and RAN["workflows ran succeeded"] > 25, RAN


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
FIELDS = ["model", "messages", "stream", "n", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "stop", "tools", "tool_choice", "response_format",
          "logprobs", "top_logprobs", "seed", "stream_options", "metadata", "logit_bias",
          "user", "frequency_penalty", "presence_penalty", "parallel_tool_calls"]
bodies = st.builds(
    lambda model, changes, drop: {k: v for k, v in {**CHAT, "model": model, **changes}.items()
                                  if k not in drop},
    st.sampled_from(["fake-model", "up-model"]) | junk,
    st.dictionaries(st.sampled_from(FIELDS), junk, max_size=3),
    st.sets(st.sampled_from(["model", "messages"]), max_size=1))
headers = st.fixed_dictionaries({}, optional={
    "X-Flowlift-Session": st.text(st.characters(max_codepoint=126), max_size=12),
    "X-Flowlift-Workflow": st.text(st.characters(max_codepoint=126), max_size=12),
    "X-Flowlift-Step": st.text(st.characters(max_codepoint=126), max_size=12)})


@pytest.mark.timeout(300 * SCALE)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_off_spec_chat_bodies_never_5xx_and_rejections_name_the_field(base, path):
    client = httpx.Client(timeout=TIMEOUT_S)

    @given(body=bodies | junk, extra=headers)
    @settings(max_examples=150 * SCALE, **SETTINGS)
    def fuzz(body: Any, extra: dict[str, str]) -> None:
        if path == "/v1/completions" and isinstance(body, dict) and "messages" in body:
            body = {**body, "prompt": body.pop("messages")}
        RAN[path] += 1
        t0 = time.monotonic()
        try:
            resp = client.post(f"{base}{path}", content=json.dumps(body),
                               headers={"Content-Type": "application/json", **{
                                   k: v for k, v in extra.items() if v.isprintable()}})
        except httpx.LocalProtocolError:
            return  # a header httpx itself refuses to send
        assert time.monotonic() - t0 < TIMEOUT_S
        assert_named_rejection(resp)
        RAN[f"{path} {resp.status_code}"] += 1

    fuzz()
    assert RAN[f"{path} 200"] > 0 and RAN[f"{path} 400"] > 10, RAN


# Found by these fuzzers: the JSON fallback parser (for integers past 64 bits) took NaN,
# Infinity and lone surrogate escapes; NaN came back out in events no strict client can
# parse, and a lone surrogate broke an embedded stream after its headers (a 500 mid-way).
@pytest.mark.parametrize("bad", ["NaN", "-Infinity", '"x\\ud800"', '"\\udfff y"'])
@pytest.mark.parametrize("route", ["/v1/workflows", "/v1/workflows:compile",
                                   "/v1/chat/completions", "/v1/chat/completions stream"])
def test_nan_and_lone_surrogates_are_a_400_naming_the_body(base, route, bad):
    path, _, stream = route.partition(" ")
    if path.startswith("/v1/chat"):
        doc = ('{"model": "fake-model", "stream": ' + ("true" if stream else "false")
               + ', "messages": [{"role": "user", "content": "hi", "name": ' + bad + '}]}')
    else:
        doc = ('{"nodes": [{"kind": "input", "id": "a", "value": ' + bad + '}, {"kind": '
               '"llm", "id": "b", "messages": [{"role": "user", "content": [{"ref": "a"}]}]}]}')
    resp = httpx.post(f"{base}{path}", content=doc, headers={"Content-Type":
                                                              "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "body"


def test_zz_report_cases_run(capsys):
    with capsys.disabled():
        print("\nfuzz cases run: " + ", ".join(f"{k}={v}" for k, v in sorted(RAN.items())))


@pytest.mark.parametrize("step_id", [".", ".."])
def test_dot_segment_step_ids_are_rejected_by_name(base, step_id):
    """Found by the run fuzzer: a tool step named '..' was accepted, but its result route
    (``/v1/workflows/{run}/steps/../result``) is normalised away by every HTTP client, so
    the run could never finish."""
    graph = {"nodes": [{"kind": "tool", "id": step_id, "name": "t"}]}
    resp = httpx.post(f"{base}/v1/workflows", json=graph)
    assert resp.status_code == 400
    assert any("URL" in p for p in resp.json()["error"]["problems"])
