"""Prometheus metrics of one proxy (``GET /metrics``), in a registry of its own.

Every proxy app gets its own :class:`Metrics` (a ``CollectorRegistry`` per instance, no
module-level collectors), so two apps in one process never share counts. Counters and
histograms are kept in plain Python structures while requests and runs are counted, and
become prometheus_client metric families only when ``/metrics`` is read
(:mod:`flowlift.tracing.tallies`: the same text as prometheus_client's own ``Counter``
and ``Histogram`` would show).

Recorded when a workflow run ends (from its :class:`RunTrace`, off the request path)
and when an OpenAI API request ends:

==============================================  =========================================
``gen_ai_server_time_to_first_token_seconds``   histogram: engine dispatch to first token
                                                (``model``, ``source`` workflow|openai)
``gen_ai_server_time_per_output_token_seconds`` histogram: decode time / (tokens - 1)
``flowlift_queue_wait_seconds``                 histogram: ready to dispatched (``model``)
``flowlift_prompt_tokens_total``                counter (``model``)
``flowlift_cached_prompt_tokens_total``         counter: prompt tokens from the prefix cache
``flowlift_prefix_cache_hit_ratio``             gauge: cached / prompt tokens (``model``)
``flowlift_step_retries_total``                 counter: attempts after the first on the same model
                                                (``model``, ``reason``: the failed try's
                                                outcome)
``flowlift_cascade_escalations_total``          counter (``from_model``, ``to_model``)
``flowlift_deadline_misses_total``              counter (``workflow_class``)
``flowlift_workflows_total``                    counter: finished runs (``status``)
``flowlift_openai_requests_total``              counter (``operation``, ``outcome``)
``flowlift_proxy_overhead_seconds``             histogram: an OpenAI request's handling time
                                                minus its wait on upstreams or engines
                                                (``operation``, ``stream`` true|false;
                                                :mod:`flowlift.proxy.telemetry.requests`)
==============================================  =========================================

Read at scrape time (callbacks, nothing on the hot path): ``flowlift_queue_depth``
(``backend``, ``class``), ``flowlift_active_workflows``, ``flowlift_upstream_in_flight``
(``backend``), and with a memory budget (``--memory-budget-mb``) the counters
``flowlift_model_loads_total`` and ``flowlift_model_unloads_total`` (``model``: how
often the residency manager loaded and unloaded each embedded model, boot included).

Retries and cascade escalations are read off each step's ``AttemptTrace`` records
(:meth:`Metrics.record_attempts`): an attempt after the first on the same model is a
retry; an attempt on another model than the one before it is an escalation (not both).
Code that escalates without recording an attempt calls :meth:`Metrics.cascade_escalated`
itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from flowlift.tracing.recorder import AttemptTrace, RunTrace, StepTrace
from flowlift.tracing.tallies import Tallies

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.01,
                     0.025, 0.05, 0.1, 0.25, 1.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
QueueDepth = Callable[[], Iterable[tuple[str, str, int]]]
ModelLoads = Callable[[], Iterable[tuple[str, int, int]]]
Programs = Callable[[], Iterable[tuple[str, int, int, int, int]]]
"""``() -> [(backend, programs tracked, programs kept, aged grants, held back)]``."""


class _Live(Collector):
    """Gauges computed at scrape time from callbacks and running totals."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        m = self.metrics
        ratio = GaugeMetricFamily("flowlift_prefix_cache_hit_ratio",
                                  "Prompt tokens served from the prefix cache / prompt tokens",
                                  labels=["model"])
        for model, prompt in m.prompt_totals.items():
            if prompt:
                ratio.add_metric([model], m.cached_totals.get(model, 0) / prompt)
        yield ratio
        depth = GaugeMetricFamily("flowlift_queue_depth",
                                  "Requests waiting for an engine slot",
                                  labels=["backend", "class"])
        for backend, cls, n in m.queue_depth():
            depth.add_metric([backend, cls], n)
        yield depth
        active = GaugeMetricFamily("flowlift_active_workflows", "Workflow runs not finished")
        active.add_metric([], m.active_workflows())
        yield active
        flight = GaugeMetricFamily("flowlift_upstream_in_flight",
                                   "Requests open on an upstream backend", labels=["backend"])
        for backend, n in m.upstream_in_flight():
            flight.add_metric([backend], n)
        yield flight
        loads = CounterMetricFamily("flowlift_model_loads", "Times the residency manager "
                                    "loaded an embedded model", labels=["model"])
        unloads = CounterMetricFamily("flowlift_model_unloads", "Times the residency manager "
                                      "unloaded an embedded model", labels=["model"])
        for model, n_loads, n_unloads in m.model_loads():
            loads.add_metric([model], n_loads)
            unloads.add_metric([model], n_unloads)
        yield loads
        yield unloads
        preempted = CounterMetricFamily(
            "flowlift_preemptions", "Running batch requests preempted for interactive work",
            labels=["backend"])
        for backend, n in m.preemptions():
            preempted.add_metric([backend], n)
        yield preempted
        yield from _program_families(m.programs())


