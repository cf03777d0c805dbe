"""What a new user meets first (issue 15, item 8): a graph that writes as JSON, a clear
error for an empty workflow, a model cache that does not follow the working directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowlift import GraphError, step, workflow
from flowlift.graph import Graph
from flowlift.local_engine.models import cache_dir


@step(max_tokens=8)
def ask(x):
    return f"Q: {x}"


def test_a_recorded_graph_writes_and_reads_back_as_json(tmp_path):
    with workflow("docs", submit=False, deadline_s=5) as wf:
        ask(ask("a"))
    text = wf.graph().to_json()
    doc = json.loads(text)
    assert doc["class"] == "interactive" and len(doc["nodes"]) == 2
    assert Graph.model_validate_json(text) == wf.graph()
    assert "\n" not in wf.graph().to_json(indent=None)
    path = tmp_path / "graph.json"
    path.write_text(text)
    assert Graph.model_validate(json.loads(path.read_text())).to_wire() == doc


def test_an_empty_workflow_is_a_graph_error_saying_so():
    with pytest.raises(GraphError, match="'nothing' has no steps: call a @step or @tool"), \
            workflow("nothing", base_url="http://127.0.0.1:9"):
        pass
    with workflow("recorded", submit=False) as wf:
        pass
    with pytest.raises(GraphError, match="no steps"):
        wf.graph()


def test_the_model_cache_is_the_users_not_the_working_directorys(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWLIFT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "flowlift"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "flowlift"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: absolute only
    assert cache_dir() == tmp_path / "home" / ".cache" / "flowlift"
    monkeypatch.setenv("FLOWLIFT_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_the_demo_uses_the_users_model_cache_and_the_tests_the_checkouts():
    """The demo's 1.6 GB pair is converted once per user (cache_dir(), shared by every
    project); the suite (CI) keeps its model in the checkout."""
    root = Path(__file__).resolve().parents[2]
    demo = (root / "scripts" / "demo.sh").read_text()
    assert not [line for line in demo.splitlines()
                if "FLOWLIFT_CACHE_DIR=" in line and not line.lstrip().startswith("#")]
    assert "$PWD/.cache" not in demo
    tests = (root / "scripts" / "test.sh").read_text()
    assert 'FLOWLIFT_CACHE_DIR="${FLOWLIFT_CACHE_DIR:-$PWD/.cache/flowlift}"' in tests


# -- max_tokens past the model's context: 400, as OpenAI and vLLM answer ------------------
class _Words:
    """A tokenizer stand-in: one token per word."""

    def encode(self, text, add_special_tokens=True):
        return text.split()

    def apply_chat_template(self, msgs, add_generation_prompt, tokenize):
        return " ".join(m["content"] for m in msgs)


def _engine(context):
    from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: only the request checks run
    engine.config = VLLMConfig(model="unused", served_model_name="m", max_model_len=context)
    engine._tokenizer = _Words()
    return engine


def _request(max_tokens, words=10):
    from flowlift.local_engine.base import ChatMessage, GenerationRequest, SamplingOptions

    return GenerationRequest(request_id="r", model="m",
                             messages=[ChatMessage("user", "w " * words)],
                             sampling=SamplingOptions(max_tokens=max_tokens))


def test_max_tokens_past_the_context_is_a_400_before_generating():
    from flowlift.errors import ContextLengthExceeded

    engine = _engine(context=64)
    assert len(engine._prompt_ids(_request(54))) == 10  # exactly fits
    assert len(engine._prompt_ids(_request(None))) == 10  # no limit asked: the context's
    with pytest.raises(ContextLengthExceeded) as info:
        engine._prompt_ids(_request(55))
    err = info.value
    assert err.status == 400 and err.param == "max_tokens"
    assert err.to_openai()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 64 tokens. However, you requested 65 tokens " \
           "(10 in the messages, 55 in the completion)" in err.message
    assert "max_tokens at most 54" in err.message
