"""Agent steps: an llm step with ``tools`` loops on the proxy, turn by turn.

One model turn (the step's conversation, its tools offered) -> if the answer calls
tools, each call is checked (:func:`check_call`: a tool of the step, arguments that fit
its JSON Schema); a valid call goes to the app as a ``tool.wanted`` event with its own
id (``<step id>:call_<n>``, so the calls of one turn run concurrently there) and the
deadline clock stops while any call is out; a bad call's error text is its result, as
OpenAI's agents do. Every result joins the same conversation as a ``tool`` message, in
the order of the calls, and the next turn goes -- same replica (affinity: the run id),
same prefix (only the new messages are prefilled), at interactive continuation
priority. The loop ends when the model answers without calls: that answer is the
step's output, checked by its contract as usual
(:func:`~flowlift.proxy.workflows.cascade.run_step` wraps the whole loop). It fails
with :class:`~flowlift.errors.StepFailed` when ``max_turns`` turns still called tools
(``on_max_turns="raise"``), or, with ``tool_errors="raise"``, when a tool raised.

A loop that finishes (issue 34): with ``on_max_turns="answer"`` (the default unless
``tool_choice="required"``) the last allowed turn is asked for the answer with the
tools off (:data:`ANSWER_NOW`), and the step's trace shows ``max_turns_reached``. An
answer that is only a fragment of JSON or markup (``{``,
:func:`~flowlift.proxy.wire.content_calls.no_answer`) is not taken for
the answer: the turn is tried once more with the reason, then the step fails.

Proxy tools (a :class:`~flowlift.graph.ToolSpec` with ``server``,
:mod:`flowlift.proxy.tools`): a valid call runs on the proxy (``proxy_tools``) instead
of going to the app: no ``tool.wanted``, no app round trip, and the deadline clock keeps
running (the proxy's own time counts against the run's deadline, as its model turns
do). Each one starts as soon as its arguments are complete in the turn's stream
(``ready_calls`` of the engine's chunks), before the turn ends; the turn's final calls
take the early start of the same call (same name and arguments) and start the others
then. App calls and proxy calls of one turn run concurrently. A proxy call's result is
logged only after the turn's ``agent.turn`` event, as an app call's is.

Durability: a turn that called tools is an ``agent.turn`` event in the run's log, and
each call's result a ``tool.result`` event. A resumed run replays them in order (turns
are numbered over the whole step) instead of generating again or asking the app (or
the proxy's tool server) again; only what the log does not hold is asked for. A proxy
call in flight when the proxy died has no ``tool.result`` and runs again on resume (at
least once, as an app tool that had not answered).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

import jsonschema

from flowlift.errors import StepFailed, ToolError
from flowlift.graph import LLMNode, ToolSpec, render_value
from flowlift.local_engine.base import ChatMessage, ToolCall, ToolDef
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.store.events import Event
from flowlift.proxy.tools.outcome import ToolOutcome
from flowlift.proxy.wire.content_calls import ANSWER_NOW, no_answer, recognise, retry_message
from flowlift.proxy.wire.early_calls import call_key
from flowlift.proxy.workflows.ahead import next_turn_prefix
from flowlift.proxy.workflows.cascade import Generated
from flowlift.proxy.workflows.deadline import DeadlineClock
from flowlift.tracing import AttemptTrace, RunTrace, ToolCallTrace

_TOOL_JSON = re.compile(r'\s*\{\s*"tool_calls"')
"""The start of the constrained JSON of a turn that calls tools (the embedded engine's
tool-call format, :mod:`flowlift.proxy.wire.tool_calls`)."""


class ToolRaised(ToolError):
    """The app's ``@tool`` raised; ``error`` is its text (``"ValueError: ..."``)."""

    def __init__(self, step_id: str, error: str) -> None:
        super().__init__(step_id, f"tool {step_id!r} raised: {error}")
        self.error = error


class Turn(Protocol):
    """One generation of the step on ``model`` at ``priority``; ``on_call`` gets each
    call whose JSON is complete while the turn still streams."""

    def __call__(self, model: str | None, messages: Sequence[ChatMessage], *,
                 logprobs: bool, priority: Priority | None,
                 max_tokens: int | None = None,
                 on_call: Callable[[ToolCall], None] | None = None,
                 tools: bool = True,
                 ) -> Awaitable[Generated]: ...


