"""Lines waiting on the batch tier: packing ready lines of a model into files, submitting
them once, waiting for them, and the journal that makes that durable.

:class:`BatchPool` collects the lines that become ready within ``collect_s`` (one model
per file, :func:`~flowlift.proxy.dispatch.batch.api.pack`'s limits), uploads each file and
starts its batch, and polls it until it is final. Before a batch is created its file id
and lines are journaled (``uploaded``), after it is created its id (``submitted``): a
restarted proxy :meth:`~BatchPool.resume`\\ s the submitted batches (polling, never
resubmitting), and for a file uploaded but not known to be submitted it looks for a
batch over that file first (:meth:`BatchPool.adopt`), so no line is ever submitted twice.

Each waiting line's :meth:`~BatchPool.outcome` resolves when its batch is final; a line
the caller no longer needs is :meth:`~BatchPool.abandon`\\ ed, and a batch whose lines
are all abandoned is cancelled (its finished lines are still read, and billed).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flowlift.proxy.dispatch.batch.api import (
    BatchClient,
    BatchFile,
    BatchLine,
    Kind,
    Outcome,
    pack,
)


@dataclass(frozen=True, slots=True)
class Submission:
    """One batch in flight: its id, its input file, model and lines."""

    batch_id: str
    file_id: str
    model: str
    custom_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    """A final batch: its status, each line's :class:`Outcome`, and its turnaround in
    the server's seconds (``completed_at`` or the like minus ``created_at``)."""

    submission: Submission
    status: str
    outcomes: Mapping[str, Outcome]
    turnaround_s: float


class Journal(Protocol):
    """Where a pool records what it submitted (a run's durable event log)."""

    def uploaded(self, file_id: str, model: str, custom_ids: Sequence[str]) -> None: ...

    def submitted(self, submission: Submission) -> None: ...

    def finished(self, done: Finished) -> None: ...


class NoJournal:
    """Records nothing (tests, benchmarks)."""

    def uploaded(self, file_id: str, model: str, custom_ids: Sequence[str]) -> None:
        return None

    def submitted(self, submission: Submission) -> None:
        return None

    def finished(self, done: Finished) -> None:
        return None


