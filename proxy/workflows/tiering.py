"""A run's steps on their planned service tier: batch steps through the model's batch
backend, with the watchdog that moves them to the fast tier when their slack runs out.

The tier of each step comes from the compiler's tier plan
(:class:`~flowlift.report.TierPlanReport`, made when the graph has a deadline and the
config offers tiers). :class:`TieredDispatcher` wraps the run's
:class:`~flowlift.proxy.dispatch.steps.StepDispatcher`:

* a step planned on ``batch`` (first try, no tools, a ``batch`` backend configured for
  its model) becomes one line of the model's :class:`BatchPool`, packed with the lines
  ready at the same time, run ids mixed;
* every upload, submission and outcome of the run's lines is a ``step.batch`` event of
  the run's log (persisted with it), so a restarted proxy waits for the batch already
  submitted (or adopts the batch over a file already uploaded) and never submits a
  line twice;
* the watchdog: when the step's slack (time left to the deadline minus its remaining
  critical path at fast-tier estimates) falls to the backend's ``watchdog_guard_s``,
  the line is abandoned and the step also runs on the fast tier; whichever answer comes
  first is kept; the other is still accounted (the batch line's usage is in its
  ``step.batch`` event, and a line that finishes after the fast answer won, while the
  run lasts, is billed as a ``step.cost`` event with ``"late": true``);
* when a deferred step becomes ready its tier is planned again from the slack left then
  (a batch step whose parents ran late goes to flex or standard: a ``step.tier`` event);
* a step planned on ``idle`` (an embedded backend with ``idle = true``) waits in the
  engine's idle class: it runs when nothing of a higher class waits;
* a step planned on ``flex`` asks ``service_tier: "flex"`` of a backend that offers
  it; when flex has no capacity (its 429s backed off until the route gave up) or fails
  before any output, the step moves to ``standard`` (a ``step.tier`` event);
* every answer is priced at the tier it says served it (a ``step.cost`` event: a flex
  request served at ``default`` costs standard), next to what its tokens cost on
  ``standard`` (``standard_cost``, None where the model offers no standard tier);
* a line that comes back failed (a validation error, an expired or cancelled batch, a
  malformed line) runs on the fast tier at once; contract retries (later tries) run on
  the fast tier too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.local_engine.base import GenerationChunk, GenerationRequest, Usage
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.batch.api import Advice, BatchLine, Kind, Outcome, parse_custom_id
from flowlift.proxy.dispatch.batch.flex import cost, served_tier
from flowlift.proxy.dispatch.batch.pool import BatchPool, Submission
from flowlift.proxy.dispatch.batch.tier_profiles import model_tiers
from flowlift.proxy.dispatch.slots.scheduler import CLASS_RANK, Priority
from flowlift.proxy.dispatch.steps import StepDispatcher
from flowlift.proxy.dispatch.upstream.engine import chat_body
from flowlift.report import TierPlanReport
from flowlift.tiers import SPEED_ORDER

EVENT = "step.batch"


def _nothing() -> None:
    return None


def planned_tiers(report: TierPlanReport | None) -> dict[str, str]:
    """Step id -> planned tier (empty without a plan)."""
    return {} if report is None else {s.step_id: s.tier for s in report.steps}


def batch_records(history: Iterable[tuple[int, str, dict[str, Any]]]
                  ) -> dict[str, dict[str, Any]]:
    """Step id -> the latest ``step.batch`` record of its latest line (merged over its
    ``uploaded``, ``submitted`` and ``finished`` events)."""
    out: dict[str, dict[str, Any]] = {}
    for _, name, data in history:
        if name != EVENT:
            continue
        step = str(data.get("step_id"))
        kept = out.get(step)
        if kept is None or kept.get("custom_id") != data.get("custom_id"):
            kept = out[step] = {}
        kept.update(data)
    return out


def completion_chunk(outcome: Outcome) -> GenerationChunk:
    """The one chunk of a batch line's chat completion (text, finish reason, usage)."""
    body = outcome.completion or {}
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return GenerationChunk(str(message.get("content") or ""),
                           finish_reason=str(choice.get("finish_reason") or "stop"),
                           usage=Usage(int(usage.get("prompt_tokens") or 0),
                                       int(usage.get("completion_tokens") or 0),
                                       int(details.get("cached_tokens") or 0)))


