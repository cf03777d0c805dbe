"""Delta-only turns (issue 35 §3): a session's prompt ids grown by the tokenized new
messages equal the full chat-template render tokenized whole, turn after turn
(hypothesis over conversations, on the default model's own template and tokenizer),
and anything that is not a continuation falls back to the full render."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlift.local_engine.delta import DeltaPrompts

MODEL = Path(os.environ.get("FLOWLIFT_CACHE_DIR", Path(__file__).parents[2] / ".cache"
                            / "flowlift")) / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if not (MODEL / "tokenizer.json").exists():
        pytest.skip("the default model is not converted here")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(MODEL))


def full_ids(tok: Any, msgs: list[dict[str, Any]]) -> list[int]:
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def prompts(tok: Any) -> DeltaPrompts:
    return DeltaPrompts(
        lambda m, gen: tok.apply_chat_template(m, add_generation_prompt=gen, tokenize=False),
        lambda t: list(tok.encode(t, add_special_tokens=False)))


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
turns = st.lists(st.tuples(texts, texts), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(system=st.one_of(st.none(), texts), first=texts, steps=turns)
def test_delta_ids_equal_the_full_render_turn_after_turn(tokenizer, system, first, steps):
    delta = prompts(tokenizer)
    assert delta.exact
    msgs: list[dict[str, Any]] = ([] if system is None else
                                  [{"role": "system", "content": system}])
    msgs.append({"role": "user", "content": first})
    assert delta.ids("s", msgs) == full_ids(tokenizer, msgs)
    for answer, result in steps:
        msgs = [*msgs, {"role": "assistant", "content": answer},
                {"role": "user", "content": result}]
        assert delta.ids("s", msgs) == full_ids(tokenizer, msgs)
    assert delta.deltas == len(steps)


def test_a_request_that_does_not_extend_the_session_is_rendered_whole(tokenizer):
    delta = prompts(tokenizer)
    a = [{"role": "user", "content": "one"}]
    b = [{"role": "user", "content": "another"}, {"role": "assistant", "content": "x"},
         {"role": "user", "content": "y"}]
    delta.ids("s", a)
    assert delta.ids("s", b) == full_ids(tokenizer, b)  # edited history: full
    assert delta.ids("s", b[:1]) == full_ids(tokenizer, b[:1])  # shorter: full
    assert delta.ids(None, b) == full_ids(tokenizer, b)
    assert delta.deltas == 0 and delta.full == 4


def test_a_template_that_is_not_per_message_gets_no_deltas():
    def render(msgs: list[dict[str, Any]], gen: bool) -> str:  # counts the messages
        return f"[{len(msgs)}]" + "|".join(m["content"] for m in msgs) + (">" if gen else "")

    delta = DeltaPrompts(render, lambda t: [ord(c) for c in t])
    assert not delta.exact
    msgs = [{"role": "user", "content": "a"}]
    delta.ids("s", msgs)
    more = [*msgs, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert delta.ids("s", more) == [ord(c) for c in render(more, True)]
    assert delta.deltas == 0


class _Tagged:
    """A tokenizer stand-in: one token per word; a render with tools starts ``TOOLS``."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[str]:
        return text.split()

    def apply_chat_template(self, msgs: list[dict[str, Any]], add_generation_prompt: bool,
                            tokenize: bool, tools: Any = None) -> str:
        return ("TOOLS " if tools else "") + " ".join(m["content"] or "" for m in msgs)


def test_a_session_turn_with_tools_is_rendered_whole_with_them() -> None:
    """The delta ids never carry tools (the model's own tool format renders them into
    the template): a session's turn that offers tools is rendered whole."""
    from flowlift.local_engine.base import ChatMessage, GenerationRequest, ToolDef
    from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: only the prompt is built
    engine.config = VLLMConfig(model="unused", served_model_name="m", max_model_len=4096)
    engine._tokenizer = tok = _Tagged()
    engine._delta = DeltaPrompts(
        lambda m, gen: tok.apply_chat_template(m, add_generation_prompt=gen, tokenize=False),
        lambda t: list(tok.encode(t, add_special_tokens=False)))
    plain = GenerationRequest(request_id="r1", model="m", session_id="s",
                              messages=[ChatMessage("user", "hello there")])
    assert engine._prompt_ids(plain) == ["hello", "there"]
    tools = (ToolDef("search", "search the docs", {"type": "object", "properties": {}}),)
    with_tools = GenerationRequest(request_id="r2", model="m", session_id="s", tools=tools,
                                   messages=[ChatMessage("user", "hello there")])
    assert engine._prompt_ids(with_tools)[0] == "TOOLS"
