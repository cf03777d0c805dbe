"""The OpenAI Batch API backend (``kind = "openai-batch"``): deferrable steps of one model
packed into JSONL files, submitted, polled with backoff, and read back line by line.

A line's ``custom_id`` is ``run:step:attempt`` (:func:`custom_id`), so an answer finds
its step again after a restart. Packing (:func:`pack`) and reading outcomes
(:func:`read_outcomes`) are pure; :class:`BatchClient` does the HTTP (httpx, with an
injectable transport) and polls with tenacity's capped exponential backoff with jitter.

Every per-line outcome has a :class:`Outcome` kind and an :class:`Advice`:

=============  ==========================================  =========================
kind           what came back                              advice
=============  ==========================================  =========================
``ok``         ``status_code`` 200 with a body             ``accept`` (then the step's
                                                           contract is checked; a
                                                           failure retries faster)
``invalid``    a 4xx other than 408/409/429 (validation)   ``faster`` (never the same
                                                           tier again)
``failed``     a 5xx, 408, 409 or 429                      ``any``
``expired``    the batch expired before the line ran       ``faster``
``cancelled``  the batch was cancelled before it ran       ``faster``
``malformed``  ``status_code: 0`` or no body (seen in       ``any``
               "completed, 0 failed" batches)
``missing``    in neither file                             ``any``
=============  ==========================================  =========================
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    retry_if_result,
    stop_never,
    wait_exponential_jitter,
)

from flowlift.errors import ConfigError, UpstreamError
from flowlift.proxy.config import BatchSpec

MAX_LINES: Final = 50_000
MAX_BYTES: Final = 200 * 1024 * 1024
FINAL_STATUSES: Final = frozenset({"completed", "failed", "expired", "cancelled"})
ENDPOINT: Final = "/v1/chat/completions"


def custom_id(run_id: str, step_id: str, attempt: int) -> str:
    """A line's ``custom_id``: ``"run:step:attempt"`` (the step's request id)."""
    return f"{run_id}:{step_id}:{attempt}"


def parse_custom_id(value: str) -> tuple[str, str, int]:
    """``(run_id, step_id, attempt)`` of a :func:`custom_id` (a step id may hold colons;
    the run id holds none).

    Raises:
        ValueError: not of the form ``run:step:attempt``.
    """
    run_id, _, rest = value.partition(":")
    step_id, _, attempt = rest.rpartition(":")
    if not run_id or not step_id or not attempt.isdigit():
        raise ValueError(f"not a run:step:attempt custom_id: {value!r}")
    return run_id, step_id, int(attempt)


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch file: ``body`` is a chat-completion request naming its
    ``model``."""

    custom_id: str
    body: Mapping[str, Any]

    def encode(self) -> bytes:
        """The JSONL line (with its newline)."""
        return (json.dumps({"custom_id": self.custom_id, "method": "POST", "url": ENDPOINT,
                            "body": dict(self.body)}, separators=(",", ":")) + "\n").encode()


@dataclass(frozen=True, slots=True)
class BatchFile:
    """One file to upload: one model's lines, within the per-file limits."""

    model: str
    custom_ids: tuple[str, ...]
    data: bytes


def pack(lines: Iterable[BatchLine], *, max_lines: int = MAX_LINES,
         max_bytes: int = MAX_BYTES) -> list[BatchFile]:
    """Group ``lines`` by model into files of at most ``max_lines`` lines and
    ``max_bytes`` bytes each (in order; a model's lines split across files above a limit).

    Raises:
        ConfigError: a line with no ``model``, or one line larger than ``max_bytes``.
    """
    by_model: dict[str, list[tuple[str, bytes]]] = {}
    for line in lines:
        model = line.body.get("model")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"batch line {line.custom_id!r} names no model", param="model")
        data = line.encode()
        if len(data) > max_bytes:
            raise ConfigError(f"batch line {line.custom_id!r} is {len(data)} bytes, over the "
                              f"{max_bytes}-byte file limit", param="messages")
        by_model.setdefault(model, []).append((line.custom_id, data))
    files: list[BatchFile] = []
    for model, encoded in by_model.items():
        ids: list[str] = []
        chunks: list[bytes] = []
        size = 0
        for cid, data in encoded:
            if ids and (len(ids) >= max_lines or size + len(data) > max_bytes):
                files.append(BatchFile(model, tuple(ids), b"".join(chunks)))
                ids, chunks, size = [], [], 0
            ids.append(cid)
            chunks.append(data)
            size += len(data)
        files.append(BatchFile(model, tuple(ids), b"".join(chunks)))
    return files


