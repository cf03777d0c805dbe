"""A fake engine that speaks a Qwen-style tool-call format (public test double).

:class:`QwenStyleFakeEngine` is :class:`flowlift.testing.FakeEngine` with
``capabilities.native_tools``: it takes ``tools`` as the embedded engine does for a
model whose ``tool_format`` is ``"native"`` (:mod:`flowlift.local_engine.native_tools`).
Its prompt (:meth:`QwenStyleFakeEngine.prompt_text`, what a responder reads) is
rendered the way Qwen2.5's chat template renders a conversation with tools: the tools'
JSON in ``<tools>...</tools>`` in the system message, earlier calls as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, results as
``<tool_response>...</tool_response>`` in a user turn. Its output is read by vLLM's
``hermes`` parser, as the real engine reads Qwen2.5's, so a responder that writes
``<tool_call>`` blocks makes calls, and one that writes the call as JSON in the content
(as Qwen2.5-Coder often does) makes content that the proxy must recognise.

Needs vLLM installed (the parser is vLLM's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator

from flowlift.local_engine.base import GenerationChunk, GenerationRequest
from flowlift.local_engine.native_tools import (
    NativeToolReader,
    read_native,
    template_messages,
    template_tools,
)
from flowlift.testing.engine import FakeEngine

__all__ = ["QwenStyleFakeEngine", "qwen_style_prompt"]


class _Vocab:
    """The tokenizer a parser needs: the ids of its markup tokens."""

    def get_vocab(self) -> dict[str, int]:
        return {"<tool_call>": 151657, "</tool_call>": 151658}


def qwen_style_prompt(request: GenerationRequest) -> str:
    """``request``'s conversation as Qwen2.5's chat template renders it (tools included;
    the generation prompt at the end)."""
    messages = template_messages(request.messages)
    system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    if request.tools:
        listed = "\n".join(json.dumps(t) for t in template_tools(request.tools))
        system += ("\n\n# Tools\n\nYou may call one or more functions to assist with the "
                   f"user query.\n\n<tools>\n{listed}\n</tools>\n\nFor each function "
                   "call, return a json object with function name and arguments within "
                   "<tool_call></tool_call> XML tags")
    out = [f"<|im_start|>system\n{system}<|im_end|>"]
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            opened = "<|im_start|>user" if i == 0 or messages[i - 1]["role"] != "tool" else ""
            closed = ("<|im_end|>" if i + 1 == len(messages)
                      or messages[i + 1]["role"] != "tool" else "")
            out.append(f"{opened}\n<tool_response>\n{m['content']}\n</tool_response>{closed}")
            continue
        calls = "".join(f'\n<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": '
                        f'{json.dumps(c["function"]["arguments"])}}}\n</tool_call>'
                        for c in m.get("tool_calls", ()))
        out.append(f"<|im_start|>{m['role']}\n{m['content']}{calls}<|im_end|>")
    return "\n".join(out) + "\n<|im_start|>assistant\n"


class QwenStyleFakeEngine(FakeEngine):
    """:class:`~flowlift.testing.FakeEngine` that takes tools in a Qwen-style format
    (see the module); the same arguments."""

    capabilities = dataclasses.replace(FakeEngine.capabilities, native_tools=True)

    @staticmethod
    def prompt_text(request: GenerationRequest) -> str:
        """The raw ``prompt``, or the conversation rendered Qwen-style."""
        return request.prompt if request.prompt is not None else qwen_style_prompt(request)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """:meth:`FakeEngine.generate`; with ``tools``, the output is read by vLLM's
        ``hermes`` parser (calls on the last chunk, ``finish_reason="tool_calls"``)."""
        stream = super().generate(request)
        if request.tools:
            stream = read_native(stream, NativeToolReader("hermes", _Vocab(), request.tools))
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                yield chunk
