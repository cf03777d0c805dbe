"""A fast fake OpenAI upstream for proxy-overhead benchmarks.

A raw asyncio protocol (uvloop when installed) that answers with precomputed bytes, so
that it is never the bottleneck of the path under test:

* ``POST /v1/chat/completions``: a ``Content-Length`` JSON completion, or, when the body
  asks for ``"stream": true``, an SSE stream (chunked transfer encoding) of ``--chunks``
  content chunks, a finish chunk and ``data: [DONE]``, each event in its own write (one
  ``send()`` each, TCP_NODELAY: its own segment), back to back or ``--chunk-gap-ms``
  apart (``--one-write``: the whole stream in one write);
* ``GET /v1/models``: one model, ``--model`` (also on ``GET /health``, for routers).

HTTP/1.1 keep-alive; pipelining is not supported (no client here pipelines).

    .venv/bin/python bench/fake_upstream.py --port 8001 [--chunks 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re

_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')


def _json_response(obj: object) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    return head + body


def _chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk of the response body."""
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


class Canned:
    """Every response, computed once."""

    def __init__(self, model: str, chunks: int) -> None:
        words = [f" word{i}" for i in range(chunks)]
        self.completion = _json_response({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 1700000000,
            "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "".join(words)}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": chunks,
                      "total_tokens": 12 + chunks}})
        self.models = _json_response({"object": "list", "data": [
            {"id": model, "object": "model", "created": 1700000000, "owned_by": "fake"}]})
        self.not_found = (b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 27\r\n\r\n{\"error\":\"unknown endpoint\"}")
        self.stream_head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")

        def event(delta: dict[str, str], finish: str | None) -> bytes:
            obj = {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                   "created": 1700000000, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode()
                          + b"\n\n")

        self.stream_events = ([event({"role": "assistant", "content": words[0]}, None)]
                              + [event({"content": w}, None) for w in words[1:]]
                              + [event({}, "stop"), _chunk(b"data: [DONE]\n\n"),
                                 b"0\r\n\r\n"])
        # Back to back: head and all events in one write.
        self.stream_all = self.stream_head + b"".join(self.stream_events)


class Upstream(asyncio.Protocol):
    def __init__(self, canned: Canned, gap_s: float, one_write: bool) -> None:
        self.canned, self.gap_s, self.one_write = canned, gap_s, one_write
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            i = head.lower().find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17: j if j > 0 else len(head)])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4: end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            self.respond(head, body)

    def respond(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        line = head[:head.find(b"\r\n")] if b"\r\n" in head else head
        c = self.canned
        if line.startswith(b"POST ") and b"/chat/completions" in line:
            if _STREAM_RE.search(body):
                if self.gap_s > 0:
                    self.task = asyncio.ensure_future(self.stream_slowly())
                elif self.one_write:
                    self.transport.write(c.stream_all)
                else:
                    self.transport.write(c.stream_head)
                    for ev in c.stream_events:
                        self.transport.write(ev)
            else:
                self.transport.write(c.completion)
        elif line.startswith(b"GET ") and (b"/models" in line or b"/health" in line):
            self.transport.write(c.models)  # (a router's health check takes any 200)
        else:
            self.transport.write(c.not_found)

    async def stream_slowly(self) -> None:
        assert self.transport is not None
        self.transport.write(self.canned.stream_head)
        for ev in self.canned.stream_events:
            await asyncio.sleep(self.gap_s)
            if self.transport.is_closing():
                return
            self.transport.write(ev)


async def serve(host: str, port: int, model: str, chunks: int, gap_ms: float,
                one_write: bool) -> None:
    canned = Canned(model, chunks)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Upstream(canned, gap_ms / 1000, one_write),
                                      host, port,
                                      backlog=1024, reuse_address=True)
    print(f"fake upstream on http://{host}:{port}/v1", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--model", default="bench-model")
    p.add_argument("--chunks", type=int, default=20, help="content chunks per stream")
    p.add_argument("--chunk-gap-ms", type=float, default=0.0,
                   help="delay between stream events (0: back to back)")
    p.add_argument("--one-write", action="store_true",
                   help="write a whole stream at once (else one write per event)")
    a = p.parse_args()
    main = serve(a.host, a.port, a.model, a.chunks, a.chunk_gap_ms, a.one_write)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:
            asyncio.run(main)
        else:
            uvloop.run(main)


if __name__ == "__main__":
    main()
