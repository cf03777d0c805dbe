"""A fake OpenAI provider with both tiers, runnable as a process: the synchronous chat API
(standard and flex) and the Batch API (:class:`~flowlift.testing.batch.FakeBatchAPI`),
answering from the request's own constraints, with time-scaled batch turnaround.

It is what ``examples/stdlib_docs/tiered.py`` (the one-command detached demo) points a
proxy's ``openai`` and ``openai-batch`` backends at::

    python -m flowlift.testing.openai --port 8471 --time-scale 600

serves, on ``http://127.0.0.1:8471/v1``:

    POST /v1/chat/completions   streamed (``stream: true``, usage with
                                ``stream_options.include_usage``) or whole; the answer's
                                ``service_tier`` is ``"flex"`` when asked, else
                                ``"default"``
    GET  /v1/models             the models seen so far (none at start)
    the Batch API routes        files, batches, cancel (:mod:`flowlift.testing.batch`)

Answers (:func:`constrained_responder`): a ``response_format`` JSON Schema gets a small
instance of it (:func:`flowlift.testing.engine.example_for_schema`); a label set, which the
proxy sends upstream as the instruction "Answer with exactly one of: a, b. Nothing
else." (:func:`flowlift.proxy.dispatch.upstream.engine.chat_body`), gets one of the
labels, picked by a CRC-32 of the last message (deterministic, and not always the
first); a regex instruction gets a short match; anything else ``"echo: "`` and the last
message, cut to ``max_tokens`` words. Tokens are counted in whitespace-separated words.

Batch turnaround is drawn from :func:`~flowlift.testing.batch.lognormal_turnaround`
(default: OpenRouter's published median 7 minutes, 90% within an hour) and compressed by
``--time-scale`` (simulated seconds per real second): at 600 a 7-minute batch finishes in
0.7 s. The batch's ``created_at``/``completed_at`` are in simulated seconds, so a proxy
learns the turnaround the provider would have had.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import zlib
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from flowlift.testing.batch import (
    BatchAnswer,
    FakeBatchAPI,
    lognormal_turnaround,
)
from flowlift.testing.engine import cut, example_for_pattern, example_for_schema

_LABELS = re.compile(r"^Answer with exactly one of: (.*)\. Nothing else\.$", re.S)
_REGEX = re.compile(r"^Answer with text that matches the regular expression (.*) as a "
                    r"whole\. Nothing else\.$", re.S)


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):  # content parts: their text
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def constrained_responder(body: dict[str, Any]) -> BatchAnswer:
    """The answer to one chat-completion request ``body`` (see the module docstring).

    Raises:
        ValueError: a ``response_format`` schema no instance can be built for
            (:func:`~flowlift.testing.engine.example_for_schema`).
    """
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    last = _text(messages[-1]) if messages else ""
    fmt = body.get("response_format") or {}
    schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt, dict) else None
    if isinstance(schema, dict):
        return json.dumps(example_for_schema(schema))
    for m in messages:
        if m.get("role") != "system":
            continue
        labels = _LABELS.match(_text(m))
        if labels:
            choices = labels.group(1).split(", ")
            return choices[zlib.crc32(last.encode()) % len(choices)]
        regex = _REGEX.match(_text(m))
        if regex:
            return example_for_pattern(regex.group(1))
    stop = body.get("stop") or []
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    text, _ = cut(f"echo: {last}", [stop] if isinstance(stop, str) else list(stop),
                  max_tokens if isinstance(max_tokens, int) else None)
    return text


def _words(body: dict[str, Any]) -> int:
    return sum(len(_text(m).split()) for m in body.get("messages") or []
               if isinstance(m, dict))


class FakeOpenAI:
    """The fake provider (module docstring): a :class:`FakeBatchAPI` whose responder is
    also the synchronous chat API's.

    Args:
        batch: the Batch API half (its ``responder`` answers both halves).

    Attributes:
        chat_requests: every synchronous chat request body, in order (for tests).
    """

    def __init__(self, batch: FakeBatchAPI) -> None:
        self.batch = batch
        self.chat_requests: list[dict[str, Any]] = []
        self._models: dict[str, None] = {}

    def app(self) -> web.Application:
        """The aiohttp application: the Batch API's routes plus chat and models."""
        app = self.batch.app()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._list_models)
        return app

    async def _list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "fake"}
            for m in self._models]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON", None)
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return _error(400, "model is required", "model")
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "messages must be a non-empty list", "messages")
        self.chat_requests.append(body)
        self._models[body["model"]] = None
        answer = self.batch.responder(body)
        if not isinstance(answer, str):  # scripted failures belong to batch lines
            return _error(500, "the responder gave no text for a synchronous request", None)
        tier = "flex" if body.get("service_tier") == "flex" else "default"
        usage = {"prompt_tokens": _words(body), "completion_tokens": len(answer.split()),
                 "total_tokens": _words(body) + len(answer.split())}
        head = {"id": f"chatcmpl-{len(self.chat_requests)}", "created": int(time.time()),
                "model": body["model"], "service_tier": tier}
        if not body.get("stream"):
            return web.json_response({**head, "object": "chat.completion", "usage": usage,
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "logprobs": None, "message": {
                                                       "role": "assistant",
                                                       "content": answer}}]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {**head, "object": "chat.completion.chunk"}
        events: list[dict[str, Any]] = [
            {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                         "content": answer},
                                   "logprobs": None, "finish_reason": None}]},
            {**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": "stop"}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**chunk, "choices": [], "usage": usage})
        for event in events:
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _error(status: int, message: str, param: str | None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                        "code": None, "param": param}}, status=status)