class ProxyTools(Protocol):
    """Runs a proxy tool (:meth:`flowlift.proxy.tools.ToolServers.call`): never raises
    for the tool's own failures, bounds its time and its result."""

    def call(self, server: str, name: str, args: dict[str, Any]) -> Awaitable[ToolOutcome]: ...

    def starts_early(self, server: str, name: str) -> bool:
        """Whether a call may start while its turn still streams
        (:meth:`flowlift.proxy.tools.ToolServers.starts_early`)."""
        ...


def check_call(call: ToolCall, tools: Sequence[ToolSpec]) -> dict[str, Any] | str:
    """The arguments of a call the step allows, or the error text for the model.

    Returns:
        The parsed arguments (a JSON object that fits the tool's ``parameters``), or a
        string starting ``error:`` naming what is wrong (unknown tool, arguments that
        are not a JSON object, every schema violation with its path).
    """
    spec = next((t for t in tools if t.name == call.name), None)
    if spec is None:
        names = ", ".join(t.name for t in tools)
        return f"error: there is no tool {call.name!r}; the tools are: {names}"
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError as exc:
        return f"error: the arguments of {call.name} are not JSON ({exc}); send a JSON object"
    if not isinstance(args, dict):
        return f"error: the arguments of {call.name} must be a JSON object, not {args!r}"
    problems = sorted(jsonschema.Draft202012Validator(spec.parameters).iter_errors(args),
                      key=lambda e: list(map(str, e.absolute_path)))
    if problems:
        lines = "; ".join(f"{'/'.join(map(str, e.absolute_path)) or '(arguments)'}: "
                          f"{e.message}" for e in problems)
        return f"error: bad arguments for {call.name}: {lines}"
    return args


