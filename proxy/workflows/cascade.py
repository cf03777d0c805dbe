"""One llm step's attempts: contract check, cheap retries, escalation along a cascade.

Per model of the step (``LLMNode.models()``: its cascade, or its one model):

1. generate; check the output against the contract (always, native constraint or not:
   case W3);
2. on a contract failure with retries left (``LLMNode.retries``), re-run this step
   alone on the same model with the same resolved inputs, the rejected output as the
   assistant's turn and a user turn naming the validation errors (case T3);
   an output cut off at ``max_tokens`` (``finish_reason: "length"``) is retried instead
   with the same messages and twice the budget, up to the step's ceiling
   (:meth:`~flowlift.graph.Params.ceiling`): the same budget would cut it the same way.
   With no room left (or no retry) the error says the budget is too small, where it was
   cut, and what the ceiling allows; with no room left the model's remaining retries are
   skipped (a cascade escalates, keeping the raised budget);
3. when that model's retries are spent, or its output falls under ``min_confidence``
   (geometric mean of token probabilities; it escalates at once, without retries, since
   the output was valid), or it raised an error no retry can change
   (:class:`~flowlift.errors.ContextLengthExceeded`,
   :class:`~flowlift.errors.ContentRefused`), escalate to the next model with the
   step's original messages (FrugalGPT, Chen et al. 2023; LOTUS cascades).

A backend that sends no logprobs gives no confidence: the floor cannot apply there,
and the attempt's trace says so (its ``error`` note), rather than passing silently.

Transport failures (timeouts, 5xx, 429, a broken stream) are *not* retried here: the
proxy's :mod:`flowlift.proxy.dispatch.upstream.attempts` is the one layer that retries them, and an
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
from flowlift.tracing.recorder import bounded_output

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
    """One generation; ``max_tokens`` (when given) overrides the step's own."""

    def __call__(self, model: str | None, messages: Sequence[ChatMessage], *,
                 logprobs: bool, max_tokens: int | None = None) -> Awaitable[Generated]: ...


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
    budget = node.params.max_tokens
    for i, model in enumerate(models):
        last = i == len(models) - 1
        floor = None if last else node.min_confidence
        convo = list(messages)
        tries = 0
        for _ in range(node.retries + 1):
            tries += 1
            try:
                out = await attempt(model, convo, logprobs=floor is not None,
                                    max_tokens=budget)
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
                t.output = bounded_output(out.text)  # kept where the user looks
                if t.finish_reason == "length":
                    raised, failure = cut_off(node, exc, budget, retry=tries <= node.retries)
                    t.error = failure.message
                    if raised is None:
                        break
                    budget, convo = raised, list(messages)
                elif node.contract is not None and tries <= node.retries:
                    convo = [*messages, *feedback(node.contract, out.text, exc)]
                continue
            if _under_floor(out, floor):
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


def _under_floor(out: Generated, floor: float | None) -> bool:
    """Note the output's confidence on its trace; True when it falls under ``floor``."""
    t = out.trace
    t.confidence = confidence(out.logprobs)
    if floor is not None and t.confidence is None:  # visible, never silent
        t.error = "the backend sent no logprobs: the confidence floor was not applied"
    elif floor is not None and t.confidence is not None and t.confidence < floor:
        t.outcome = "low_confidence"
        t.error = f"confidence {t.confidence:.3f} under the floor {floor}"
        return True
    return False


def cut_off(node: LLMNode, exc: ContractError, budget: int | None, *,
            retry: bool) -> tuple[int | None, ContractError]:
    """After an output cut off at ``budget`` tokens failed its contract: the budget of the
    next try (``None``: no room left under the ceiling) and the error saying so.

    Args:
        node: the step (its ``params`` hold ``max_tokens`` and the ceiling).
        exc: the contract failure of the cut-off output.
        budget: the ``max_tokens`` that attempt ran with (``None``: no limit was set;
            the model's context cut it).
        retry: whether this model has a retry left.
    """
    ceiling = node.params.ceiling()
    cut = f"the output was cut off at max_tokens={budget} (finish_reason 'length')"

    def error(why: str) -> ContractError:
        return ContractError(f"{exc.message}; {why}", step_id=exc.step_id, model=exc.model,
                             attempt=exc.attempt, errors=[*exc.errors, cut])

    if budget is None or ceiling is None:
        return None, error("the output was cut off by the model's context (no max_tokens "
                           "was set): shorten the prompt or bound the output (maxLength, "
                           "maxItems)")
    room = min(ceiling, 2 * budget)
    if room <= budget:
        return None, error(f"{cut} and its ceiling max_tokens_ceiling={ceiling} leaves no "
                           "room: the budget is too small for this output; raise "
                           "max_tokens_ceiling (and max_tokens), or bound the output "
                           "(maxLength, maxItems)")
    if not retry:
        return budget, error(f"{cut}: the budget is too small for this output; raise "
                             f"max_tokens, or set retries >= 1 to retry with up to "
                             f"max_tokens={room} (ceiling {ceiling})")
    log.info("step_cut_off", step=node.id, max_tokens=budget, retry_max_tokens=room)
    return room, error(f"{cut}: retried with max_tokens={room} (ceiling {ceiling})")