class JournalRouter:
    """A pool's journal that hands each line's record to the run it belongs to (the run
    id is the first part of its ``custom_id``, ``run:step:attempt``).

    Each registered run gets ``record(event, data)`` calls with ``event`` one of
    ``uploaded``, ``submitted``, ``finished`` and ``data`` holding ``custom_id``,
    ``step_id``, ``model``, ``file_id``, then ``batch_id``, then ``status``, ``kind``
    and ``usage`` (the line's token counts, when it has them). Lines of runs not
    registered are not recorded.
    """

    def __init__(self) -> None:
        self._runs: dict[str, Callable[[str, dict[str, Any]], None]] = {}

    def register(self, run_id: str, record: Callable[[str, dict[str, Any]], None]) -> None:
        self._runs[run_id] = record

    def unregister(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def _each(self, event: str, custom_ids: Sequence[str], data: dict[str, Any],
              per_line: Callable[[str], dict[str, Any]] | None = None) -> None:
        for cid in custom_ids:
            run_id, _, rest = cid.partition(":")
            record = self._runs.get(run_id)
            if record is not None:
                record(event, {"custom_id": cid, "step_id": rest.rpartition(":")[0],
                               **data, **(per_line(cid) if per_line else {})})

    def uploaded(self, file_id: str, model: str, custom_ids: Sequence[str]) -> None:
        self._each("uploaded", custom_ids, {"file_id": file_id, "model": model})

    def submitted(self, submission: Submission) -> None:
        self._each("submitted", submission.custom_ids,
                   {"file_id": submission.file_id, "model": submission.model,
                    "batch_id": submission.batch_id})

    def finished(self, done: Finished) -> None:
        def line(cid: str) -> dict[str, Any]:
            outcome = done.outcomes[cid]
            usage = (outcome.completion or {}).get("usage")
            return {"kind": str(outcome.kind),
                    "usage": usage if isinstance(usage, Mapping) else None}
        self._each("finished", list(done.outcomes),
                   {"batch_id": done.submission.batch_id, "status": done.status,
                    "turnaround_s": done.turnaround_s}, line)


_FINAL_AT = ("completed_at", "expired_at", "cancelled_at", "failed_at")


def turnaround_s(batch: Mapping[str, Any]) -> float:
    """Seconds from a final batch's creation to its end (0 when the fields are absent)."""
    end = next((batch[k] for k in _FINAL_AT if batch.get(k)), None)
    created = batch.get("created_at")
    if not isinstance(end, int | float) or not isinstance(created, int | float):
        return 0.0
    return float(end - created)


@dataclass(slots=True)
class _Waiting:
    lines: list[BatchLine] = field(default_factory=list)
    flush: asyncio.TimerHandle | None = None


class BatchPool:
    """Submits and waits for batch lines of one ``openai-batch`` backend.

    Args:
        client: the backend's HTTP client.
        journal: told of every upload, submission and final batch.
        collect_s: how long a ready line waits for others of its model to share a file.
        on_finished: called with every final batch (learned turnaround, accounting).
    """

    def __init__(self, client: BatchClient, *, journal: Journal | None = None,
                 collect_s: float = 0.05,
                 on_finished: Callable[[Finished], None] | None = None) -> None:
        self.client = client
        self.journal: Journal = journal or NoJournal()
        self.collect_s = collect_s
        self.on_finished = on_finished
        self._waiting: dict[str, _Waiting] = {}
        self._futures: dict[str, asyncio.Future[Outcome]] = {}
        self._batch_of: dict[str, Submission] = {}
        self._polled: dict[str, Submission] = {}  # batch id -> the lines waited for
        self._abandoned: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def outcome(self, line: BatchLine) -> Outcome:
        """Queue ``line`` (packed with the lines of its model ready within
        ``collect_s``) and wait for its outcome.

        Raises:
            UpstreamError: the file or the batch was refused (every line of that file).
            ConfigError: the line names no model or is over the file limit.
        """
        model = str(line.body.get("model"))
        waiting = self._waiting.setdefault(model, _Waiting())
        waiting.lines.append(line)
        future = self._future(line.custom_id)
        if waiting.flush is None:
            loop = asyncio.get_running_loop()
            waiting.flush = loop.call_later(self.collect_s, self._flush, model)
        return await self._read(line.custom_id, future)

    async def _read(self, cid: str, future: asyncio.Future[Outcome]) -> Outcome:
        """The line's outcome, once; then the pool forgets the line (a long-lived proxy
        keeps nothing of the lines it answered)."""
        outcome = await asyncio.shield(future)
        self._forget(cid)
        return outcome

    def _forget(self, cid: str) -> None:
        self._futures.pop(cid, None)
        self._batch_of.pop(cid, None)
        self._abandoned.discard(cid)

    def _future(self, cid: str) -> asyncio.Future[Outcome]:
        future = self._futures.get(cid)
        if future is None:
            future = self._futures[cid] = asyncio.get_running_loop().create_future()
        return future

    def _flush(self, model: str) -> None:
        waiting = self._waiting.pop(model, None)
        if waiting is not None and waiting.lines:
            self._spawn(self.submit(waiting.lines))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def submit(self, lines: Sequence[BatchLine]) -> list[Submission]:
        """Pack, upload and start ``lines`` now (journaled), then wait for each batch in
        the background; each line's :meth:`outcome` resolves when its batch ends."""
        files = pack(lines, max_lines=self.client.spec.max_lines_per_file,
                     max_bytes=self.client.spec.max_bytes_per_file)
        out = []
        for file in files:
            try:
                sub = await self._submit_file(file)
            except Exception as exc:
                for cid in file.custom_ids:
                    future = self._future(cid)
                    if not future.done():
                        future.set_exception(exc)
                continue
            out.append(sub)
        return out

    async def _submit_file(self, file: BatchFile) -> Submission:
        file_id = await self.client.upload(file.data)
        self.journal.uploaded(file_id, file.model, file.custom_ids)
        batch = await self.client.create(file_id, {"flowlift_file": file_id})
        sub = Submission(str(batch["id"]), file_id, file.model, file.custom_ids)
        self.journal.submitted(sub)
        self.resume(sub)
        return sub

    def resume(self, sub: Submission) -> None:
        """Wait for a batch submitted earlier (after a restart: from the journal). A
        batch already waited for adds ``sub``'s lines to those it resolves."""
        for cid in sub.custom_ids:
            self._future(cid)
        known = self._polled.get(sub.batch_id)
        if known is not None:
            merged = dict.fromkeys(known.custom_ids + sub.custom_ids)
            self._polled[sub.batch_id] = Submission(sub.batch_id, sub.file_id, sub.model,
                                                    tuple(merged))
        else:
            self._polled[sub.batch_id] = sub
            self._spawn(self._wait(sub.batch_id))
        for cid in self._polled[sub.batch_id].custom_ids:
            self._batch_of[cid] = self._polled[sub.batch_id]

    async def adopt(self, file_id: str, model: str, custom_ids: Sequence[str]
                    ) -> Submission | None:
        """After a restart, the batch created over an uploaded ``file_id`` (found in the
        server's batch list by its metadata), resumed; None when there is none (the
        lines were never submitted: submit them again)."""
        for batch in await self.client.list_batches():
            if batch.get("input_file_id") == file_id:
                sub = Submission(str(batch["id"]), file_id, model, tuple(custom_ids))
                self.journal.submitted(sub)
                self.resume(sub)
                return sub
        return None

    async def _wait(self, batch_id: str) -> None:
        sub = self._polled[batch_id]
        try:
            batch = await self.client.wait(batch_id)
            sub = self._polled.pop(batch_id)
            outcomes = await self.client.outcomes(batch, sub.custom_ids)
        except Exception as exc:
            for cid in sub.custom_ids:
                future = self._future(cid)
                if not future.done():
                    future.set_exception(exc)
            return
        done = Finished(sub, str(batch.get("status")), outcomes, turnaround_s(batch))
        self.journal.finished(done)
        if self.on_finished is not None:
            self.on_finished(done)
        for cid, outcome in outcomes.items():
            future = self._future(cid)
            if not future.done():
                future.set_result(outcome)
            if cid in self._abandoned:  # nobody reads it any more
                self._forget(cid)

    async def wait_line(self, custom_id: str) -> Outcome:
        """The outcome of a line already submitted (or resumed)."""
        return await self._read(custom_id, self._future(custom_id))

    def waiting(self, custom_id: str) -> bool:
        """Whether this pool is waiting for (or has) ``custom_id``'s outcome."""
        return custom_id in self._futures

    async def abandon(self, custom_id: str) -> None:
        """The caller no longer needs ``custom_id`` (the watchdog moved it to a faster
        tier): a line not submitted yet never is (its outcome: ``cancelled``); when every
        line of its batch is abandoned, the batch is cancelled. Its outcome still
        resolves (finished lines are kept and billed)."""
        self._abandoned.add(custom_id)
        for waiting in self._waiting.values():  # not submitted yet: it never will be
            kept = [x for x in waiting.lines if x.custom_id != custom_id]
            if len(kept) < len(waiting.lines):
                waiting.lines = kept
                future = self._future(custom_id)
                if not future.done():
                    future.set_result(Outcome(custom_id, Kind.CANCELLED,
                                              message="abandoned before submission"))
        sub = self._batch_of.get(custom_id)
        if sub is not None and self._abandoned.issuperset(sub.custom_ids):
            with contextlib.suppress(Exception):
                await self.client.cancel(sub.batch_id)

    async def aclose(self) -> None:
        """Stop waiting (batches keep running on the server; resume them later)."""
        for waiting in self._waiting.values():
            if waiting.flush is not None:
                waiting.flush.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = ["BatchPool", "Finished", "Journal", "JournalRouter", "NoJournal", "Submission",
           "turnaround_s"]
