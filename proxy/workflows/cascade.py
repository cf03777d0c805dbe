"""One llm step's attempts: contract check, cheap retries, escalation along a cascade.

Per model of the step (``LLMNode.models()``: its cascade, or its one model):

1. generate; check the output against the contract (always, native constraint or not:
   case W3);
2. on a contract failure with retries left (``LLMNode.retries``), re-run this step
   alone on the same model with the same resolved inputs, the rejected output as the
   assistant's turn and a user turn naming the validation errors (case T3);
3. when that model's retries are spent, or its output falls under ``min_confidence``
   (geometric mean of token probabilities; it escalates at once, without retries, since
   the output was valid), or it raised an error no retry can change
   (:class:`~flowlift.errors.ContextLengthExceeded`,
   :class:`~flowlift.errors.ContentRefused`), escalate to the next model with the
   step's original messages (FrugalGPT, Chen et al. 2023; LOTUS cascades).

A backend that sends no logprobs gives no confidence: the floor cannot apply there,
and the attempt's trace says so (its ``error`` note), rather than passing silently.

Transport failures (timeouts, 5xx, 429, a broken stream) are *not* retried here: the
proxy's :mod:`flowlift.proxy.dispatch.attempts` is the one layer that retries them, and an
engine error that comes out of it fails the step (no second layer, case T3; a route's
``fallbacks`` are the place for another backend). The last model's output is kept
whatever its confidence; its contract failure is the step's :class:`ContractError`
(naming step, model, attempt and errors).

Each model tried is reported to ``record(step, model, accepted, attempts)``: the
failure rates the compiler's cascade estimate learns from.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flowlift.errors import ContentRefused, ContextLengthExceeded, ContractError, FlowliftError
from flowlift.graph import LLMNode
from flowlift.local_engine.base import ChatMessage, TokenLogprob, ToolCall
from flowlift.proxy.workflows.contracts import check_output, feedback
from flowlift.tracing import AttemptTrace, get_logger

log = get_logger("flowlift.cascade")
UNRETRYABLE = (ContextLengthExceeded, ContentRefused)
"""Errors no retry on the same model can change; a cascade escalates past them."""


@dataclass(slots=True)
class Generated:
    """One attempt's output: its text, token logprobs (when asked for), its trace, and
    the tool calls of an agent step's turn that called tools."""

    text: str
    trace: AttemptTrace
    logprobs: Sequence[TokenLogprob] = ()
    tool_calls: tuple[ToolCall, ...] | None = None


class Attempt(Protocol):
    def __call__(self, model: str | None, messages: Sequence[ChatMessage], *,
                 logprobs: bool) -> Awaitable[Generated]: ...


Record = Callable[[str, str | None, bool, int], None]


def confidence(logprobs: Sequence[TokenLogprob]) -> float | None:
    """Geometric mean of the token probabilities, ``exp(mean logprob)`` in (0, 1];
    ``None`` without logprobs (the backend sent none)."""
    if not logprobs:
        return None
    return math.exp(sum(t.logprob for t in logprobs) / len(logprobs))


async def run_step(node: LLMNode, messages: Sequence[ChatMessage], attempt: Attempt,
                   record: Record | None = None) -> tuple[Any, str | None]:
    """Run ``node`` through its retries and cascade.

    Returns:
        ``(value, model)``: the accepted output and the model that produced it.

    Raises:
        ContractError: the last model's output failed its contract after its retries.
        ContextLengthExceeded, ContentRefused: the last model could not answer at all.
        FlowliftError: any other failure of an attempt (not retried here).
    """
    models = node.models()
    step = node.name or node.id
    failure: FlowliftError | None = None
    for i, model in enumerate(models):
        last = i == len(models) - 1
        floor = None if last else node.min_confidence
        convo = list(messages)
        tries = 0
        for _ in range(node.retries + 1):
            tries += 1
            try:
                out = await attempt(model, convo, logprobs=floor is not None)
            except UNRETRYABLE as exc:
                failure = exc
                log.info("step_unretryable", step=node.id, model=model, error=exc.message)
                break
            t = out.trace
            try:
                value = check_output(node.contract, out.text, step_id=node.id,
                                     model=t.model, attempt=t.attempt)
            except ContractError as exc:
                t.outcome, t.error, failure = "contract_failed", exc.message, exc
                if node.contract is not None and tries <= node.retries:
                    convo = [*messages, *feedback(node.contract, out.text, exc)]
                continue
            t.confidence = confidence(out.logprobs)
            if floor is not None and t.confidence is None:  # visible, never silent
                t.error = "the backend sent no logprobs: the confidence floor was not applied"
            elif floor is not None and t.confidence is not None and t.confidence < floor:
                t.outcome = "low_confidence"
                t.error = f"confidence {t.confidence:.3f} under the floor {floor}"
                failure = None
                break
            t.outcome = "ok"
            if record is not None:
                record(step, model, True, tries)
            return value, model
        if record is not None:
            record(step, model, False, tries)
        if not last:
            log.info("step_escalated", step=node.id, model=model, to=models[i + 1],
                     attempts=tries)
    assert failure is not None, "the last model's output is always kept or raised"
    raise failure
