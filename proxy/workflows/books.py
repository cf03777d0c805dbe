"""The books of one generation of a workflow step: its trace marks, text, tokens and
logprobs, kept as the generation runs (no I/O; the dispatch is elsewhere)."""

from __future__ import annotations

import asyncio
from typing import Any

from flowlift.local_engine.base import GenerationChunk, ToolCall
from flowlift.tracing import AttemptTrace, RunTrace


class AttemptBooks:
    """Keeps one try of step ``step_id`` in ``trace``.

    Args:
        trace: the run's trace.
        step_id: the step.
        number: the try's number among the step's attempts (1 first).
        model: the name the step asked for (the trace's ``AttemptTrace.model``).
    """

    def __init__(self, trace: RunTrace, step_id: str, number: int, model: str) -> None:
        self.trace, self.step_id, self.number, self.model = trace, step_id, number, model
        self.step = trace.step(step_id)
        self.attempt: AttemptTrace | None = None
        self.pieces: list[str] = []
        self.logprobs: list[Any] = []
        self.tool_calls: tuple[ToolCall, ...] | None = None
        self.generated = 0  # tokens streamed so far (chunks' token ids; else chunks)

    def started(self) -> None:
        """A slot was granted: the try starts (once, even if it moves to another backend)."""
        if self.attempt is not None:
            return
        if self.step.started_ms is None:
            self.trace.mark(self.step_id, "started", status="running")
        self.attempt = AttemptTrace(self.number, self.model, self.trace.now_ms())
        self.step.attempts.append(self.attempt)

    def chunk(self, chunk: GenerationChunk) -> bool:
        """Book one chunk; True when it holds the try's first token."""
        attempt = self.attempt
        assert attempt is not None  # the dispatcher grants a slot before any chunk
        # any chunk before the last means tokens came (a tool call's JSON may show no
        # text until it is whole)
        first = (bool(chunk.text) or chunk.finish_reason is None) \
            and attempt.first_token_ms is None
        if first:
            attempt.first_token_ms = self.trace.now_ms()
            if self.step.first_token_ms is None:
                self.trace.mark(self.step_id, "first_token")
        self.pieces.append(chunk.text)
        if chunk.finish_reason is None:
            self.generated += len(chunk.token_ids) if chunk.token_ids is not None else 1
        self.logprobs.extend(chunk.logprobs or ())
        attempt.finish_reason = chunk.finish_reason or attempt.finish_reason
        self.tool_calls = chunk.tool_calls or self.tool_calls
        if chunk.usage is not None:
            attempt.prompt_tokens = chunk.usage.prompt_tokens
            attempt.completion_tokens = chunk.usage.completion_tokens
            attempt.cached_tokens = chunk.usage.cached_tokens
        return first

    def failed(self, exc: BaseException) -> None:
        """The try ended with ``exc`` (nothing to book when no slot was granted). A try
        cancelled mid-stream (its group resolved without it) has outcome ``cancelled``
        and keeps the tokens it generated until then (the engine reports no usage for
        an aborted request): what it is billed for."""
        if self.attempt is not None:
            self.attempt.finished_ms, self.attempt.outcome = self.trace.now_ms(), "error"
            self.attempt.error = getattr(exc, "message", None) or type(exc).__name__
            if isinstance(exc, asyncio.CancelledError):
                self.attempt.outcome = "cancelled"
                self.attempt.completion_tokens = max(self.attempt.completion_tokens,
                                                     self.generated)
                self.step.completion_tokens = sum(a.completion_tokens
                                                  for a in self.step.attempts)

    def finished(self) -> AttemptTrace:
        """The try generated its whole answer: the step's marks and token sums."""
        assert self.attempt is not None  # set before the first chunk; errors raise first
        if self.step.first_token_ms is None:
            self.trace.mark(self.step_id, "first_token")
        self.trace.mark(self.step_id, "generated")
        for field in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            setattr(self.step, field, sum(getattr(a, field) for a in self.step.attempts))
        self.attempt.finished_ms = self.trace.now_ms()
        return self.attempt

    @property
    def text(self) -> str:
        return "".join(self.pieces)
