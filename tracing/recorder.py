"""Per-run trace records.

Each step's life is a handful of instants, stored as milliseconds since the run
started (a monotonic clock, so durations never go negative)::

    ready_ms        all inputs known; the step enters its backend's queue
    started_ms      dispatched to the engine (queue wait = started - ready)
    first_token_ms  first generated token (prefill / TTFT = first_token - started)
    generated_ms    last token (decode = generated - first_token)
    finished_ms     contract checked, output stored (validate = finished - generated)

An llm step also keeps one :class:`AttemptTrace` per try (``attempts``): a retry after a
contract failure or a step of a model cascade is its own attempt, with its own model,
instants, tokens and outcome, so retries show as children of the step.

An agent step (an llm step with tools) keeps one :class:`AttemptTrace` per model turn
(``turn`` set; a turn that asked for tools has outcome ``tool_calls``) and one
:class:`ToolCallTrace` per call its model asked for (``tool_calls``).

Client-run (``@tool``) steps use ``ready_ms`` (wanted) and ``finished_ms`` (result
arrived); their whole span is tool wait. The JSON-lines form (:meth:`RunTrace.records`)
is one ``run`` record followed by one ``step`` record per step.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class AttemptTrace:
    """One try of an llm step, times in ms since the run started.

    ``outcome``: ``running`` until it ends, then ``ok`` (output accepted),
    ``tool_calls`` (an agent step's turn that called tools: the loop went on),
    ``contract_failed`` (output rejected by the step's contract), ``low_confidence``
    (valid, but under the step's ``min_confidence``: escalated along its cascade),
    ``error`` (the engine or upstream failed), or ``cancelled`` (stopped mid-stream:
    its group resolved without it; ``completion_tokens`` are those generated until
    then). ``error`` holds the reason for the last four. ``confidence``: the geometric
    mean of the output's token probabilities, when the step asked for logprobs.
    ``model``: the name the step asked for (a cascade's ``small``/``large``; the served
    name when the step named none). ``finish_reason``:
    the engine's (``stop``, ``length``, ``abort``...), when the generation ended.
    ``turn``: an agent step's model turn (1 first, counted over the whole step).
    ``output``: a ``contract_failed`` attempt's rejected output, bounded by
    :func:`bounded_output` (what the user needs to see why it failed; None otherwise).
    """

    attempt: int
    model: str
    started_ms: float
    first_token_ms: float | None = None
    finished_ms: float | None = None
    outcome: str = "running"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    confidence: float | None = None
    finish_reason: str | None = None
    turn: int | None = None
    output: str | None = None


REJECTED_OUTPUT_CHARS = 2000
"""Characters of a rejected output kept in the trace (the start: where JSON went wrong
is usually visible there, and a runaway output must not bloat the run's log)."""


def bounded_output(text: str, limit: int = REJECTED_OUTPUT_CHARS) -> str:
    """``text`` itself, or its first ``limit`` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


@dataclass(slots=True)
class ToolCallTrace:
    """One tool call an agent step's model asked for, times in ms since the run started.

    ``call_id``: ``<step id>:call_<n>`` (what the app posts the result to); ``turn``: the
    model turn that asked; ``wanted_ms``/``finished_ms``: sent to the app / its result
    arrived (equal for a call never sent). ``outcome``: ``running``, ``ok``, ``error``
    (the tool raised), ``invalid`` (unknown tool or arguments that do not fit its
    schema: the error went back to the model), ``replayed`` (its result was in the
    run's log: a resumed run does not ask again), ``early_unused`` (a proxy call
    started while its turn streamed, and the turn failed or was cut off; id
    ``<step id>:early_<n>``: its result is kept for the retry's same call, which does not
    run the tool again) or ``cancelled`` (still out when its step was stopped: a lost
    group, a cancelled run, a deadline); ``error`` holds the reason.
    ``server``: the ``[tools.*]`` server that ran it on the proxy (its time is the
    ``tool_run`` stage, not the app's ``tool_wait``); None: the app ran it.
    """

    call_id: str
    name: str
    turn: int
    wanted_ms: float
    finished_ms: float | None = None
    outcome: str = "running"
    error: str | None = None
    server: str | None = None


def union_ms(spans: list[tuple[float, float]]) -> float:
    """The time ``spans`` (start, end pairs in ms) cover, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


@dataclass(slots=True)
class StepTrace:
    step_id: str
    kind: str
    name: str = ""
    model: str | None = None
    status: str = "pending"  # pending | queued | running | waiting_tool | done | failed
    ready_ms: float | None = None
    started_ms: float | None = None
    first_token_ms: float | None = None
    generated_ms: float | None = None
    finished_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    same_as: str | None = None  # an identical call whose output this step reused
    max_turns_reached: bool = False  # an agent step answered on its last turn, tools off
    attempts: list[AttemptTrace] = field(default_factory=list)
    tool_calls: list[ToolCallTrace] = field(default_factory=list)
    late_result_ms: float | None = None
    """A ``@tool`` step's result the app posted after the step had timed out (ms since
    the run started): discarded, kept here so the trace shows it came."""

    def to_record(self) -> dict[str, Any]:
        """This step's fields as JSON-ready data (what :meth:`restore` reads back)."""
        return asdict(self)

    def restore(self, record: dict[str, Any]) -> None:
        """Take the fields of a :meth:`to_record` (a step recorded before a restart);
        keys this class does not have are ignored."""
        for key, value in record.items():
            if key == "attempts":
                self.attempts = [AttemptTrace(**{k: v for k, v in a.items()
                                                 if k in AttemptTrace.__dataclass_fields__})
                                 for a in value]
            elif key in StepTrace.__dataclass_fields__ and key != "step_id":
                setattr(self, key, value)

    def durations_ms(self) -> dict[str, float]:
        """Time per stage in ms; stages that did not happen are absent.

        A step tried more than once (a contract retry, a cascade escalation) spends its
        earlier tries in ``retry`` (first try's start to the last try's start); prefill
        and decode are the last try's, so they add up to the wall time of the step. An
        agent step (tries with ``turn``) sums prefill and decode over its turns
        (:meth:`_turn_durations_ms`); its time with tool calls out is ``tool_wait`` (the
        app's calls) and ``tool_run`` (the proxy's own, :mod:`flowlift.proxy.tools`).
        """
        out: dict[str, float] = {}
        if self.kind == "tool":
            if self.ready_ms is not None and self.finished_ms is not None:
                out["tool_wait"] = self.finished_ms - self.ready_ms
            return out
        if any(a.turn is not None for a in self.attempts):
            return self._turn_durations_ms()
        started, first_token = self.started_ms, self.first_token_ms
        if len(self.attempts) > 1:
            last = self.attempts[-1]
            out["retry"] = max(0.0, last.started_ms - self.attempts[0].started_ms)
            started, first_token = last.started_ms, last.first_token_ms
        if self.tool_calls:
            out.update(self._tool_durations_ms())
            out["retry"] = max(0.0, out.get("retry", 0.0) - out.get("tool_wait", 0.0)
                               - out.get("tool_run", 0.0))
        pairs = (("queue", self.ready_ms, self.started_ms),
                 ("prefill", started, first_token),
                 ("decode", first_token, self.generated_ms),
                 ("validate", self.generated_ms, self.finished_ms))
        for stage, start, end in pairs:
            if start is not None and end is not None:
                out[stage] = max(0.0, end - start)
        return out

    def _tool_durations_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for stage, proxy in (("tool_wait", False), ("tool_run", True)):
            spans = [(c.wanted_ms, c.finished_ms) for c in self.tool_calls
                     if c.finished_ms is not None and (c.server is not None) == proxy]
            if spans:
                out[stage] = union_ms(spans)
        return out

    def _turn_durations_ms(self) -> dict[str, float]:
        """An agent step's stages: ``prefill`` and ``decode`` summed over its model turns
        (each turn is work, not a retry: a last turn of a few tokens must not hide the
        turns before it), a turn that failed (contract, engine, cancelled) in ``retry``,
        its tool calls in ``tool_wait``/``tool_run``; ``queue`` and ``validate`` as for
        any step."""
        out = dict.fromkeys(("prefill", "decode"), 0.0)
        last = len(self.attempts) - 1
        for k, a in enumerate(self.attempts):
            end = a.finished_ms
            if a.outcome not in ("ok", "tool_calls", "running"):
                if end is not None:
                    out["retry"] = out.get("retry", 0.0) + max(0.0, end - a.started_ms)
                continue
            if k == last and self.generated_ms is not None:
                end = self.generated_ms  # the rest, to the stored output, is validate
            first = a.first_token_ms if a.first_token_ms is not None else end
            if first is not None:
                out["prefill"] += max(0.0, first - a.started_ms)
                if end is not None:
                    out["decode"] += max(0.0, end - first)
        out.update(self._tool_durations_ms())
        for stage, start, stop in (("queue", self.ready_ms, self.started_ms),
                                   ("validate", self.generated_ms, self.finished_ms)):
            if start is not None and stop is not None:
                out[stage] = max(0.0, stop - start)
        return out


@dataclass(slots=True)
class RunTrace:
    """The trace of one workflow run. Times are ms since ``started_at`` (epoch seconds)."""

    run_id: str
    name: str
    workflow_class: str = "interactive"
    started_at: float = field(default_factory=time.time)
    status: str = "running"
    finished_ms: float | None = None
    steps: dict[str, StepTrace] = field(default_factory=dict)
    restarts: list[dict[str, float]] = field(default_factory=list)
    """Each time the run was resumed after its proxy stopped (a restart, or a takeover by
    another proxy): ``{"from_ms", "to_ms"}``, the last instant recorded before and the
    resume, in ms since the run started (the gap in which nothing of it ran)."""
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def now_ms(self) -> float:
        return (time.monotonic() - self._t0) * 1000.0

    def continue_from(self, started_at: float) -> None:
        """Count time from ``started_at`` (epoch s, an earlier process's start of this
        run), so a resumed run's instants line up with those recorded before the restart."""
        self.started_at = started_at
        self._t0 = time.monotonic() - max(0.0, time.time() - started_at)

    def step(self, step_id: str) -> StepTrace:
        return self.steps[step_id]

    def restarted(self) -> dict[str, float]:
        """Record that the run resumes now, after the steps restored into it (their last
        instant is where the gap starts; 0 when none had started); the gap recorded."""
        last = max((v for st in self.steps.values() for v in (
            st.ready_ms, st.started_ms, st.first_token_ms, st.generated_ms, st.finished_ms,
            *(a.finished_ms for a in st.attempts)) if v is not None), default=0.0)
        now = self.now_ms()
        gap = {"from_ms": min(last, now), "to_ms": now}  # (unrounded: the steps' are not)
        self.restarts.append(gap)
        return gap

    def add_step(self, step_id: str, kind: str, name: str = "",
                 model: str | None = None) -> StepTrace:
        st = StepTrace(step_id=step_id, kind=kind, name=name, model=model)
        self.steps[step_id] = st
        return st

    def mark(self, step_id: str, instant: str, **values: Any) -> None:
        """Set ``<instant>_ms`` of a step to now, plus any other given fields."""
        st = self.steps[step_id]
        setattr(st, f"{instant}_ms", self.now_ms())
        for key, value in values.items():
            setattr(st, key, value)

    def finish(self, status: str) -> None:
        self.status = status
        self.finished_ms = self.now_ms()

    def records(self) -> list[dict[str, Any]]:
        """JSON-ready records: one ``run`` record, then one per step."""
        head = {"type": "run", "run_id": self.run_id, "name": self.name,
                "class": self.workflow_class, "started_at": self.started_at,
                "status": self.status, "wall_ms": self.finished_ms,
                "restarts": [dict(g) for g in self.restarts]}
        steps = []
        for st in self.steps.values():
            rec = {"type": "step", "run_id": self.run_id, **asdict(st)}
            rec["stages_ms"] = st.durations_ms()
            steps.append(rec)
        return [head, *steps]