class TieredDispatcher(StepDispatcher):
    """A run's dispatcher with its batch steps on the batch tier (module docstring).

    Args:
        backends: the proxy's backends (their ``batch_pool`` per model).
        run_id: the run.
        tiers: step id -> planned tier.
        slack_s: step id -> seconds of slack left now (None: no deadline).
        emit: appends an event to the run's log.
        history: the run's events so far (restored ones included).

    The watchdog's guard is the batch backend's ``watchdog_guard_s``.
    """

    def __init__(self, backends: Backends, *, run_id: str, tiers: Mapping[str, str],
                 slack_s: Callable[[str], float | None],
                 emit: Callable[[str, dict[str, Any]], int],
                 history: Iterable[tuple[int, str, dict[str, Any]]] = ()) -> None:
        super().__init__(backends)
        self.tiers, self.slack_s = dict(tiers), slack_s
        self.records = batch_records(history)
        self.moved: set[str] = set()
        self.fast_won: set[str] = set()  # steps whose fast answer beat their batch line
        self._emit = emit
        self.run_id = run_id
        backends.batch_journal.register(run_id, self._record)

    def close(self) -> None:
        """The run is over: stop recording its lines."""
        self.backends.batch_journal.unregister(self.run_id)

    def _record(self, event: str, data: dict[str, Any]) -> None:
        record = {"state": event, **data}
        kept = self.records.get(data["step_id"])
        if kept is None or kept.get("custom_id") != data["custom_id"]:
            kept = self.records[data["step_id"]] = {}
        kept.update(record)
        self._emit(EVENT, record)
        usage = data.get("usage")
        if event == "finished" and data.get("kind") == "ok" and \
                data["step_id"] in self.fast_won and isinstance(usage, Mapping):
            self._bill_late_line(data["step_id"], str(kept.get("model") or ""), usage)

    def _bill_late_line(self, step_id: str, model: str, usage: Mapping[str, Any]) -> None:
        """A ``step.cost`` for a batch line that finished after the watchdog's fast answer
        was kept: the provider bills it all the same (``"late": true``)."""
        offered = {t.tier: t for t in model_tiers(
            self.backends.config, self.backends.canonical(model), self.backends.turnarounds)}
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        price = cost(prompt, completion, "batch", offered)
        standard = cost(prompt, completion, "standard", offered)
        self._emit("step.cost", {"step_id": step_id, "asked": "batch", "served": "batch",
                                 "prompt_tokens": prompt, "completion_tokens": completion,
                                 "cost": None if price is None else round(price, 8),
                                 "standard_cost": None if standard is None
                                 else round(standard, 8), "late": True})

    def tier_of(self, step_id: str, attempt: int) -> str | None:
        """The tier to ask for try ``attempt`` of ``step_id`` (retries: the fast tier)."""
        tier = self.tiers.get(step_id)
        return tier if attempt == 1 or tier != "batch" else None

    async def generate(self, request: GenerationRequest, *, priority: Priority,
                       prefill_tokens: int = 0, started: Callable[[], None] = _nothing,
                       ) -> AsyncGenerator[GenerationChunk, None]:
        pool = self.backends.batch_pool(self.backends.canonical(request.model))
        if request.service_tier in ("batch", "flex", "idle"):
            request = self._replan(request)
        asked: str | None = None
        if request.service_tier == "idle":  # the local engine's idle class
            asked = "idle"
            priority = dataclasses.replace(priority, class_rank=CLASS_RANK["idle"])
            request = dataclasses.replace(request, service_tier=None)
        if request.service_tier == "batch" and pool is not None and not request.tools:
            started()
            for chunk in await self._deferred(pool, request, priority, prefill_tokens):
                yield chunk
            return
        async with contextlib.aclosing(self._sync(request, priority, prefill_tokens,
                                                  started)) as chunks:
            async for chunk in chunks:
                self._account(request, chunk, asked)
                yield chunk

    async def _sync(self, request: GenerationRequest, priority: Priority,
                    prefill_tokens: int, started: Callable[[], None],
                    ) -> AsyncGenerator[GenerationChunk, None]:
        if request.service_tier == "batch":  # no batch backend for this model
            request = dataclasses.replace(request, service_tier=None)
        produced = False
        try:
            async with contextlib.aclosing(StepDispatcher.generate(self,
                    request, priority=priority, prefill_tokens=prefill_tokens,
                    started=started)) as chunks:
                async for chunk in chunks:
                    produced = True
                    yield chunk
        except FlowliftError as exc:
            if request.service_tier != "flex" or produced:
                raise
            # flex had no capacity (429s backed off until the route gave up) or failed:
            # the step moves to standard
            step_id = parse_custom_id(request.request_id)[1]
            self.moved.add(step_id)
            self._emit("step.tier", {"step_id": step_id, "from": "flex", "to": "standard",
                                     "why": exc.message})
            async with contextlib.aclosing(StepDispatcher.generate(
                    self, dataclasses.replace(request, service_tier=None),
                    priority=priority, prefill_tokens=prefill_tokens,
                    started=started)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _deferred(self, pool: BatchPool, request: GenerationRequest,
                        priority: Priority, prefill_tokens: int) -> list[GenerationChunk]:
        step_id = parse_custom_id(request.request_id)[1]
        line = asyncio.ensure_future(self._line(pool, request, step_id))
        watchdog = asyncio.ensure_future(self._watch(
            step_id, pool.client.spec.watchdog_guard_s))
        try:
            await asyncio.wait({line, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if line.done() and not line.exception() and \
                    line.result().advice is Advice.ACCEPT:
                return self._accepted(request, line.result())
            if not line.done():  # the watchdog: the fast tier too, the first answer wins
                self.moved.add(step_id)
                await pool.abandon(self._custom_id(step_id, request))
            fast = asyncio.ensure_future(self._fast(request, priority, prefill_tokens))
            racers = {fast} if line.done() else {fast, line}
            while True:
                done, _ = await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
                if fast in done:
                    for chunk in fast.result():
                        self._account(request, chunk, "standard")
                    if not line.done():  # its batch may still finish it: billed then
                        self.fast_won.add(step_id)
                    return fast.result()
                if not line.exception() and line.result().advice is Advice.ACCEPT:
                    fast.cancel()
                    return self._accepted(request, line.result())
                racers = {fast}
        finally:
            watchdog.cancel()
            if not line.done():
                line.cancel()

    def _account(self, request: GenerationRequest, chunk: GenerationChunk,
                 asked: str | None = None) -> None:
        """A ``step.cost`` event for an answer's last chunk: its tokens priced at the tier
        the answer says served it (``served_tier``), else the tier asked."""
        if chunk.finish_reason is None or chunk.usage is None:
            return
        step_id = parse_custom_id(request.request_id)[1]
        offered = {t.tier: t for t in model_tiers(
            self.backends.config, self.backends.canonical(request.model),
            self.backends.turnarounds)}
        if asked is None:  # a flex step moved to standard asked standard in the end
            asked = "standard" if step_id in self.moved else request.service_tier
        # nothing asked: the route's fast tier (standard, or local for the engine)
        asked = asked or min(offered, key=SPEED_ORDER.index, default="standard")
        served = served_tier({"service_tier": chunk.service_tier}, asked)
        price = cost(chunk.usage.prompt_tokens, chunk.usage.completion_tokens, served,
                     offered)
        standard = cost(chunk.usage.prompt_tokens, chunk.usage.completion_tokens,
                        "standard", offered)
        self._emit("step.cost", {"step_id": step_id,
                                 "asked": asked, "served": served,
                                 "prompt_tokens": chunk.usage.prompt_tokens,
                                 "completion_tokens": chunk.usage.completion_tokens,
                                 "cost": None if price is None else round(price, 8),
                                 "standard_cost": None if standard is None
                                 else round(standard, 8)})

    def _replan(self, request: GenerationRequest) -> GenerationRequest:
        """The step's tier again now that it is ready (its parents done): a deferred
        tier only while the slack left still holds its p90 turnaround and margin (a
        ``step.tier`` event when it changes). A line already submitted (or answered
        before a restart) stays."""
        step_id = parse_custom_id(request.request_id)[1]
        slack = self.slack_s(step_id)
        record = self.records.get(step_id)
        if slack is None or (record is not None and (record.get("state") != "finished"
                                                     or record.get("kind") == "ok")):
            return request  # a line of it is out there (or back): read it, not again
        offered = {t.tier: t for t in model_tiers(
            self.backends.config, self.backends.canonical(request.model),
            self.backends.turnarounds)}
        tier: str | None = None
        order = ("idle",) if request.service_tier == "idle" else ("batch", "flex")
        for name in order[order.index(str(request.service_tier)):]:
            profile = offered.get(name)
            if profile is not None and slack >= profile.turnaround_p90_s + profile.margin_s:
                tier = name
                break
        if tier == request.service_tier:
            return request
        self._emit("step.tier", {"step_id": step_id, "from": request.service_tier,
                                 "to": tier or "standard",
                                 "why": f"{slack:.0f} s of slack left when the step was ready"})
        return dataclasses.replace(request, service_tier=tier)

    def _accepted(self, request: GenerationRequest, outcome: Outcome
                  ) -> list[GenerationChunk]:
        chunk = completion_chunk(outcome)
        self._account(request, chunk, "batch")
        return [chunk]

    def _custom_id(self, step_id: str, request: GenerationRequest) -> str:
        record = self.records.get(step_id)
        return str(record["custom_id"]) if record else request.request_id

    async def _line(self, pool: BatchPool, request: GenerationRequest,
                    step_id: str) -> Outcome:
        record = self.records.get(step_id)
        if record is not None:
            cid = str(record["custom_id"])
            if pool.waiting(cid):
                return await pool.wait_line(cid)
            if record.get("state") == "finished" and record.get("kind") != "ok":
                return Outcome(cid, Kind(str(record.get("kind"))),
                               message="the line failed before the restart")
            if record.get("batch_id"):  # submitted before a restart (finished or not):
                # read it again, never resubmit
                pool.resume(Submission(str(record["batch_id"]), str(record["file_id"]),
                                       str(record["model"]), (cid,)))
                return await pool.wait_line(cid)
            adopted = await pool.adopt(str(record["file_id"]), str(record["model"]), (cid,))
            if adopted is not None:
                return await pool.wait_line(cid)
        body = chat_body(request, self.backends.canonical(request.model))
        body.pop("stream", None)
        body.pop("stream_options", None)
        return await pool.outcome(BatchLine(request.request_id, body))

    async def _watch(self, step_id: str, guard_s: float) -> None:
        while True:
            slack = self.slack_s(step_id)
            if slack is None:
                await asyncio.Event().wait()  # no deadline: nothing to watch
            elif slack <= guard_s:
                return
            else:
                await asyncio.sleep(min(slack - guard_s, 60.0))

    async def _fast(self, request: GenerationRequest, priority: Priority,
                    prefill_tokens: int) -> list[GenerationChunk]:
        fast = dataclasses.replace(request, request_id=request.request_id + ".fast",
                                   service_tier=None)
        out: list[GenerationChunk] = []
        async with contextlib.aclosing(StepDispatcher.generate(
                self, fast, priority=priority, prefill_tokens=prefill_tokens)) as chunks:
            async for chunk in chunks:
                out.append(chunk)
        return out


__all__ = ["EVENT", "TieredDispatcher", "batch_records", "completion_chunk",
           "planned_tiers"]
