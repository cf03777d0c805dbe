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
  routes by (``--router-session-affinity-ttl-secs``), and on an agent step's turn
  ``X-Dynamo-Parent-Session-ID`` (below). Not ``nvext.session_control``:
  Dynamo 1.6.1's frontend refuses it (``unknown field `session_control```, a 400; it is
  in later sources, ``lib/llm/src/protocols/openai/nvext.rs``).
* ``"sglang-routing-key"``: SGLang Model Gateway's ``X-SMG-Routing-Key`` (its
  ``consistent_hashing`` and ``manual`` policies; the gateway forwards the header).
* ``"sglang-priority"``: SGLang's ``priority`` body field on *its* scale: higher first
  (``schedule_low_priority_values_first`` is off by default), so flowlift's order
  negated and bounded to an i32 (``vllm-priority`` writes it unchanged: lower first).

**Parents.** An agent step's turns (a workflow llm step with tools) are a conversation
of their own inside the run, a sub-agent: its program / session is
``<run key>:<step id>`` (:func:`program_of`) and its parent is the run. vllm-router
gets ``task_id`` = the run (its placement key: the sub-agent is placed where the run
is), ``agent_id`` = the step, ``agent_role: "subagent"``, ``parent_program_id`` = the
run and ``blocks_parent: false`` (the run's other branches go on meanwhile;
``identity.rs`` ``canonical_identity``); Dynamo gets the sub-agent's session in
``X-Dynamo-Session-ID`` and the run in ``X-Dynamo-Parent-Session-ID`` (the lineage
header Dynamo's agentic scheduling and its benchmark clients send). Every other request
of a run, and a drop-in session's, is the root: no parent. The other adapters keep the
run as the session (their affinity key, one per run).

A body field the request already holds is never overridden; a hint's header replaces a
client header of the same name let through by ``pass_headers`` (the proxy's session is
the affinity key).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
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
_PLAIN_ID: Final = re.compile(r"[A-Za-z0-9._\[\]-]{1,64}")


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
        agent_id: the agent step whose turn this is (a sub-agent of the session, its
            parent); None: the session's own request.
    """

    priority: int | None
    session_id: str | None = None
    expected_output_tokens: int | None = None
    next_turn: bool = False
    workflow_class: str | None = None
    deadline_s: float | None = None
    step: int | None = None
    kv_retention_ttl_s: float | None = None
    agent_id: str | None = None

    @property
    def program(self) -> str | None:
        """The program / session the routers see (:func:`program_of`); None: none."""
        return program_of(self.session_id, self.agent_id)

    @property
    def parent(self) -> str | None:
        """The parent of :attr:`program`: the session of an agent's turn; None: a root."""
        return self.session_id if self.agent_id and self.session_id else None

    @classmethod
    def of(cls, request: GenerationRequest, priority: int | None = None) -> StepHints:
        """The hints of a workflow step's ``request`` (``priority``: the granted one,
        when the step was promoted while it waited; default: the request's)."""
        expected = request.expected_output_tokens
        cap = request.sampling.max_tokens
        if expected is None or (cap is not None and expected > cap):
            expected = cap
        return cls(request.priority if priority is None else priority, request.session_id,
                   expected, bool(request.tools), agent_id=request.agent_id)

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


def agent_component(agent_id: str) -> str:
    """``agent_id`` as it may go into a header and a router's program id: the step id
    itself when it is a short, plain ASCII name, else ``h-`` and a 16-hex digest of it
    (step ids may be 200 characters of any text; vllm-router bounds an identity
    component to 256 bytes, and a header takes printable ASCII)."""
    if _PLAIN_ID.fullmatch(agent_id):
        return agent_id
    return "h-" + hashlib.blake2b(agent_id.encode(), digest_size=8).hexdigest()


def program_of(session_id: str | None, agent_id: str | None) -> str | None:
    """The program of a request of ``session_id``: the session itself, or an agent
    step's own sub-session ``<session>:<agent>`` (:func:`agent_component`; the shape of
    vllm-router's scoped program id, ``identity.rs`` ``scoped_program_id``); None: no
    session."""
    if session_id is None:
        return None
    return f"{session_id}:{agent_component(agent_id)}" if agent_id else session_id


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
            out["x-dynamo-session-id"] = hints.program or session
            if hints.parent is not None:
                out["x-dynamo-parent-session-id"] = hints.parent
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
                        orjson.dumps(agentic_context(hints, hints.program or session)
                                     ).decode())
        if xargs is not None:
            out["vllm_xargs"] = xargs
    return out


def agentic_context(hints: StepHints, program: str) -> dict[str, Any]:
    """vllm-router's ``agentic_context`` for a request of ``program``: only the fields
    flowlift knows (the router fills the rest: a missing ``step_id`` counts on); an
    agent's turn names its run as task and parent (the module's **Parents**)."""
    context: dict[str, Any] = {"program_id": program}
    if hints.parent is not None and hints.agent_id:
        context.update(task_id=hints.parent, agent_id=agent_component(hints.agent_id),
                       agent_role="subagent", parent_program_id=hints.parent,
                       blocks_parent=False)
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


__all__ = ["I32_MAX", "ProgramSteps", "StepHints", "agent_component", "agentic_context",
           "class_of", "deadline_left_s", "fleet_fields", "fleet_headers", "i32",
           "program_of"]
