"""What the routers in front of an engine fleet read, written from what flowlift knows
of a request (pure: no I/O). Each adapter is opted in by name per backend
(``hints = [...]``); ``docs/distributed.md`` says what each buys and which router
release it was checked against.

* ``"vllm-session"``: vLLM's ``session_id`` body field and its ``X-Session-ID`` header
  (vLLM 0.32 ``ChatCompletionRequest.session_id``,
  ``entrypoints/generate/base/serving.py`` ``SESSION_ID_HEADER``; the id reaches the KV
  events llm-d and Dynamo index, ``distributed/kv_events.py`` ``BlockStored``). vllm-router
  0.1.17's ``consistent_hash`` policy reads the same header first
  (``policies/hash_key.rs`` ``SESSION_HEADER_NAMES``).
* ``"vllm-router-program"``: vllm-router's program scheduling,
  ``vllm_xargs.agentic_context`` (``program_scheduling/identity.rs``
  ``canonical_identity``): ``program_id`` (the session), ``step_id`` (its requests
  counted from 0), ``priority`` (the router resumes *larger* values first, so
  flowlift's order negated), ``deadline_seconds``, ``expected_output_length``,
  ``kv_retention_ttl_seconds`` and ``expected_resume`` on an agent turn whose next turn
  comes back. Sent as a JSON *string*: the router decodes one
  (``canonical_context``), and vLLM 0.32's own ``vllm_xargs`` is typed for flat values
  only (``dict[str, str | int | float | list]``: a nested object would not validate in
  the vLLM behind the router), plus ``x-session-id``.
* ``"llm-d"``: llm-d's inference scheduler headers: ``x-session-id`` (its
  ``session-id-producer`` with ``headerName: x-session-id``),
  ``x-llm-d-inference-fairness-id`` (the program: flow control's fairness is per
  session) and ``x-llm-d-inference-objective`` (the workflow class, naming an
  ``InferenceObjective`` whose priority the operator sets).
* ``"dynamo-session"``: the ``X-Dynamo-Session-ID`` header, which Dynamo's frontend
  routes by (``--router-session-affinity-ttl-secs``). Not ``nvext.session_control``:
  Dynamo 1.6.1's frontend refuses it (``unknown field `session_control```, a 400; it is
  in later sources, ``lib/llm/src/protocols/openai/nvext.rs``).
* ``"sglang-routing-key"``: SGLang Model Gateway's ``X-SMG-Routing-Key`` (its
  ``consistent_hashing`` and ``manual`` policies; the gateway forwards the header).
* ``"sglang-priority"``: SGLang's ``priority`` body field on *its* scale: higher first
  (``schedule_low_priority_values_first`` is off by default), so flowlift's order
  negated and bounded to an i32 (``vllm-priority`` writes it unchanged: lower first).

A body field the request already holds is never overridden; a hint's header replaces a
client header of the same name let through by ``pass_headers`` (the proxy's session is
the affinity key).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson
from cachetools import TTLCache

from flowlift.local_engine.base import GenerationRequest
from flowlift.proxy.config import UpstreamSpec
from flowlift.proxy.dispatch.slots.scheduler import CLASS_RANK, Priority

I32_MAX: Final = 2**31 - 1
_CLASS_OF_RANK = {rank: name for name, rank in CLASS_RANK.items()}
_RANK_STEP: Final = 1_000_000_000  # Priority.engine_priority's class stride


def i32(value: int) -> int:
    """``value`` clamped to a signed 32-bit integer."""
    return max(-I32_MAX - 1, min(value, I32_MAX))


@dataclass(frozen=True, slots=True)
class StepHints:
    """What the scheduler knows about one upstream request.

    Attributes:
        priority: flowlift's queue order as one integer (lower runs earlier); None: the
            proxy has no order for it (a drop-in request), none is written.
        session_id: the run (or session) the request belongs to: the *program*; None.
        expected_output_tokens: the step's expected output length, tokens; None: unknown.
        next_turn: a later request continues this one's conversation (an agent turn).
        workflow_class: ``interactive``, ``batch`` or ``idle``; None: unknown.
        deadline_s: seconds left until the run's deadline; None: no deadline.
        step: the request's ordinal within its program (0 first); None: not counted.
        kv_retention_ttl_s: how long the program's KV is worth keeping after this
            request when its next turn comes back (seconds); None.
    """

    priority: int | None
    session_id: str | None = None
    expected_output_tokens: int | None = None
    next_turn: bool = False
    workflow_class: str | None = None
    deadline_s: float | None = None
    step: int | None = None
    kv_retention_ttl_s: float | None = None

    @classmethod
    def of(cls, request: GenerationRequest, priority: int | None = None) -> StepHints:
        """The hints of a workflow step's ``request`` (``priority``: the granted one,
        when the step was promoted while it waited; default: the request's)."""
        expected = request.expected_output_tokens
        cap = request.sampling.max_tokens
        if expected is None or (cap is not None and expected > cap):
            expected = cap
        return cls(request.priority if priority is None else priority, request.session_id,
                   expected, bool(request.tools))

    def routed(self, granted: Priority | None, *, step: int | None,
               kv_retention_ttl_s: float | None) -> StepHints:
        """These hints with what the routers read besides: the class and the deadline
        (from the granted slot's ``granted``, else the class from :attr:`priority`),
        the program's ``step`` ordinal and the KV retention of an agent turn."""
        cls_name = (_CLASS_OF_RANK.get(granted.class_rank) if granted is not None
                    else None if self.priority is None else class_of(self.priority))
        return dataclasses.replace(
            self, workflow_class=cls_name, step=step,
            deadline_s=None if granted is None else deadline_left_s(granted),
            kv_retention_ttl_s=kv_retention_ttl_s if self.next_turn else None)