class Kind(StrEnum):
    OK = "ok"
    INVALID = "invalid"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    MALFORMED = "malformed"
    MISSING = "missing"


class Advice(StrEnum):
    ACCEPT = "accept"
    FASTER = "faster"
    """Retry on a faster tier, never this one (a validation error, or time used up)."""
    ANY = "any"
    """Retry on any tier with the slack for it (this one included)."""


_ADVICE: Final = {Kind.OK: Advice.ACCEPT, Kind.INVALID: Advice.FASTER,
                  Kind.FAILED: Advice.ANY, Kind.EXPIRED: Advice.FASTER,
                  Kind.CANCELLED: Advice.FASTER, Kind.MALFORMED: Advice.ANY,
                  Kind.MISSING: Advice.ANY}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one line: its :class:`Kind`, the chat completion (``ok`` only), the
    HTTP status (0 when none) and the error message."""

    custom_id: str
    kind: Kind
    completion: Mapping[str, Any] | None = None
    status_code: int = 0
    message: str = ""

    @property
    def advice(self) -> Advice:
        """Whether to accept the answer or where a retry may go."""
        return _ADVICE[self.kind]


def _classify(record: Mapping[str, Any]) -> Outcome:
    cid = str(record.get("custom_id"))
    response = record.get("response")
    error = record.get("error")
    if isinstance(error, Mapping):
        code = str(error.get("code") or "")
        kind = {"batch_expired": Kind.EXPIRED, "batch_cancelled": Kind.CANCELLED}.get(
            code, Kind.FAILED)
        return Outcome(cid, kind, message=f"{code}: {error.get('message', '')}")
    if not isinstance(response, Mapping):
        return Outcome(cid, Kind.MALFORMED, message="no response and no error")
    status = response.get("status_code")
    body = response.get("body")
    if not isinstance(status, int) or status == 0 or not isinstance(body, Mapping):
        return Outcome(cid, Kind.MALFORMED, status_code=status if isinstance(status, int)
                       else 0, message="status_code 0 or no body")
    if status == 200:
        if not body.get("choices"):
            return Outcome(cid, Kind.MALFORMED, status_code=200, message="no choices")
        return Outcome(cid, Kind.OK, completion=body, status_code=200)
    err = body.get("error")
    message = str(err.get("message", "")) if isinstance(err, Mapping) else ""
    kind = Kind.INVALID if 400 <= status < 500 and status not in (408, 409, 429) \
        else Kind.FAILED
    return Outcome(cid, kind, status_code=status, message=message)


def read_outcomes(custom_ids: Iterable[str], output_text: str = "",
                  error_text: str = "") -> dict[str, Outcome]:
    """Each submitted line's :class:`Outcome`, from the output and error files' text.

    Lines that are not JSON are skipped; a submitted id in neither file is ``missing``; a
    line of an id not submitted is ignored.
    """
    wanted = list(custom_ids)
    found: dict[str, Outcome] = {}
    for text in (output_text, error_text):
        for raw in text.splitlines():
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(record, Mapping):
                outcome = _classify(record)
                found.setdefault(outcome.custom_id, outcome)
    return {cid: found.get(cid) or Outcome(cid, Kind.MISSING, message="in neither file")
            for cid in wanted}


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, UpstreamError) and exc.retryable


class BatchClient:
    """HTTP client of one ``openai-batch`` backend.

    Args:
        spec: the backend's config (base URL, polling bounds, file limits).
        api_key: sent as ``Authorization: Bearer``; None: none.
        transport: httpx transport (tests); None: the network.
        sleep: awaited between polls (tests inject a fake; default :func:`asyncio.sleep`).
    """

    def __init__(self, spec: BatchSpec, api_key: str | None = None, *,
                 transport: httpx.AsyncBaseTransport | None = None,
                 sleep: Callable[[float], Awaitable[None]] | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.spec = spec
        self._http = httpx.AsyncClient(base_url=spec.base_url.rstrip("/") + "/",
                                       headers=headers, transport=transport,
                                       timeout=httpx.Timeout(60.0, connect=10.0))
        self._sleep = sleep or asyncio.sleep

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        async for attempt in AsyncRetrying(
                retry=retry_if_exception(_retryable), reraise=True,
                wait=wait_exponential_jitter(multiplier=1.0, max=self.spec.poll_max_s),
                stop=lambda state: state.attempt_number >= 5, sleep=self._sleep):
            with attempt:
                response = await self._http.request(method, path, **kwargs)
                if response.status_code >= 400:
                    status = response.status_code
                    raise UpstreamError(f"batch API {method} /{path}: HTTP {status}: "
                                        f"{response.text[:500]}", status=status,
                                        body=response.content, backend="openai-batch",
                                        retryable=status >= 500 or status == 429)
        return response

    async def upload(self, data: bytes, filename: str = "batch.jsonl") -> str:
        """Upload a JSONL file (purpose ``batch``); its file id.

        Raises:
            UpstreamError: the server refused it (after retries of 429s and 5xx).
            httpx.TransportError: the server stayed unreachable.
        """
        response = await self._call("POST", "files", data={"purpose": "batch"},
                                    files={"file": (filename, data, "application/jsonl")})
        return str(response.json()["id"])

    async def create(self, file_id: str, metadata: Mapping[str, str] | None = None
                     ) -> dict[str, Any]:
        """Start a batch over an uploaded file; the batch object."""
        body: dict[str, Any] = {"input_file_id": file_id, "endpoint": ENDPOINT,
                                "completion_window": "24h"}
        if metadata:
            body["metadata"] = dict(metadata)
        return dict((await self._call("POST", "batches", json=body)).json())

    async def get(self, batch_id: str) -> dict[str, Any]:
        """The batch object now."""
        return dict((await self._call("GET", f"batches/{batch_id}")).json())

    async def list_batches(self, *, page: int = 100) -> list[dict[str, Any]]:
        """Every batch of the account, newest first (``GET /batches``, paged by
        ``after``)."""
        out: list[dict[str, Any]] = []
        params: dict[str, Any] = {"limit": page}
        while True:
            listing = (await self._call("GET", "batches", params=params)).json()
            out.extend(listing.get("data") or [])
            if not listing.get("has_more") or not listing.get("data"):
                return out
            params = {"limit": page, "after": listing["data"][-1]["id"]}

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        """Ask to cancel a batch (finished lines are still returned); the batch object."""
        return dict((await self._call("POST", f"batches/{batch_id}/cancel")).json())

    async def content(self, file_id: str) -> str:
        """A file's text."""
        return (await self._call("GET", f"files/{file_id}/content")).text

    async def wait(self, batch_id: str) -> dict[str, Any]:
        """Poll until the batch reaches a final status (capped exponential backoff with
        jitter, from ``poll_initial_s`` to ``poll_max_s``); the final batch object.
        Cancel the awaiting task to stop polling."""
        batch: dict[str, Any] = await self.get(batch_id)
        if batch.get("status") in FINAL_STATUSES:
            return batch
        async for attempt in AsyncRetrying(
                retry=retry_if_result(lambda b: b.get("status") not in FINAL_STATUSES),
                wait=wait_exponential_jitter(multiplier=self.spec.poll_initial_s,
                                             max=self.spec.poll_max_s,
                                             jitter=self.spec.poll_initial_s),
                stop=stop_never, reraise=True, sleep=self._sleep):
            with attempt:
                batch = await self.get(batch_id)
            outcome = attempt.retry_state.outcome
            if outcome is None or not outcome.failed:
                attempt.retry_state.set_result(batch)
        return batch

    async def outcomes(self, batch: Mapping[str, Any], custom_ids: Sequence[str]
                       ) -> dict[str, Outcome]:
        """Every line's :class:`Outcome` of a finished ``batch`` (both files read)."""
        output = await self.content(batch["output_file_id"]) \
            if batch.get("output_file_id") else ""
        errors = await self.content(batch["error_file_id"]) \
            if batch.get("error_file_id") else ""
        return read_outcomes(custom_ids, output, errors)

    async def submit(self, file: BatchFile, metadata: Mapping[str, str] | None = None
                     ) -> tuple[str, str]:
        """Upload ``file`` and start its batch; ``(file_id, batch_id)``."""
        file_id = await self.upload(file.data)
        batch = await self.create(file_id, metadata)
        return file_id, str(batch["id"])


__all__ = ["ENDPOINT", "FINAL_STATUSES", "MAX_BYTES", "MAX_LINES", "Advice", "BatchClient",
           "BatchFile", "BatchLine", "Kind", "Outcome", "custom_id", "pack",
           "parse_custom_id", "read_outcomes"]