def build(*, time_scale: float = 600.0, seed: int = 0, median_s: float = 420.0,
          p90_s: float = 3600.0, tail_share: float = 0.0) -> FakeOpenAI:
    """A :class:`FakeOpenAI` with :func:`constrained_responder` and a log-normal batch
    turnaround (median ``median_s``, 90th percentile ``p90_s``, simulated seconds;
    ``tail_share`` of the draws from a tail to the 24-hour window)."""
    return FakeOpenAI(FakeBatchAPI(responder=constrained_responder, time_scale=time_scale,
                                   seed=seed, turnaround=lognormal_turnaround(
                                       median_s, p90_s, tail_share=tail_share)))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flowlift.testing.openai``: serve the fake until interrupted."""
    p = argparse.ArgumentParser(prog="python -m flowlift.testing.openai",
                                description="a fake OpenAI provider: chat (standard, flex) "
                                            "and the Batch API, time-scaled")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--time-scale", type=float, default=600.0,
                   help="simulated seconds per real second of batch turnaround "
                        "(default 600: 10 minutes pass in a second)")
    p.add_argument("--seed", type=int, default=0, help="of the turnaround draws")
    p.add_argument("--median-s", type=float, default=420.0,
                   help="median batch turnaround, simulated seconds (default 420)")
    p.add_argument("--p90-s", type=float, default=3600.0,
                   help="90th percentile of the batch turnaround (default 3600)")
    p.add_argument("--tail-share", type=float, default=0.0,
                   help="share of batches drawn from a tail to the 24-hour window")
    args = p.parse_args(argv)
    if args.time_scale <= 0:
        p.error("--time-scale must be positive")
    fake = build(time_scale=args.time_scale, seed=args.seed, median_s=args.median_s,
                 p90_s=args.p90_s, tail_share=args.tail_share)
    print(f"fake OpenAI (chat + Batch API) on http://{args.host}:{args.port}/v1, batch "
          f"time x{args.time_scale:g}", file=sys.stderr, flush=True)
    web.run_app(fake.app(), host=args.host, port=args.port, print=None)
    return 0


__all__ = ["FakeOpenAI", "build", "constrained_responder", "main"]

if __name__ == "__main__":
    sys.exit(main())