def class_of(engine_priority: int) -> str:
    """The workflow class of an :meth:`~.scheduler.Priority.engine_priority` value
    (``class_rank * 1e9 - remaining ms``, the remaining part below 1e9)."""
    rank = -(-engine_priority // _RANK_STEP)  # ceil
    return _CLASS_OF_RANK.get(rank, "batch" if rank > 0 else "interactive")


def deadline_left_s(priority: Priority) -> float | None:
    """Seconds until the run's deadline from a granted :class:`~.scheduler.Priority`
    (its slack plus the critical path left); None: no deadline."""
    if math.isinf(priority.slack_ms):
        return None
    return max((priority.slack_ms - priority.neg_remaining_ms) / 1000.0, 0.0)


class ProgramSteps:
    """Counts each program's requests (vllm-router's ``step_id``), bounded.

    Args:
        max_programs: programs remembered at most (least recent go first).
        ttl_s: a program not seen for this long starts again at 0.
    """

    def __init__(self, max_programs: int = 100_000, ttl_s: float = 3600.0) -> None:
        self._next: TTLCache[str, int] = TTLCache(maxsize=max_programs, ttl=ttl_s)

    def next(self, program: str) -> int:
        """The ordinal of ``program``'s next request (0 first)."""
        step = self._next.get(program, 0)
        self._next[program] = step + 1
        return step


def fleet_headers(spec: UpstreamSpec, hints: StepHints) -> dict[str, str]:
    """The request headers ``spec``'s opted-in router hints add (empty: none).

    Header values are the session id and the class name, printable ASCII already (the
    proxy checks a session id where it enters: ``X-Flowlift-Session``, run ids)."""
    opted = spec.hints
    out: dict[str, str] = {}
    session = hints.session_id
    if session:
        if "vllm-session" in opted:
            out["x-session-id"] = session
        if "vllm-router-program" in opted or "llm-d" in opted:
            out["x-session-id"] = session
        if "llm-d" in opted:
            out["x-llm-d-inference-fairness-id"] = session
        if "dynamo-session" in opted:
            out["x-dynamo-session-id"] = session
        if "sglang-routing-key" in opted:
            out["x-smg-routing-key"] = session
    if "llm-d" in opted and hints.workflow_class is not None:
        out["x-llm-d-inference-objective"] = hints.workflow_class
    return out


def fleet_fields(spec: UpstreamSpec, hints: StepHints, body: Mapping[str, Any]
                 ) -> dict[str, Any]:
    """The top-level body fields ``spec``'s opted-in router hints add to ``body``
    (``vllm_xargs`` merged with the body's own; fields already there win).
    """
    opted = spec.hints
    out: dict[str, Any] = {}
    session = hints.session_id
    if "vllm-session" in opted and session and "session_id" not in body:
        out["session_id"] = session
    if ("sglang-priority" in opted and hints.priority is not None
            and "priority" not in body):
        out["priority"] = i32(-hints.priority)
    if "vllm-router-program" in opted and session:
        xargs = _merged(body, "vllm_xargs", "agentic_context",
                        orjson.dumps(agentic_context(hints, session)).decode())
        if xargs is not None:
            out["vllm_xargs"] = xargs
    return out


def agentic_context(hints: StepHints, program: str) -> dict[str, Any]:
    """vllm-router's ``agentic_context`` for a request of ``program``: only the fields
    flowlift knows (the router fills the rest: a missing ``step_id`` counts on)."""
    context: dict[str, Any] = {"program_id": program}
    if hints.step is not None:
        context["step_id"] = hints.step
    if hints.priority is not None:
        context["priority"] = -hints.priority  # the router resumes larger values first
    if hints.deadline_s is not None:
        context["deadline_seconds"] = round(hints.deadline_s, 3)
    if hints.expected_output_tokens is not None:
        context["expected_output_length"] = max(int(hints.expected_output_tokens), 1)
    if hints.next_turn:
        context["expected_resume"] = True
        if hints.kv_retention_ttl_s is not None:
            context["kv_retention_ttl_seconds"] = hints.kv_retention_ttl_s
    return context


def _merged(body: Mapping[str, Any], outer: str, key: str, value: Any
            ) -> dict[str, Any] | None:
    """``body[outer]`` with ``key: value`` added, or None when the body's own object
    holds ``key`` already (the client's wins) or ``outer`` is not an object."""
    theirs = body.get(outer)
    if theirs is None:
        return {key: value}
    if not isinstance(theirs, Mapping) or key in theirs:
        return None
    return {**theirs, key: value}


__all__ = ["I32_MAX", "ProgramSteps", "StepHints", "agentic_context", "class_of",
           "deadline_left_s", "fleet_fields", "fleet_headers", "i32"]
