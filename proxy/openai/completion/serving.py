"""``POST /v1/completions`` (OpenAI's legacy text completions) on the embedded engine.

The ``prompt`` goes to the model as it is, with no chat template (a string, or a list
of strings: ``n`` choices per prompt, indexed ``prompt * n + i``). Shapes follow
``CreateCompletionResponse`` in ``shared/specs/openai-openapi.yaml``: ``object:
"text_completion"`` for whole answers and stream chunks alike; a stream ends with
``data: [DONE]``, after a chunk with ``choices: []`` and the usage when
``stream_options.include_usage`` is set. ``logprobs`` (0-20 alternatives) come in the
legacy shape ``{tokens, token_logprobs, top_logprobs, text_offset}``, where each
``top_logprobs`` entry maps the sampled token and the alternatives to their logprobs,
and ``text_offset`` counts characters from the start of the choice's ``text``.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

from aiohttp import web
from pydantic import Field, field_validator

from flowlift.errors import RequestError
from flowlift.local_engine.base import GenerationChunk, GenerationRequest, TokenLogprob, Usage
from flowlift.proxy.dispatch.backends import Backend
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.http import parse_model
from flowlift.proxy.openai import generation as gen
from flowlift.proxy.openai.generation import OnOutput, SamplingFields, Unsupported
from flowlift.proxy.sessions.table import program_of
from flowlift.proxy.telemetry.requests import RequestTrace

_UNSUPPORTED: Unsupported = {
    "suffix": (bool, "text insertion is not supported; put all the text in `prompt`"),
    "best_of": (lambda v: v > 1, "ask for `n` choices and pick the best on your side"),
}


class CompletionRequest(SamplingFields):
    """The fields of a legacy completion request flowlift acts on; unknown fields are
    accepted and ignored."""

    prompt: str | list[Any]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _text_prompts(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list):
            if not value:
                raise ValueError("send at least one prompt")
            if not all(isinstance(p, str) for p in value):
                raise ValueError("token-id prompts are not supported by the embedded "
                                 "engine; send the prompt as text (a string or a list of "
                                 "strings)")
        return value

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def legacy_logprobs(items: list[TokenLogprob], start: int = 0) -> dict[str, Any]:
    """The legacy ``logprobs`` object of generated tokens whose text starts at character
    ``start`` of the choice's ``text``."""
    offsets, at = [], start
    for t in items:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{t.token: t.logprob, **dict(t.top)} for t in items],
            "text_offset": offsets}


class _TextChoice:
    """One choice of a legacy completion: stream entries and the final entry."""

    def __init__(self, index: int, prompt: str, echo: bool, logprobs: bool) -> None:
        self.index = index
        self.echo = prompt if echo else ""
        self.text = ""
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.finish: str | None = None
        self.usage: Usage | None = None

    def _entry(self, text: str, items: list[TokenLogprob] | None,
               finish: str | None = None) -> dict[str, Any]:
        lp = None
        if items is not None and self.logprobs is not None:
            emitted = len(self.echo) + len(self.text) - len(text)
            lp = legacy_logprobs(items, emitted)
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}

    def opening(self) -> list[dict[str, Any]]:
        return [self._entry(self.echo, [])] if self.echo else []

    def step(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        self.usage = chunk.usage or self.usage
        self.text += chunk.text
        items = list(chunk.logprobs or ())
        if self.logprobs is not None:
            self.logprobs.extend(items)
        out = [self._entry(chunk.text, items)] if chunk.text or items else []
        if chunk.finish_reason:
            self.finish = chunk.finish_reason
            out.append(self._entry("", None, self.finish))
        return out

    def final(self) -> dict[str, Any]:
        lp = None if self.logprobs is None else legacy_logprobs(self.logprobs,
                                                                len(self.echo))
        return {"index": self.index, "text": self.echo + self.text, "logprobs": lp,
                "finish_reason": self.finish or "stop"}


async def completions(request: web.Request, data: Any, model: str, backend: Backend, *,
                      on_output: OnOutput | None = None,
                      traced: RequestTrace | None = None) -> web.StreamResponse:
    """Answer one legacy completion request (``data``: the parsed JSON body).

    Args:
        model: the served model name (aliases resolved).
        on_output: called once when the answer completes (streamed or not) with the
            first choice's generated text (without the echoed prompt) and the ``usage``
            object; not called for a failed answer.
        traced: the request's trace, from where it was dispatched (None: untraced).

    Returns:
        A ``text_completion`` JSON response, or for ``stream: true`` an SSE stream of
        ``text_completion`` chunks.

    Raises:
        RequestError: a malformed request or a field the embedded engine cannot honour
            (400, named in ``param``: token-id prompts, ``suffix``, ``best_of`` > 1,
            ``echo`` together with ``logprobs``); a prompt too long (``param="prompt"``).
        EngineError: the engine failed before the first token (503).
    """
    body = parse_model(CompletionRequest, data, "completion request")
    gen.reject_unsupported(body, _UNSUPPORTED)
    if body.echo and body.logprobs is not None:
        raise RequestError("echo with logprobs would need the prompt's logprobs, which the "
                           "embedded engine does not report; send one of them",
                           param="echo")
    caps = backend.engine.capabilities
    if not caps.raw_prompt or (body.logprobs is not None and not caps.logprobs):
        raise RequestError("this engine cannot serve legacy completions with these "
                           "options; use /v1/chat/completions", param="model")
    cid = f"cmpl-{secrets.token_hex(12)}"
    prompts, n = body.prompts, body.n or 1
    base = GenerationRequest(request_id=cid, model=model,
                             sampling=body.sampling(body.max_tokens, body.logprobs),
                             session_id=request.headers.get("x-flowlift-session"))
    requests = [r for p, text in enumerate(prompts) for r in gen.fan_out(
        dataclasses.replace(base, request_id=f"{cid}-p{p}" if len(prompts) > 1 else cid,
                            prompt=text), n)]
    choices = [_TextChoice(i, prompts[i // n], bool(body.echo), body.logprobs is not None)
               for i in range(len(requests))]
    head = {"id": cid, "object": "text_completion", "created": int(time.time()),
            "model": model}

    def done() -> dict[str, Any]:
        total = gen.total_usage([c.usage for c in choices], prompts=len(prompts))
        usage = gen.usage_json(total)
        gen.notify(on_output, choices[0].text, usage)
        return usage

    timing = gen.Timing(traced=traced)
    async with gen.started(backend, requests, timing, Priority.of(
            "interactive", program=program_of(request))) as chunks:
        if body.stream:
            opening = [e for c in choices for e in c.opening()]
            return await gen.stream_choices(request, head, body.include_usage, opening,
                                            chunks, lambda i, chunk: choices[i].step(chunk),
                                            done)
        async for index, chunk in chunks:
            choices[index].step(chunk)
    return web.json_response({**head, "choices": [c.final() for c in choices],
                              "usage": done()},
                             headers={"Server-Timing": timing.server_timing()})
