"""A scriptable fake of the OpenAI Batch API (files + batches), for tests and benchmarks.

:class:`FakeBatchAPI` serves, as an aiohttp application (:meth:`FakeBatchAPI.app`)::

    POST /v1/files                  multipart: file (JSONL), purpose "batch"
    GET  /v1/files/{id}/content     the file's bytes
    POST /v1/batches                {"input_file_id", "endpoint": "/v1/chat/completions",
                                     "completion_window": "24h", "metadata"?}
    GET  /v1/batches                newest first; ``limit``, ``after`` (paged)
    GET  /v1/batches/{id}           the batch object (status computed from the clock)
    POST /v1/batches/{id}/cancel    cancelling -> cancelled (finished lines kept)

Time is simulated: ``time_scale`` simulated seconds pass per second of the injected
``clock`` (real time by default), so a day-long batch finishes in seconds. Each batch's
turnaround (simulated seconds) is drawn from ``turnaround`` when it is created; lines
finish evenly over it. A turnaround past the 24-hour window expires the batch: the lines
finished by then are in the output file, the rest in the error file as
``batch_expired``. A cancelled batch keeps the lines finished before the cancel, the rest
``batch_cancelled``.

Answers come from ``responder(body) -> str | LineError | MALFORMED`` (``body``: the line's
chat-completion request): a string is the assistant's text; a :class:`LineError` is that
line's failure (in ``error_file_id``); :data:`MALFORMED` writes the line seen in the wild
with ``status_code: 0`` and no body, in a batch reported "completed, 0 failed".
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import web

WINDOW_S: Final = 24 * 3600.0
"""The ``"24h"`` completion window in seconds."""


@dataclass(frozen=True, slots=True)
class LineError:
    """A scripted per-line failure: HTTP ``status_code`` with an OpenAI error body."""

    status_code: int = 400
    code: str = "invalid_request_error"
    message: str = "scripted failure"


class _Malformed:
    def __repr__(self) -> str:
        return "MALFORMED"


MALFORMED: Final = _Malformed()
"""Responder answer: the line comes back with ``status_code: 0`` and no body."""

BatchAnswer = str | LineError | _Malformed
BatchResponder = Callable[[dict[str, Any]], BatchAnswer]
Turnaround = Callable[[random.Random], float]


def echo_responder(body: dict[str, Any]) -> BatchAnswer:
    """The default responder: ``"echo: <last message's content>"``."""
    messages = body.get("messages") or [{}]
    return f"echo: {messages[-1].get('content', '')}"


def fixed_turnaround(seconds: float) -> Turnaround:
    """A turnaround of exactly ``seconds`` simulated seconds, every batch."""
    return lambda rng: seconds


def lognormal_turnaround(median_s: float = 420.0, p90_s: float = 3600.0,
                         cap_s: float = WINDOW_S * 1.02, tail_share: float = 0.0
                         ) -> Turnaround:
    """A log-normal turnaround with the given median and 90th percentile (seconds),
    capped at ``cap_s`` (past the 24-hour window a batch expires); with probability
    ``tail_share`` a draw comes instead from a log-uniform tail between ``p90_s`` and
    ``cap_s`` (a heavier tail than the log-normal's own).

    The defaults are OpenRouter's published figures over 230k batches: median 7 minutes,
    90% under an hour, a tail to the 24-hour limit.
    """
    mu = math.log(median_s)
    sigma = (math.log(p90_s) - mu) / 1.2815515655446004  # z of the 90th percentile

    def draw(rng: random.Random) -> float:
        if tail_share and rng.random() < tail_share:
            return math.exp(rng.uniform(math.log(p90_s), math.log(cap_s)))
        return min(rng.lognormvariate(mu, sigma), cap_s)
    return draw


@dataclass(slots=True)
class _Batch:
    id: str
    input_file_id: str
    endpoint: str
    created_sim: float
    turnaround_s: float
    lines: list[dict[str, Any]]
    metadata: dict[str, Any] | None
    cancelled_sim: float | None = None
    finished: dict[str, Any] = field(default_factory=dict)  # status -> ids, once final


class FakeBatchAPI:
    """The fake server's state and handlers (see the module docstring).

    Args:
        responder: a line's request body -> its answer.
        turnaround: ``random.Random -> simulated seconds`` of each batch (default: 60).
        time_scale: simulated seconds per second of ``clock``.
        clock: seconds, monotonic (injected for tests; default :func:`time.monotonic`).
        seed: of the turnaround draws.
        epoch: the Unix time of simulated second 0 (for the ``*_at`` fields).
    """

    def __init__(self, *, responder: BatchResponder = echo_responder,
                 turnaround: Turnaround | None = None, time_scale: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, seed: int = 0,
                 epoch: int = 1_700_000_000) -> None:
        self.responder = responder
        self.turnaround = turnaround or fixed_turnaround(60.0)
        self.time_scale = time_scale
        self._clock = clock
        self._t0 = clock()
        self._rng = random.Random(seed)
        self._epoch = epoch
        self._ids = itertools.count(1)
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, _Batch] = {}
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request served, in order (for tests)."""

    def now_sim(self) -> float:
        """Simulated seconds since the server started."""
        return (self._clock() - self._t0) * self.time_scale

    def app(self) -> web.Application:
        """The aiohttp application serving the routes of the module docstring."""
        app = web.Application(middlewares=[self._record])
        app.router.add_post("/v1/files", self._upload)
        app.router.add_get("/v1/files/{id}/content", self._content)
        app.router.add_post("/v1/batches", self._create)
        app.router.add_get("/v1/batches", self._list)
        app.router.add_get("/v1/batches/{id}", self._get)
        app.router.add_post("/v1/batches/{id}/cancel", self._cancel)
        return app

    @web.middleware
    async def _record(self, request: web.Request,
                      handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        response: web.StreamResponse = await handler(request)
        return response

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}"

    # -- files -----------------------------------------------------------------------
    async def _upload(self, request: web.Request) -> web.Response:
        form = await request.post()
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch" or not isinstance(upload, web.FileField):
            return _error(400, "multipart fields 'file' and purpose='batch' are required")
        data = upload.file.read()
        file_id = self._new_id("file-")
        self.files[file_id] = data
        return web.json_response({"id": file_id, "object": "file", "bytes": len(data),
                                  "created_at": self._epoch + int(self.now_sim()),
                                  "filename": upload.filename, "purpose": "batch"})

    async def _content(self, request: web.Request) -> web.Response:
        data = self.files.get(request.match_info["id"])
        if data is None:
            return _error(404, "no such file")
        return web.Response(body=data, content_type="application/jsonl")

    # -- batches ---------------------------------------------------------------------
    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        file_id = body.get("input_file_id")
        if file_id not in self.files:
            return _error(400, f"input_file_id {file_id!r} does not exist")
        if body.get("completion_window") != "24h":
            return _error(400, "completion_window must be '24h'")
        if body.get("endpoint") != "/v1/chat/completions":
            return _error(400, "endpoint must be '/v1/chat/completions'")
        try:
            lines = [json.loads(line) for line in self.files[file_id].splitlines() if line]
        except json.JSONDecodeError:
            return _error(400, "the input file is not JSON lines")
        batch = _Batch(self._new_id("batch_"), file_id, body["endpoint"], self.now_sim(),
                       self.turnaround(self._rng), lines, body.get("metadata"))
        self.batches[batch.id] = batch
        return web.json_response(self._view(batch))

    async def _get(self, request: web.Request) -> web.Response:
        batch = self.batches.get(request.match_info["id"])
        if batch is None:
            return _error(404, "no such batch")
        return web.json_response(self._view(batch))

    async def _list(self, request: web.Request) -> web.Response:
        limit = int(request.query.get("limit", "20"))
        ids = sorted(self.batches, reverse=True)
        after = request.query.get("after")
        if after in self.batches:
            ids = ids[ids.index(after) + 1:]
        page = [self._view(self.batches[i]) for i in ids[:limit]]
        return web.json_response({"object": "list", "data": page,
                                  "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None,
                                  "has_more": len(ids) > limit})

    async def _cancel(self, request: web.Request) -> web.Response:
        batch = self.batches.get(request.match_info["id"])
        if batch is None:
            return _error(404, "no such batch")
        if batch.cancelled_sim is None and not batch.finished:
            batch.cancelled_sim = self.now_sim()
        return web.json_response(self._view(batch))

    def _done_lines(self, batch: _Batch, elapsed: float) -> int:
        if elapsed >= batch.turnaround_s:
            return len(batch.lines)
        return int(len(batch.lines) * max(elapsed, 0.0) / batch.turnaround_s)

    def _view(self, batch: _Batch) -> dict[str, Any]:
        now = self.now_sim()
        end = min(batch.turnaround_s, WINDOW_S)
        if not batch.finished:
            if batch.cancelled_sim is not None:
                self._finish(batch, "cancelled", batch.cancelled_sim - batch.created_sim)
            elif now - batch.created_sim >= end:
                self._finish(batch, "completed" if batch.turnaround_s <= WINDOW_S
                             else "expired", end)
        status = batch.finished.get("status", "in_progress")
        done = self._done_lines(batch, now - batch.created_sim)

        def at(sim_s: float) -> int:
            return self._epoch + int(sim_s)
        view: dict[str, Any] = {
            "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "errors": None,
            "input_file_id": batch.input_file_id, "completion_window": "24h",
            "status": status, "output_file_id": None, "error_file_id": None,
            "created_at": at(batch.created_sim), "in_progress_at": at(batch.created_sim),
            "expires_at": at(batch.created_sim + WINDOW_S), "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None, "metadata": batch.metadata,
            "request_counts": {"total": len(batch.lines), "completed": done, "failed": 0}}
        if batch.finished:
            view.update(batch.finished["fields"])
        return view

    def _finish(self, batch: _Batch, status: str, elapsed: float) -> None:
        done = self._done_lines(batch, elapsed)
        at_sim = batch.created_sim + elapsed
        out: list[str] = []
        err: list[str] = []
        for i, line in enumerate(batch.lines):
            if i >= done:
                code = "batch_expired" if status == "expired" else "batch_cancelled"
                err.append(_line(batch, line, None, {"code": code, "message":
                                                     f"the batch was {status} first"}))
                continue
            answer = self.responder(line.get("body") or {})
            if isinstance(answer, LineError):
                err.append(_line(batch, line, {"status_code": answer.status_code,
                                               "request_id": self._new_id("req_"),
                                               "body": {"error": {
                                                   "message": answer.message,
                                                   "type": answer.code, "code": answer.code,
                                                   "param": None}}}, None))
            elif isinstance(answer, _Malformed):
                out.append(_line(batch, line, {"status_code": 0, "request_id": "",
                                               "body": None}, None))
            else:
                out.append(_line(batch, line, {"status_code": 200,
                                               "request_id": self._new_id("req_"),
                                               "body": _completion(line, answer)}, None))
        fields: dict[str, Any] = {
            f"{status}_at": self._epoch + int(at_sim),
            "request_counts": {"total": len(batch.lines),
                               "completed": len(out) if status == "completed" else done,
                               "failed": len(err) - (len(batch.lines) - done)}}
        if status == "completed":
            fields["finalizing_at"] = self._epoch + int(at_sim)
            # the malformed lines in the wild come in a "completed, 0 failed" batch
            fields["request_counts"]["completed"] = len(batch.lines) - len(err)
        if status == "cancelled":
            fields["cancelling_at"] = self._epoch + int(at_sim)
        for key, lines in (("output_file_id", out), ("error_file_id", err)):
            if lines:
                file_id = self._new_id("file-")
                self.files[file_id] = "".join(s + "\n" for s in lines).encode()
                fields[key] = file_id
        batch.finished = {"status": status, "fields": fields}


def _line(batch: _Batch, line: dict[str, Any], response: dict[str, Any] | None,
          error: dict[str, Any] | None) -> str:
    return json.dumps({"id": f"batch_req_{batch.id}_{line.get('custom_id')}",
                       "custom_id": line.get("custom_id"), "response": response,
                       "error": error})


def _completion(line: dict[str, Any], text: str) -> dict[str, Any]:
    body = line.get("body") or {}
    prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
    out = len(text.split())
    return {"id": f"chatcmpl-{line.get('custom_id')}", "object": "chat.completion",
            "created": 0, "model": body.get("model", ""), "service_tier": "batch",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                      "total_tokens": prompt + out}}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                        "code": None, "param": None}}, status=status)


__all__ = ["MALFORMED", "WINDOW_S", "BatchAnswer", "BatchResponder", "FakeBatchAPI",
           "LineError", "Turnaround", "echo_responder", "fixed_turnaround",
           "lognormal_turnaround"]
