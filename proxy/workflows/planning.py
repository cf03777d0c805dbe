"""Compiling graphs inside the proxy: the compiler fed with this proxy's tokenizers,
measured cost models, backend capabilities, learned failure rates, learned output lengths
and agent turns per (step, model), prices, and each engine's KV block size and slots
(where a model runs: models on one engine share it in the planned schedule)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from flowlift.compiler import (
    DEFAULT_KV_BLOCK,
    CompileOptions,
    Plan,
    approximate_tokenize,
    compile_graph,
    no_lengths,
    no_outcomes,
    no_turns,
)
from flowlift.costs import CostModel, CostTracker
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backend, Backends
from flowlift.proxy.dispatch.batch.tier_profiles import model_tiers
from flowlift.proxy.store.outcomes import StepOutcomes


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
        return costs.model(backends.canonical(model))

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

    return {"kv_block": kv_block, "engine": engine, "capacity": capacity,
            "prefill_budget": prefill_budget, "host": host}


def plan(graph: Graph, backends: Backends, costs: CostTracker,
         outcomes: StepOutcomes | None = None,
         prices: Mapping[str, float] | None = None) -> Plan:
    """Compile ``graph`` for this proxy (pure; run it off the event loop for big graphs):
    measured cost models, learned failure rates per (step, model), configured prices."""
    return compile_graph(graph, compile_options(backends, costs, outcomes, prices))
