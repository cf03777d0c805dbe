"""Compiling graphs inside the proxy: the compiler fed with this proxy's tokenizers,
cost models, backend capabilities, learned failure rates, learned output lengths and
agent turns per (step, model), prices, each engine's KV block size and slots (where a
model runs: models on one engine share it in the planned schedule) and what its prefix
cache holds from earlier requests.

The cost model of a model embedded on this machine is the default figures sized to its
parameter count (:func:`flowlift.costs.sized_default`) times the machine's factor,
learned from how long finished steps took against their plans (:func:`calibrate`); an
upstream's is measured per request (:class:`flowlift.costs.CostTracker`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from flowlift.calibration import Ran, machine_factor, replayed_ms
from flowlift.compiler import (
    DEFAULT_KV_BLOCK,
    CompileOptions,
    Plan,
    approximate_tokenize,
    compile_graph,
    engine_models,
    no_lengths,
    no_outcomes,
    no_turns,
    prompt_text,
)
from flowlift.costs import LOCAL, CostModel, CostTracker, sized_default
from flowlift.graph import Graph
from flowlift.local_engine.base import ChatMessage
from flowlift.prefix_cache import PrefixIndex
from flowlift.proxy.dispatch.backends import Backend, Backends
from flowlift.proxy.dispatch.batch.tier_profiles import model_tiers
from flowlift.proxy.store.outcomes import StepOutcomes
from flowlift.tracing import StepTrace


def compile_options(backends: Backends, costs: CostTracker,
                    outcomes: StepOutcomes | None = None,
                    prices: Mapping[str, float] | None = None) -> CompileOptions:
    def tokenize(model: str, text: str) -> Sequence[int]:
        name = backends.canonical(model)
        if name in backends.models:
            ids = backends.resolve(name)[1].engine.tokenize(name, text)
            if ids is not None:
                return ids
        return approximate_tokenize(model, text)

    def cost(model: str) -> CostModel:
        name = backends.canonical(model)
        b = _local(backends, name)
        if b is None:  # an upstream: measured per request
            return costs.model(name)
        return costs.calibrated(LOCAL, sized_default(b.engine.parameters(name),
                                                     costs.default))

    def enforces(model: str) -> bool:
        name = backends.canonical(model)
        return name not in backends.models or \
            backends.resolve(name)[1].engine.capabilities.structured_outputs

    priced = dict(prices or {})
    # no engine served yet: "" is what Backends.canonical makes of a missing name too
    return CompileOptions(default_model=backends.default_model or "", tokenize=tokenize,
                          costs=cost, enforces=enforces,
                          max_concurrency=sum(b.max_concurrency for b in backends.backends),
                          outcomes=outcomes.counts if outcomes is not None else no_outcomes,
                          price=priced.get,
                          output_lengths=(outcomes.lengths if outcomes is not None
                                          else no_lengths),
                          tiers=lambda model: model_tiers(backends.config,
                                                          backends.canonical(model),
                                                          backends.turnarounds),
                          agent_turns=(outcomes.turns if outcomes is not None
                                       else no_turns),
                          **_engines(backends))


def _engines(backends: Backends) -> dict[str, Any]:
    """What the planned schedule needs of this proxy's engines: where each model runs
    (``engine``), its KV block (``kv_block``), its slots (``capacity``), a batch run's
    prefill budget (``prefill_budget``) and the machine it runs on (``host``), as
    :class:`CompileOptions` takes them."""
    by_name = {b.name: b for b in backends.backends}
    total = max(sum(b.max_concurrency for b in backends.backends), 1)

    def backend(model: str) -> Backend | None:
        name = backends.canonical(model)
        return backends.resolve(name)[1] if name in backends.models else None

    def kv_block(model: str) -> int:
        """The engine's own block (vLLM's CPU build: 128), else the GPU default."""
        b = backend(model)
        size = b.engine.kv_block_tokens() if b is not None else None
        return size if size else DEFAULT_KV_BLOCK

    def engine(model: str) -> str:
        b = backend(model)
        return b.name if b is not None else f"model:{backends.canonical(model)}"

    def capacity(name: str, workflow_class: str) -> int:
        """Its slots (a batch run's: less the one kept for interactive work)."""
        b = by_name.get(name)
        if b is None:
            return total
        return b.max_concurrency - (b.slots.reserved if workflow_class == "batch" else 0)

    def prefill_budget(name: str, workflow_class: str) -> float:
        """A batch run's prompt tokens in prefill at once (``--batch-prefill-budget``)."""
        b = by_name.get(name)
        if b is None or workflow_class != "batch" or b.slots.fcfs:
            return math.inf
        return float(b.slots.prefill_budget)

    local = {b.name for b in backends.backends if b.engine in backends.engines}

    def host(name: str) -> str | None:
        """The embedded engines share this machine; an upstream is a machine of its own."""
        return "local" if name in local else None

    def cached_prefix(model: str, ids: Sequence[int]) -> int:
        b = backend(model)
        return b.prefixes.cached(ids) if b is not None and b.prefixes is not None else 0

    return {"kv_block": kv_block, "engine": engine, "capacity": capacity,
            "prefill_budget": prefill_budget, "host": host, "cached_prefix": cached_prefix}


def _local(backends: Backends, name: str) -> Backend | None:
    """The backend of served model ``name`` when its engine is embedded here."""
    if name not in backends.models:
        return None
    b = backends.resolve(name)[1]
    return b if b.engine in backends.engines else None


def sent(backends: Backends, model: str, messages: Sequence[ChatMessage]) -> None:
    """``messages`` went to ``model``'s embedded engine: their blocks are now in its
    prefix cache (:class:`PrefixIndex`, in the tokens the compiler counts, so the next
    plans know; an upstream's cache is not ours to know)."""
    name = backends.canonical(model)
    b = _local(backends, name)
    if b is None:
        return
    ids = b.engine.tokenize(name, prompt_text([(m.role, m.content) for m in messages]))
    if ids is None:
        return
    block = b.engine.kv_block_tokens() or DEFAULT_KV_BLOCK
    if b.prefixes is None or b.prefixes.block != block:
        b.prefixes = PrefixIndex(block, b.engine.kv_capacity_tokens())
    b.prefixes.add(ids)


COMPILE_AT_CLOSE = 2000
"""Steps up to which a run whose report was never compiled has it compiled when it
closes, to calibrate the machine's figures with it (bigger graphs: only from a report
already made)."""


def calibrate(backends: Backends, costs: CostTracker, plan: Plan | None,
              steps: Mapping[str, StepTrace], kind: str) -> float | None:
    """A run finished: what it did, replayed on the plan's schedule model with the
    figures the plan used (:func:`flowlift.calibration.replayed_ms`), against how long it
    took, gives a sample of this machine's factor (:meth:`CostTracker.calibrate`). Only
    a run whose model calls all ran on engines embedded here, that finished every step
    (``steps``: its trace's, by id); ``kind``: its workflow class. Returns the sample, or
    None when the run gives none."""
    report = None if plan is None else (
        plan.report if len(plan.cost_ms) <= COMPILE_AT_CLOSE else plan.latest_report())
    if report is None or not report.nodes or len(report.nodes) != len(steps):
        return None  # (an open run's steps beyond its report)
    ran: list[Ran] = []
    for row in report.nodes:
        st = steps.get(row.step_id)
        if st is None or st.finished_ms is None:
            return None  # an open run's plan, or a step that never ended
        deps = frozenset(row.deps) | ({row.same_as} if row.same_as else set())
        calls = tuple((a.model, max(a.prompt_tokens - a.cached_tokens, 0),
                       a.completion_tokens) for a in st.attempts)
        if any(_local(backends, backends.canonical(m)) is None for m, _, _ in calls):
            return None  # an upstream's time is its own, not this machine's
        tool = st.finished_ms - (st.ready_ms or 0.0) if row.kind == "tool" else 0.0
        ran.append(Ran(row.step_id, deps, calls, tool))
    opts = compile_options(backends, costs)
    figures = {**{m: opts.costs(m) for r in ran for m, _, _ in r.calls},
               **report.cost_models}
    engines = engine_models((m for r in ran for m, _, _ in r.calls), dataclasses.replace(
        opts, costs=figures.__getitem__), kind)
    used = {cm.calibration for cm in report.cost_models.values()}
    factor = machine_factor(
        max(st.finished_ms or 0.0 for st in steps.values()),
        replayed_ms(ran, figures.__getitem__, opts.engine, engines,
                    {row.step_id: row.remaining_ms for row in report.nodes}),
        used.pop() if len(used) == 1 else 1.0)
    if factor is not None:
        costs.calibrate(LOCAL, factor)
    return factor


def plan(graph: Graph, backends: Backends, costs: CostTracker,
         outcomes: StepOutcomes | None = None,
         prices: Mapping[str, float] | None = None) -> Plan:
    """Compile ``graph`` for this proxy (pure; run it off the event loop for big graphs):
    measured cost models, learned failure rates per (step, model), configured prices."""
    return compile_graph(graph, compile_options(backends, costs, outcomes, prices))