def logged(history: Iterable[Event], step_id: str
           ) -> tuple[dict[int, dict[str, Any]], dict[str, dict[str, Any]]]:
    """``(turn -> agent.turn data, call id -> tool.result data)`` of one step in a log."""
    turns: dict[int, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    for _, name, data in history:
        if name == "agent.turn" and data.get("step_id") == step_id:
            turns[int(data["turn"])] = data
        elif name == "tool.result" and str(data.get("step_id", "")).startswith(f"{step_id}:"):
            results[data["step_id"]] = data
    return turns, results


class AgentLoop:
    """The turns of one agent step; an
    :class:`~flowlift.proxy.workflows.cascade.Attempt` (a retry or the next model of a
    cascade runs the loop again from the given messages).

    Args:
        node: the step (``node.tools`` set).
        turn: one generation of it.
        continuation: the priority of turns after the first (interactive).
        trace: the run's trace.
        emit: appends an event to the run's log.
        history: the log so far (a resumed run's turns and results are replayed).
        waiting: call id -> the future the app's result resolves (the run's
            client-run results, :meth:`Run.deliver_tool_result`).
        clock: the run's deadline clock (paused while calls are out), if any.
        ahead: ``(model, messages)`` -> prefill the next turn's known start while the
            calls are out (:func:`flowlift.proxy.workflows.ahead.next_turn_prefix`);
            None: never.
        proxy_tools: runs the step's proxy tools (None: the proxy has none; such a
            call's result is an error).
    """

    def __init__(self, node: LLMNode, *, turn: Turn, continuation: Callable[[], Priority],
                 trace: RunTrace, emit: Callable[[str, dict[str, Any]], object],
                 history: Iterable[Event], waiting: dict[str, asyncio.Future[Any]],
                 clock: DeadlineClock | None,
                 ahead: Callable[[str | None, Sequence[ChatMessage]], None] | None = None,
                 proxy_tools: ProxyTools | None = None) -> None:
        self.node, self._turn, self._continuation = node, turn, continuation
        self.trace, self._emit, self._waiting, self._clock = trace, emit, waiting, clock
        self.tools = node.tools or ()
        self._ahead = ahead
        self._proxy = proxy_tools
        # early starts of this turn: call key -> (task, started at ms), in stream order
        self._early: dict[tuple[str, str], list[tuple[asyncio.Task[ToolOutcome], float]]] = {}
        self._kept: dict[tuple[str, str], list[tuple[asyncio.Task[ToolOutcome], float]]] = {}
        self._unused = 0
        self._turns, self._results = logged(history, node.id)
        self.turns = 0  # over the whole step (retries and cascade included)
        self.calls = 0

    async def __call__(self, model: str | None, messages: Sequence[ChatMessage], *,
                       logprobs: bool, max_tokens: int | None = None) -> Generated:
        """Run the loop from ``messages``; the answer without tool calls (``max_tokens``:
        each turn's budget when a retry raised it, else the step's own).

        Raises:
            StepFailed: ``max_turns`` turns still called tools; a tool raised under
                ``tool_errors="raise"``.
            FlowliftError: a turn's generation failed.
        """
        convo = list(messages)
        last_tool = ""
        retried = False  # a fragment answer gets one more try, with the reason
        k = 0
        while k < self.node.max_turns:
            k += 1
            self.turns += 1
            final = k == self.node.max_turns and self.node.answers_at_max_turns
            asked = [*convo, ChatMessage("user", ANSWER_NOW)] if final else convo
            priority = self._continuation() if k > 1 else None
            out = await self._one(model, asked, logprobs=logprobs, max_tokens=max_tokens,
                                  tools=not final, priority=priority)
            if out.tool_calls and out.trace.finish_reason == "length":
                out = await self._uncut(model, asked, out, logprobs=logprobs,
                                        priority=priority, max_tokens=max_tokens)
            if not out.tool_calls:
                self._keep_early("it was cut off" if out.trace.finish_reason == "length"
                                 else "it answered without them")
                self._check_not_cut(out)
                why = (no_answer(out.text, after_tools=k > 1 and self.node.contract is None)
                       or self._written_call(out.text))
                if why is not None and not retried:
                    retried, k = True, k - 1  # the retry takes the same turn's place
                    out.trace.outcome = "fragment"
                    convo = [*convo, ChatMessage("assistant", out.text),
                             ChatMessage("user", retry_message(why, final))]
                    continue
                if why is not None and final:
                    raise StepFailed(self.node.id, f"agent step {self.node.id!r}: no answer "
                                     f"after {self.node.max_turns} turns (max_turns="
                                     f"{self.node.max_turns}): the last turn, asked for the "
                                     f"answer with the tools off, twice gave none ({why})")
                if why is not None:
                    raise StepFailed(self.node.id, f"agent step {self.node.id!r}: turn "
                                     f"{self.turns}'s answer is no answer ({why}), twice")
                self.trace.step(self.node.id).max_turns_reached = final
                self._forget_kept()
                return out
            out.trace.outcome = "tool_calls"
            calls = out.tool_calls
            last_tool = calls[-1].name
            if self.turns not in self._turns:
                self._emit("agent.turn", {"step_id": self.node.id, "turn": self.turns,
                                          "content": out.text, "tool_calls": [
                                              [c.id, c.name, c.arguments] for c in calls]})
            if k == self.node.max_turns:
                self._drop_early()
                break
            if self._ahead is not None and self._asks(calls):
                self._ahead(model, next_turn_prefix(convo, out.text, calls))
            results = await self._run_calls(calls)
            # a new list each turn: the request of an earlier turn keeps its messages
            convo = [*convo, ChatMessage("assistant", out.text, tool_calls=calls),
                     *(ChatMessage("tool", text, tool_call_id=c.id)
                       for c, text in zip(calls, results, strict=True))]
        raise StepFailed(self.node.id, f"agent step {self.node.id!r}: no answer after "
                         f"{self.node.max_turns} turns "
                         f"(max_turns={self.node.max_turns}, on_max_turns=\"raise\"): every "
                         f"turn called tools; the last tool asked for was {last_tool!r}")

    def _written_call(self, text: str) -> str | None:
        """Why an answer that is a call of one of the step's tools written as JSON (a
        turn with the tools off, or a format that left it in the content) is no
        answer; None otherwise."""
        found = recognise(text, [ToolDef(t.name, t.description, t.parameters)
                                 for t in self.tools])
        if found.kind != "calls":
            return None
        return f"the answer is a call of {found.calls[0].name} written as JSON"

    async def _one(self, model: str | None, convo: Sequence[ChatMessage], *, logprobs: bool,
                   max_tokens: int | None, tools: bool, priority: Priority | None
                   ) -> Generated:
        """One turn: replayed from the log, or generated (``tools``: offered)."""
        try:
            out = self._replay(model) or await self._turn(
                model, convo, logprobs=logprobs, priority=priority,
                max_tokens=max_tokens, on_call=self._start_early, tools=tools)
        except BaseException:
            self._keep_early("its generation failed")
            raise
        out.trace.turn = self.turns
        return out

    def _check_not_cut(self, out: Generated) -> None:
        """A turn cut off at ``max_tokens`` inside its tool-call JSON is no answer.

        Raises:
            StepFailed: naming the step, the turn and the budget (never the broken JSON
                taken for the step's output).
        """
        if out.trace.finish_reason == "length" and _TOOL_JSON.match(out.text):
            raise StepFailed(self.node.id, f"agent step {self.node.id!r}: turn {self.turns}'s "
                             "tool call was cut off at max_tokens="
                             f"{self.node.params.max_tokens} before its JSON ended; raise "
                             "the step's max_tokens")

    async def _uncut(self, model: str | None, convo: Sequence[ChatMessage], out: Generated, *,
                     logprobs: bool, priority: Priority | None, max_tokens: int | None
                     ) -> Generated:
        """A turn cut off at ``max_tokens`` after some whole calls (the rest of its calls
        lost): never run the whole ones as if they were all -- the turn runs again
        with twice the budget (up to the step's ceiling, as
        :func:`~flowlift.proxy.workflows.cascade.cut_off` raises a cut output's), its
        early starts kept for the same calls of the new turn.

        Raises:
            StepFailed: no room left under the ceiling, or the new turn cut off too,
                naming the step, the turn, the budget and the calls it held.
        """
        budget = max_tokens or self.node.params.max_tokens
        ceiling = self.node.params.ceiling()
        room = min(ceiling, 2 * budget) if budget and ceiling else None
        held = ", ".join(c.name for c in out.tool_calls or ())
        why = (f"agent step {self.node.id!r}: turn {self.turns} was cut off at "
               f"max_tokens={budget} inside its tool calls (after the whole call(s) "
               f"{held}): its calls were not run as the turn's, the rest being lost")
        out.trace.outcome, out.trace.error = "cut_off", why
        self._keep_early("it was cut off inside its calls")
        if room is None or room <= budget:  # type: ignore[operator]
            raise StepFailed(self.node.id, f"{why}: raise the step's max_tokens "
                             f"(ceiling {ceiling})")
        again = await self._turn(model, convo, logprobs=logprobs, priority=priority,
                                 max_tokens=room, on_call=self._start_early)
        again.trace.turn = self.turns
        if again.tool_calls and again.trace.finish_reason == "length":
            self._keep_early("it was cut off inside its calls")
            raise StepFailed(self.node.id, f"{why}; retried with max_tokens={room}, cut "
                             "off again: raise the step's max_tokens")
        return again

    def _replay(self, model: str | None) -> Generated | None:
        """A turn the run's log already holds (a resumed run), as a generation."""
        data = self._turns.get(self.turns)
        if data is None:
            return None
        st = self.trace.step(self.node.id)
        if st.started_ms is None:
            self.trace.mark(self.node.id, "started", status="running")
        now = self.trace.now_ms()
        at = AttemptTrace(len(st.attempts) + 1, model or st.model or "", now, now, now,
                          error="replayed from the run's log")
        st.attempts.append(at)
        calls = tuple(ToolCall(*c) for c in data["tool_calls"])
        return Generated(data.get("content") or "", at, tool_calls=calls)

    def _asks(self, calls: Sequence[ToolCall]) -> bool:
        """True when the first call goes to the app (not replayed from the log, not
        answered at once with an error, not a proxy tool: the proxy's own tools answer
        in about the time a prefill-ahead would take, which would only compete with
        the next turn's prefill): its result is worth waiting for ahead."""
        return (f"{self.node.id}:call_{self.calls + 1}" not in self._results
                and self._proxy_spec(calls[0].name) is None
                and not isinstance(check_call(calls[0], self.tools), str))

    async def _run_calls(self, calls: Sequence[ToolCall]) -> list[str]:
        """The result texts of one turn's calls, in order (valid ones run concurrently
        in the app)."""
        st = self.trace.step(self.node.id)
        st.status = "waiting_tool"
        tasks = [asyncio.ensure_future(self._call(c)) for c in calls]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            st.status = "running"
            for task in tasks:
                task.cancel()
            self._drop_early()

    def _proxy_spec(self, name: str) -> ToolSpec | None:
        spec = next((t for t in self.tools if t.name == name), None)
        return spec if spec is not None and spec.server is not None else None

    def _start_early(self, call: ToolCall) -> None:
        """A call complete in the turn's stream: start it now if it is a valid proxy call
        of a tool that may start early (:meth:`ProxyTools.starts_early`) and no
        earlier start of the same call is kept (a turn that failed or was cut off)."""
        spec, key = self._proxy_spec(call.name), call_key(call.name, call.arguments)
        if spec is None or key is None or self._proxy is None or self._kept.get(key):
            return
        if not self._proxy.starts_early(spec.server or "", spec.name):
            return
        args = check_call(call, self.tools)
        if isinstance(args, str):
            return
        task = asyncio.ensure_future(self._proxy.call(spec.server or "", spec.name, args))
        self._early.setdefault(key, []).append((task, self.trace.now_ms()))

    def _take_early(self, call: ToolCall) -> tuple[asyncio.Task[ToolOutcome], float] | None:
        key = call_key(call.name, call.arguments)
        if key is None:
            return None
        started = self._early.get(key) or self._kept.get(key)
        return started.pop(0) if started else None

    def _keep_early(self, why: str) -> None:
        """The turn ended without running its early starts (``why``): each one is
        traced (outcome ``early_unused``) and kept, running, so that the same call of
        a later turn (the retry of a cut or failed turn) takes its result instead of
        running the tool a second time."""
        for key, tasks in self._early.items():
            for task, started_ms in tasks:
                self._unused += 1  # (ids apart from call_<n>: those are the log's)
                self.trace.step(self.node.id).tool_calls.append(ToolCallTrace(
                    f"{self.node.id}:early_{self._unused}", key[0], self.turns, started_ms,
                    self.trace.now_ms(), "early_unused",
                    f"started while turn {self.turns} streamed; the turn ended without "
                    f"it ({why}); kept for a retry's same call", server=self._proxy_server(
                        key[0])))
                self._kept.setdefault(key, []).append((task, started_ms))
        self._early = {}

    def _forget_kept(self) -> None:
        """The step answered: stop the kept early starts still running."""
        for tasks in self._kept.values():
            for task, _ in tasks:
                task.cancel()
        self._kept = {}

    def _proxy_server(self, name: str) -> str | None:
        spec = self._proxy_spec(name)
        return spec.server if spec is not None else None

    def _drop_early(self) -> None:
        """Cancel early starts no final call of the turn took."""
        for tasks in self._early.values():
            for task, _ in tasks:
                task.cancel()
        self._early = {}

    async def _call(self, call: ToolCall) -> str:
        self.calls += 1
        call_id = f"{self.node.id}:call_{self.calls}"
        spec = self._proxy_spec(call.name)
        early = self._take_early(call) if spec is not None else None
        ct = ToolCallTrace(call_id, call.name, self.turns,
                           self.trace.now_ms() if early is None else early[1],
                           server=spec.server if spec is not None else None)
        self.trace.step(self.node.id).tool_calls.append(ct)
        args = check_call(call, self.tools)
        if isinstance(args, str):
            ct.finished_ms, ct.outcome, ct.error = ct.wanted_ms, "invalid", args
            return args
        logged_result = self._results.get(call_id)
        if logged_result is not None:
            if early is not None:
                early[0].cancel()
            ct.finished_ms, ct.outcome = ct.wanted_ms, "replayed"
            error = logged_result.get("error")
            return self._text(call, ct, logged_result.get("value"), error)
        try:
            if spec is not None:
                outcome = await self._run_proxy(spec, args, None if early is None else early[0])
                value, error = outcome.value, outcome.error
            else:
                try:
                    value, error = await self._ask(call_id, call.name, args), None
                except ToolRaised as exc:
                    value, error = None, exc.error
        except asyncio.CancelledError:  # a lost group, a cancelled run, a deadline
            ct.finished_ms, ct.outcome = self.trace.now_ms(), "cancelled"
            raise
        ct.finished_ms = self.trace.now_ms()
        self._emit("tool.result", {"step_id": call_id, "value": value} if error is None
                   else {"step_id": call_id, "error": error})
        ct.outcome = "ok" if error is None else "error"
        return self._text(call, ct, value, error)

    async def _run_proxy(self, spec: ToolSpec, args: dict[str, Any],
                         early: asyncio.Task[ToolOutcome] | None) -> ToolOutcome:
        """A proxy tool's outcome: its early start's, or a call started now (the
        deadline clock keeps running: the proxy's own time)."""
        if early is not None:
            return await early
        if self._proxy is None:
            return ToolOutcome(error=f"this proxy runs no tool server {spec.server!r}")
        return await self._proxy.call(spec.server or "", spec.name, args)

    def _text(self, call: ToolCall, ct: ToolCallTrace, value: Any, error: str | None) -> str:
        if error is None:
            return render_value(value)
        ct.error = error
        if self.node.tool_errors == "raise":
            raise ToolError(self.node.id, f"agent step {self.node.id!r}: tool {call.name!r} "
                            f"raised: {error}")
        return f"error: {error}"

    async def _ask(self, call_id: str, name: str, args: dict[str, Any]) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = fut
        self._emit("tool.wanted", {"step_id": call_id, "name": name, "args": [],
                                   "kwargs": args, "agent_step": self.node.id})
        paused = self._clock.paused() if self._clock else contextlib.nullcontext()
        async with paused:  # the app has the ball: the deadline clock stops
            return await fut