def _program_families(rows: Iterable[tuple[str, int, int, int, int]]
                      ) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
    """Program-level scheduling's table (``flowlift.proxy.dispatch.slots.programs``)."""
    tracked = GaugeMetricFamily("flowlift_programs", "Agent sessions (programs) whose "
                                "attained service is tracked", labels=["backend"])
    kept = GaugeMetricFamily("flowlift_programs_kept", "Programs whose tool is out and "
                             "whose KV is kept for the next turn", labels=["backend"])
    aged = CounterMetricFamily("flowlift_program_aged_grants", "Requests granted ahead of "
                               "least-attained-service order after the wait bound",
                               labels=["backend"])
    held = CounterMetricFamily("flowlift_program_held_back", "New programs' requests held "
                               "back to keep a waiting session's KV", labels=["backend"])
    for backend, n, k, a, h in rows:
        tracked.add_metric([backend], n)
        kept.add_metric([backend], k)
        aged.add_metric([backend], a)
        held.add_metric([backend], h)
    return (tracked, kept, aged, held)


class Metrics:
    """The proxy's metrics.

    Args:
        queue_depth: ``() -> [(backend, class, waiting)]`` (read at scrape time).
        active_workflows: ``() -> int``.
        upstream_in_flight: ``() -> [(backend, open requests)]``.
        preemptions: ``() -> [(backend, requests preempted so far)]``.
        price_per_1k: served model name -> its price per 1,000 tokens (config
            ``price_per_1k_tokens``), or None when it has none (no spend counted).
        model_loads: ``() -> [(model, loads, unloads)]`` of the residency manager
            (read at scrape time; empty without a memory budget).
        programs: program scheduling per backend (:data:`Programs`).
    """

    def __init__(self, *, queue_depth: QueueDepth = lambda: (),
                 active_workflows: Callable[[], int] = lambda: 0,
                 upstream_in_flight: Callable[[], Iterable[tuple[str, int]]] = lambda: (),
                 preemptions: Callable[[], Iterable[tuple[str, int]]] = lambda: (),
                 price_per_1k: Callable[[str], float | None] = lambda model: None,
                 model_loads: ModelLoads = lambda: (),
                 programs: Programs = lambda: ()) -> None:
        self.registry = CollectorRegistry()
        t = self.tallies = Tallies()  # (plain Python on the request path; see tallies)
        self.queue_depth, self.active_workflows = queue_depth, active_workflows
        self.upstream_in_flight, self.preemptions = upstream_in_flight, preemptions
        self.model_loads, self.programs = model_loads, programs
        self.ttft = t.histogram("gen_ai_server_time_to_first_token_seconds",
                                "Engine dispatch to first token", ["model", "source"],
                                buckets=_LATENCY_BUCKETS)
        self.tpot = t.histogram("gen_ai_server_time_per_output_token_seconds",
                                "Decode time per output token after the first",
                                ["model", "source"], buckets=_TPOT_BUCKETS)
        self.queue_wait = t.histogram("flowlift_queue_wait_seconds",
                                      "Workflow step ready to dispatched", ["model"],
                                      buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = t.counter("flowlift_prompt_tokens", "Prompt tokens", ["model"])
        self.completion_tokens = t.counter("flowlift_completion_tokens", "Completion tokens",
                                           ["model"])
        self.price_per_1k = price_per_1k
        self.spend_total = t.counter(
            "flowlift_spend", "Spend in the config's price unit: (prompt + completion "
            "tokens) / 1000 x the served model's price_per_1k_tokens", ["model"])
        self.estimated_usage = t.counter(
            "flowlift_estimated_usage_requests",
            "OpenAI requests whose usage was estimated (the upstream was cut, or the client "
            "left, before it reported one)", ["model"])
        self.cached_tokens = t.counter("flowlift_cached_prompt_tokens",
                                       "Prompt tokens served from the prefix cache", ["model"])
        self.retries = t.counter("flowlift_step_retries", "Attempts of a step after its first",
                                 ["model", "reason"])
        self.escalations = t.counter("flowlift_cascade_escalations",
                                     "Steps escalated to the next model of their cascade",
                                     ["from_model", "to_model"])
        self.deadline_misses = t.counter("flowlift_deadline_misses",
                                         "Workflow runs that ran out of their deadline",
                                         ["workflow_class"])
        self.workflows = t.counter("flowlift_workflows", "Finished workflow runs", ["status"])
        self.tenant_tokens = t.counter(
            "flowlift_tenant_tokens", "Prompt and completion tokens of a configured tenant's "
            "requests and runs", ["tenant", "kind"])
        self.tenant_spend = t.counter(
            "flowlift_tenant_spend", "A configured tenant's spend, as flowlift_spend",
            ["tenant"])
        self.requests = t.counter("flowlift_openai_requests", "OpenAI API requests",
                                  ["operation", "outcome"])
        self.overhead = t.histogram(
            "flowlift_proxy_overhead_seconds", "An OpenAI request's time in the proxy itself: "
            "its handling time minus its wait on upstreams or engines",
            ["operation", "stream"], buckets=_OVERHEAD_BUCKETS)
        self.prompt_totals: dict[str, int] = {}
        self.cached_totals: dict[str, int] = {}
        self.registry.register(t)
        self.registry.register(_Live(self))

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    # -- recording --------------------------------------------------------------------
    def tokens(self, model: str, prompt: int, cached: int) -> None:
        if prompt <= 0:
            return
        self.prompt_tokens.inc((model,), prompt)
        self.cached_tokens.inc((model,), max(cached, 0))
        self.prompt_totals[model] = self.prompt_totals.get(model, 0) + prompt
        self.cached_totals[model] = self.cached_totals.get(model, 0) + max(cached, 0)

    def latency(self, model: str, source: str, ttft_s: float | None, decode_s: float | None,
                completion_tokens: int) -> None:
        if ttft_s is not None:
            self.ttft.observe((model, source), max(ttft_s, 0.0))
        if decode_s is not None and completion_tokens > 1:
            self.tpot.observe((model, source), max(decode_s, 0.0) / (completion_tokens - 1))

    def spend(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Count one request's (or step attempt's) spend on the served ``model``, when
        the config prices it."""
        price = self.price_per_1k(model)
        tokens = max(prompt_tokens, 0) + max(completion_tokens, 0)
        if price and tokens:
            self.spend_total.inc((model,), tokens / 1000 * price)

    def tenant_usage(self, tenant: str | None, model: str, prompt_tokens: int,
                     completion_tokens: int) -> None:
        """Count tokens and spend of one request or step attempt of ``tenant`` (a
        configured tenant's name: the label is bounded by the config; None, the
        anonymous tenant: nothing counted)."""
        if tenant is None:
            return
        prompt, completion = max(prompt_tokens, 0), max(completion_tokens, 0)
        self.tenant_tokens.inc((tenant, "prompt"), prompt)
        self.tenant_tokens.inc((tenant, "completion"), completion)
        price = self.price_per_1k(model)
        self.tenant_spend.inc((tenant,), (prompt + completion) / 1000 * (price or 0.0))

    def cascade_escalated(self, from_model: str, to_model: str) -> None:
        """Count one escalation of a step from ``from_model`` to the next model of its
        cascade (for escalations not recorded as an ``AttemptTrace``)."""
        self.escalations.inc((from_model, to_model))

    def record_attempts(self, attempts: Sequence[AttemptTrace]) -> None:
        """Retries and escalations of one step, from its attempts in order."""
        for before, after in itertools.pairwise(attempts):
            if before.outcome == "tool_calls":  # an agent step's next turn: no retry
                continue
            if after.model != before.model:  # the next model of the cascade: not a retry
                self.cascade_escalated(before.model, after.model)
            else:
                self.retries.inc((after.model, before.outcome))

    def observe_run(self, trace: RunTrace, *, deadline_missed: bool = False,
                    tenant: str | None = None) -> None:
        """Everything a finished run adds (its steps' latencies, tokens, attempts; the
        tokens and spend of ``tenant`` too, when the run is a configured tenant's)."""
        self.workflows.inc((trace.status,))
        if deadline_missed:
            self.deadline_misses.inc((trace.workflow_class,))
        for st in trace.steps.values():
            if st.kind == "llm" and st.model and st.same_as is None:
                self._observe_step(st, tenant)

    def _observe_step(self, st: StepTrace, tenant: str | None = None) -> None:
        model = st.model or ""
        if st.ready_ms is not None and st.started_ms is not None:
            self.queue_wait.observe((model,), max(st.started_ms - st.ready_ms, 0.0) / 1000)
        self.record_attempts(st.attempts)
        for at in st.attempts:
            self.tokens(at.model, at.prompt_tokens, at.cached_tokens)
            if at.completion_tokens > 0:
                self.completion_tokens.inc((at.model,), at.completion_tokens)
            self.spend(at.model, at.prompt_tokens, at.completion_tokens)
            self.tenant_usage(tenant, at.model, at.prompt_tokens, at.completion_tokens)
            if at.first_token_ms is None:
                continue
            end = at.finished_ms if at is not st.attempts[-1] else st.generated_ms
            self.latency(at.model, "workflow", (at.first_token_ms - at.started_ms) / 1000,
                         None if end is None else (end - at.first_token_ms) / 1000,
                         at.completion_tokens)

    def observe_request(self, operation: str, outcome: str, model: str | None,
                        ttft_s: float | None, decode_s: float | None,
                        usage: tuple[Any, Any, Any], partial: bool = False, *,
                        overhead_s: float | None = None, stream: bool = False) -> None:
        """One OpenAI API request that ended (``usage``: prompt, completion, cached
        tokens; ``partial``: they are an estimate; ``overhead_s``: the proxy's own
        seconds, None when not measured), counted once."""
        self.requests.inc((operation, outcome))
        if overhead_s is not None:
            self.overhead.observe((operation, "true" if stream else "false"), overhead_s)
        if model is None:
            return
        prompt, completion, cached = usage
        if prompt:
            self.tokens(model, int(prompt), int(cached or 0))
        if completion:
            self.completion_tokens.inc((model,), int(completion))
        if partial:
            self.estimated_usage.inc((model,))
        self.latency(model, "openai", ttft_s, decode_s, int(completion or 0))
