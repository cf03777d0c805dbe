"""The workflow compiler: a plan and a report from a graph, pure code with no I/O.

What it finds (sources: Parrot, OSDI'24 -- dataflow over Semantic Variables and shared
prompt prefixes; Halo, 2025 -- a batch of workflows as one consolidated query-plan DAG;
Autellix, 2025 -- program-level priority by critical path):

* dependencies from dataflow and parallel levels;
* identical calls (same model, same resolved prompt, same params, deterministic
  sampling; or the same ``pure`` tool with the same arguments), so each is paid once --
  across the documents of one consolidated graph too (Halo);
* shared prompt prefixes across nodes, in tokens of the model's tokenizer;
* per-node cost under a per-model :class:`~flowlift.costs.CostModel`, the critical
  path, and each node's remaining critical-path length (the scheduler's priority);
* model switches and a residency plan (which model must stay loaded until when);
* deadline feasibility and where the chain is forced to break (client-run steps,
  contracts a backend cannot enforce natively);
* warnings: contracts whose valid outputs cannot fit the step's ``max_tokens``
  (:mod:`flowlift.output_size`).

Injection points keep it pure: ``tokenize(model, text) -> token ids``,
``costs(model) -> CostModel``, ``enforces(model) -> bool``,
``output_lengths(step name, model) -> OutputLengths | None``.

Output lengths, best source first: a choice contract's longest label; the median length
the step produced on that model in finished runs (``output_lengths``, learned by the
proxy); the largest output a JSON-schema contract allows, when the schema bounds it
(``maxLength``, ``enum``, ``maxItems``...); else ``max_tokens``. Each is capped at
``max_tokens``. A reference with a field path (``r.title``) counts the field, not the
whole output: the field's schema bound when there is one, else the output's length
shared among the fields at that level.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from flowlift.chains import document_chains
from flowlift.chains import members as chain_members
from flowlift.costs import UNMEASURED, CostModel
from flowlift.dataflow import expanded_maps, levels, planning_dependencies
from flowlift.decisions import decision_report, with_decisions
from flowlift.escalation import OutcomeCounts, expected_cost
from flowlift.graph import (
    Graph,
    GroupNode,
    InputNode,
    Items,
    LLMNode,
    MapNode,
    Node,
    Ref,
    Template,
    ToolNode,
    condition_of,
    default_of,
)
from flowlift.output_size import size_warnings
from flowlift.prefix_cache import DEFAULT_KV_BLOCK as DEFAULT_KV_BLOCK
from flowlift.prefix_cache import deterministic, repeated_calls, whole_blocks
from flowlift.prefix_cache import prefix_groups as prefix_groups
from flowlift.report import (
    BreakReport,
    CascadeReport,
    CompileReport,
    MergeReport,
    NodeReport,
    PrefixGroupReport,
    ResidencyReport,
    TierPlanReport,
    TierStepReport,
)
from flowlift.schema_tokens import CHARS_PER_TOKEN as CHARS_PER_TOKEN
from flowlift.schema_tokens import SCALAR_TOKENS as SCALAR_TOKENS
from flowlift.schema_tokens import field_schema as field_schema
from flowlift.schema_tokens import schema_tokens as schema_tokens
from flowlift.simulate import (
    EngineModel,
    Schedule,
    Work,
    critical_chain,
    remaining_ms,
    simulate,
)
from flowlift.tiers import StepEstimate, TierProfile, plan_tiers, watchdog_risk
from flowlift.timing import agent_turns, call_ms, call_work

Tokenize = Callable[[str, str], Sequence[int]]


@dataclass(frozen=True, slots=True)
class OutputLengths:
    """Output tokens a step produced in finished runs: ``samples`` of them, their median
    (``p50``) and 90th percentile (``p90``)."""

    samples: int
    p50: float
    p90: float


def no_lengths(step: str, model: str) -> OutputLengths | None:
    """Nothing learned: the compiler falls back to schema bounds and ``max_tokens``."""
    return None


def no_turns(step: str, model: str) -> float | None:
    """No agent turns learned: :func:`flowlift.timing.agent_turns` guesses."""
    return None



_WORDS = re.compile(r"\w+|[^\w\s]")
def approximate_tokenize(model: str, text: str) -> list[int]:
    """Words and punctuation marks as integer ids (equal within one process), for when
    no tokenizer is at hand. Counts come out near a BPE tokenizer's for English prose."""
    return [hash(t) for t in _WORDS.findall(text)]


def _memoized(tokenize: Tokenize) -> Tokenize:
    """One tokenization per distinct (model, text) within a compilation: a shared
    preamble is tokenized once, not once per step."""
    memo: dict[tuple[str, str], Sequence[int]] = {}

    def cached(model: str, text: str) -> Sequence[int]:
        key = (model, text)
        if key not in memo:
            memo[key] = tokenize(model, text)
        return memo[key]

    return cached


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """Inputs of a compilation besides the graph.

    Attributes:
        default_model: the model of nodes that name none.
        tokenize: ``(model, text) -> token ids``; the default is approximate.
        costs: ``model -> CostModel`` (measured figures from the proxy).
        enforces: ``model -> bool``: can its backend constrain decoding natively?
        max_concurrency: steps the backends run at once (for the capacity bound).
        tool_ms: expected duration of a client-run step.
        outcomes: ``(step name, model) -> OutcomeCounts`` learned from real runs: a
            cascade step's expected cost (:mod:`flowlift.escalation`), and the retries
            of any step with observations.
        price: ``model -> price per 1,000 tokens`` or ``None`` (unpriced).
        output_lengths: ``(step name, model) -> OutputLengths`` learned from finished
            runs, or None; the estimate of a step's output is its median.
        tiers: ``model -> service tiers`` its backends offer (:mod:`flowlift.tiers`), or
            None; with a deadline, the report then plans each step's tier.
        kv_block: ``model -> tokens per KV-cache block`` of the engine that serves it
            (prefix groups share whole blocks: :func:`prefix_groups`).
        agent_turns: ``(step name, model) -> model turns`` an agent step took on
            average in finished runs, or None (then :func:`flowlift.timing.agent_turns`
            guesses from ``max_turns``).
        engine: ``model -> engine name``: models on one engine share it in the planned
            schedule (:mod:`flowlift.simulate`).
        capacity: ``(engine name, workflow class) -> slots`` (its requests at once);
            None: ``max_concurrency``.
        prefill_budget: ``(engine name, workflow class) -> prompt tokens`` its steps may
            have in prefill at once (the proxy's batch prefill budget); None: no bound.
        host: ``engine name -> machine`` (None: its own): engines on one machine share
            its cores in the planned schedule; by default all on one.
        cached_prefix: ``(model, token ids of a step's literal prefix) -> tokens`` of it
            already in the prefix cache of the model's engine from earlier requests
            (whole blocks: :class:`flowlift.prefix_cache.PrefixIndex`); by default none.
    """

    default_model: str = "default"
    tokenize: Tokenize = approximate_tokenize
    costs: Callable[[str], CostModel] = field(default=lambda model: UNMEASURED)
    enforces: Callable[[str], bool] = field(default=lambda model: True)
    max_concurrency: int = 16
    tool_ms: float = 50.0
    outcomes: Callable[[str, str], OutcomeCounts] = field(default=lambda step, model:
                                                          OutcomeCounts())
    price: Callable[[str], float | None] = field(default=lambda model: None)
    output_lengths: Callable[[str, str], OutputLengths | None] = field(default=no_lengths)
    tiers: Callable[[str], Sequence[TierProfile]] | None = None
    kv_block: Callable[[str], int] = field(default=lambda model: DEFAULT_KV_BLOCK)
    agent_turns: Callable[[str, str], float | None] = field(default=no_turns)
    engine: Callable[[str], str] = field(default=lambda model: model)
    capacity: Callable[[str, str], int] | None = None
    prefill_budget: Callable[[str, str], float] | None = None
    host: Callable[[str], str | None] = field(default=lambda engine: "local")
    cached_prefix: Callable[[str, Sequence[int]], int] = field(default=lambda model, ids: 0)


def no_outcomes(step: str, model: str | None) -> OutcomeCounts:
    """Nothing observed yet (the prior: failure rate 0.5, one attempt per item)."""
    return OutcomeCounts()


@dataclass(slots=True)
class Plan:
    """What the scheduler uses: per-node priorities and groups (ids -> values).

    Attributes:
        compiled: the compiler's report, or how to make it: a growing run's plan
            (:mod:`flowlift.incremental`) compiles its report only when it is read.
        previous: the last report compiled of the same run while ``compiled`` is not
            made yet (None: there is none).
        output_tokens: each node's estimated output length (tokens).
        chain: model step -> the first step of its document chain (:mod:`flowlift.chains`:
            steps that re-read one another's prompt prefix, kept together under KV
            pressure by working-set admission).
        chain_members: chain -> its steps.
    """

    tail_ms: dict[str, float]
    cost_ms: dict[str, float]
    uncached_tokens: dict[str, float]
    merged_into: dict[str, str]
    prefix_group: dict[str, int]
    group_leader: dict[int, str]
    compiled: CompileReport | Callable[[], CompileReport]
    previous: CompileReport | None = None
    output_tokens: dict[str, float] = field(default_factory=dict)
    chain: dict[str, str] = field(default_factory=dict)
    chain_members: dict[str, list[str]] = field(default_factory=dict)
    rows: tuple[CompileReport, dict[str, NodeReport]] | None = field(default=None,
                                                                     repr=False)

    @property
    def report(self) -> CompileReport:
        """The compiler's report (compiled now if it was left for later: a full compile,
        so read it off the event loop for a big graph)."""
        if not isinstance(self.compiled, CompileReport):
            self.compiled = self.compiled()
        return self.compiled

    def latest_report(self) -> CompileReport | None:
        """The report if it is made, else the last one compiled before it; never
        compiles."""
        return self.compiled if isinstance(self.compiled, CompileReport) else self.previous

    def row(self, step_id: str) -> NodeReport | None:
        """``step_id``'s row in :meth:`latest_report` (None: no report, or no such row);
        never compiles."""
        report = self.latest_report()
        if report is None:
            return None
        if self.rows is None or self.rows[0] is not report:
            self.rows = (report, {n.step_id: n for n in report.nodes})
        return self.rows[1].get(step_id)

    def closed(self) -> Plan:
        """This plan with its report marked closed (``open`` false: no more steps)."""
        made = self.compiled
        shut: CompileReport | Callable[[], CompileReport] = (
            made.model_copy(update={"open": False}) if isinstance(made, CompileReport)
            else lambda: made().model_copy(update={"open": False}))
        return dataclasses.replace(self, compiled=shut)


def _literal_prefix(node: LLMNode) -> str:
    out = []
    for msg in node.messages:
        out.append(f"<|{msg.role}|>")
        for part in msg.content:
            if isinstance(part, Ref):
                return "".join(out)
            out.append(part.text)
    return "".join(out)


def prompt_text(messages: Sequence[tuple[str, str]]) -> str:
    """The text the compiler counts a resolved prompt's tokens in (``(role, content)``
    pairs): a step's literal prefix is the start of it, so what the proxy records of the
    prompts it sent (:class:`flowlift.prefix_cache.PrefixIndex`) matches the plan's."""
    return "".join(f"<|{role}|>{content}" for role, content in messages)


def _warm_starts(order: Sequence[str], nodes: dict[str, Node],
                 deps: dict[str, frozenset[str]],
                 prefixes: dict[str, tuple[str, Sequence[int]]], opts: CompileOptions,
                 shared_of: dict[str, int]) -> set[str]:
    """Raise each step's cached start (``shared_of``) to what its engine's prefix cache
    holds of its literal start from earlier requests (``opts.cached_prefix``); returns
    the steps whose whole prompt repeats an earlier one (:func:`repeated_calls`)."""
    warm: dict[str, bool] = {}
    for nid, (model, toks) in prefixes.items():
        cached = opts.cached_prefix(model, toks)
        shared_of[nid] = max(shared_of.get(nid, 0), cached)
        warm[nid] = cached > 0 and cached >= whole_blocks(len(toks), opts.kv_block(model))
    return repeated_calls(order, nodes, deps, warm)


def _canonical(node: Node, canon: dict[str, str]) -> str | None:
    """A key equal for identical calls (refs replaced by their representatives)."""
    def ref(r: Ref) -> dict[str, Any]:
        return {"ref": canon.get(r.ref, r.ref), "path": list(r.path)}

    def arg(a: Any) -> Any:
        if isinstance(a, Ref):
            return ref(a)
        if isinstance(a, Template):
            return {"template": [ref(p) if isinstance(p, Ref) else p.text for p in a.template]}
        if isinstance(a, Items):
            return {"items": [arg(item) for item in a.items]}
        return {"value": a.value}

    if isinstance(node, InputNode):
        body: Any = {"input": node.value}
    elif isinstance(node, LLMNode):
        if not deterministic(node) or node.tools:  # an agent step calls client-run tools
            return None
        body = {"model": node.model, "params": node.params.model_dump(mode="json"),
                "policy": [node.cascade, node.retries, node.min_confidence],
                "contract": node.contract.model_dump(mode="json") if node.contract else None,
                "messages": [[m.role, [ref(p) if isinstance(p, Ref) else p.text
                                       for p in m.content]] for m in node.messages]}
    elif isinstance(node, ToolNode) and node.pure:  # declared free of side effects
        body = {"tool": node.name, "args": [arg(a) for a in node.args],
                "kwargs": {k: arg(v) for k, v in node.kwargs.items()}}
    else:
        return None  # other client-run steps may have side effects: never merged
    if condition_of(node) or default_of(node):  # merged only with the same decision
        body = {"call": body, "when": condition_of(node), "default": default_of(node)}
    return json.dumps(body, sort_keys=True, default=_json)


def _json(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else str(value)


def find_identical(graph: Graph, order: Sequence[str]) -> dict[str, str]:
    """``node id -> representative id`` for every node whose call repeats an earlier one."""
    nodes = graph.node_map()
    canon: dict[str, str] = {}
    seen: dict[str, str] = {}
    merged: dict[str, str] = {}
    for nid in order:
        key = _canonical(nodes[nid], canon)
        if key is not None and key in seen:
            canon[nid] = merged[nid] = seen[key]
        else:
            canon[nid] = nid
            if key is not None:
                seen[key] = nid
    return merged


def _output_tokens(node: LLMNode, opts: CompileOptions, model: str) -> float:
    if node.contract is not None and node.contract.choices is not None:
        return float(max(len(opts.tokenize(model, c)) for c in node.contract.choices) + 1)
    cap = float(node.params.max_tokens or 256)
    learned = opts.output_lengths(node.name or node.id, model)
    if learned is not None and learned.samples:
        return min(max(learned.p50, 1.0), cap)
    if node.contract is not None and node.contract.json_schema is not None:
        bound = schema_tokens(node.contract.json_schema,
                              lambda text: float(len(opts.tokenize(model, text))))
        if bound is not None:
            return min(bound, cap)
    return cap


def _ref_tokens(ref: Ref, nodes: dict[str, Node], out_tokens: dict[str, float],
                opts: CompileOptions, model: str) -> float:
    """Tokens a reference adds to a prompt: its producer's output, or only the field at
    its path (the field's schema bound, else the output shared among its level's fields)."""
    whole = out_tokens.get(ref.ref, 16.0)
    if not ref.path:
        return whole
    producer = nodes.get(ref.ref)
    schema = (producer.contract.json_schema if isinstance(producer, LLMNode)
              and producer.contract is not None else None)
    sub, fields = field_schema(schema, ref.path) if schema is not None else (None, 1)
    bound = schema_tokens(sub, lambda text: float(len(opts.tokenize(model, text))))
    return min(bound, whole) if bound is not None else whole / fields


def _count(opts: CompileOptions, model: str, text: str) -> int:
    return len(opts.tokenize(model, text))


def _prompt_tokens(node: LLMNode, opts: CompileOptions, model: str,
                   out_tokens: dict[str, float], nodes: dict[str, Node] | None = None
                   ) -> float:
    total = 0.0
    for msg in node.messages:
        total += 4  # chat-template tokens per message
        for part in msg.content:
            total += (_ref_tokens(part, nodes or {}, out_tokens, opts, model)
                      if isinstance(part, Ref) else len(opts.tokenize(model, part.text)))
    return total


def compile_graph(graph: Graph, opts: CompileOptions | None = None) -> Plan:
    """Compile a validated graph into a :class:`Plan` (with its :class:`CompileReport`).

    Costs are estimates: output lengths as the module docstring says (learned, else the
    contract's bound, else ``max_tokens``); a reference adds its producer's output
    length, or its field's.

    Raises:
        GraphError: when the graph has a cycle.
    """
    opts = opts or CompileOptions()
    opts = dataclasses.replace(opts, tokenize=_memoized(opts.tokenize))
    deps = planning_dependencies(graph)
    expanded = expanded_maps(graph)
    level_list = levels(graph, deps)
    order = [nid for level in level_list for nid in level]
    nodes = graph.node_map()
    merged = find_identical(graph, order)
    model_of = {nid: (n.models()[0] or opts.default_model) for nid, n in nodes.items()
                if isinstance(n, LLMNode)}

    prefixes = {nid: (model_of[nid], opts.tokenize(model_of[nid], _literal_prefix(n)))
                for nid, n in nodes.items()
                if isinstance(n, LLMNode) and nid not in merged}
    groups = prefix_groups(prefixes, opts.kv_block)
    pos = {nid: i for i, nid in enumerate(order)}
    group_of: dict[str, int] = {}
    shared_of: dict[str, int] = {}
    leader: dict[int, str] = {}
    for gi, (shared, members) in enumerate(groups):
        # the member that can start first warms the cache for the rest
        members.sort(key=lambda m: (len(deps[m]), pos[m]))
        leader[gi] = members[0]
        for m in members:
            group_of[m] = gi
            shared_of[m] = 0 if m == members[0] else shared
    repeat = _warm_starts(order, nodes, deps, prefixes, opts, shared_of)

    out_tok: dict[str, float] = {}
    cost: dict[str, float] = {}
    prompt_tok: dict[str, float] = {}
    uncached_tok: dict[str, float] = {}
    cascades: list[CascadeReport] = []
    work: dict[str, Work] = {}
    for nid in order:
        node = nodes[nid]
        if nid in merged:
            cost[nid] = 0.0
            out_tok[nid] = out_tok.get(merged[nid], 16.0)
        elif isinstance(node, LLMNode):
            model = model_of[nid]
            out_tok[nid] = _output_tokens(node, opts, model)
            prompt_tok[nid] = _prompt_tokens(node, opts, model, out_tok, nodes)
            uncached_tok[nid], cost[nid], cascade = llm_price(
                node, opts, model, prompt_tok[nid], out_tok[nid],
                whole_blocks(prompt_tok[nid], opts.kv_block(model)) if nid in repeat
                else shared_of.get(nid, 0))
            work[nid] = step_work(node, opts, model, uncached_tok[nid], out_tok[nid],
                                  cost[nid])
            if cascade is not None:
                cascades.append(cascade)
        elif nid in expanded:  # its item steps carry the work
            cost[nid], out_tok[nid] = 0.0, sum(out_tok[i] for i in expanded[nid])
        else:
            cost[nid], out_tok[nid] = other_estimate(node, opts, out_tok, nodes)
            work[nid] = _other_work(node, opts, out_tok, nodes, cost[nid])

    children: dict[str, list[str]] = {nid: [] for nid in order}
    for nid, ds in deps.items():
        for d in ds:
            children[d].append(nid)
    tail: dict[str, float] = {}
    for nid in reversed(order):
        tail[nid] = cost[nid] + max((tail[c] for c in children[nid]), default=0.0)

    timing = _planned_schedule(order, deps, nodes, merged, model_of, work, tail, opts,
                               graph.workflow_class)
    report = _report(graph, opts, order, deps, nodes, merged, model_of, groups, leader,
                     cost, timing, prompt_tok, out_tok, group_of, level_list)
    warnings = [w for nid in order if isinstance(n := nodes[nid], LLMNode)
                for w in size_warnings(n, functools.partial(_count, opts, model_of[nid]))]
    report = report.model_copy(update={"cascades": cascades,
                                       "cascade_totals": cascade_totals(cascades),
                                       "open": graph.open, "warnings": warnings,
                                       "tier_plan": _tier_plan(graph, opts, order, deps,
                                                               model_of, cost, prompt_tok,
                                                               out_tok),
                                       })
    report = with_decisions(report, decision_report(
        order, nodes, deps, cost, {n: prompt_tok.get(n, 0.0) + out_tok[n]
                                   for n in prompt_tok}, timing.path, timing.critical_ms,
        timing.worst_ms))
    chains = document_chains(order, deps, prefixes, opts.kv_block)
    return Plan(tail_ms=tail, cost_ms=cost, uncached_tokens=uncached_tok, merged_into=merged,
                prefix_group=group_of, group_leader=leader, compiled=report,
                output_tokens=out_tok, chain=chains, chain_members=chain_members(chains))


def llm_price(node: LLMNode, opts: CompileOptions, model: str, prompt: float, out: float,
              shared: float) -> tuple[float, float, CascadeReport | None]:
    """A model step's uncached prompt tokens, cost (ms) and cascade report (None for a
    one-model step without observations), ``shared`` of its ``prompt`` tokens (an
    estimate) being cached by its prefix group's leader. An agent step costs its
    expected turns (:func:`flowlift.timing.agent_turns`), not one call."""
    uncached = max(prompt - shared, 0.0)
    turns = _turns(node, opts, model)
    cascade = _cascade(node, opts, uncached, prompt, out, turns)
    cost = (cascade.expected_ms if cascade is not None
            else call_ms(opts.costs(model), uncached, out, turns, opts.tool_ms))
    return uncached, cost, cascade


def _turns(node: LLMNode, opts: CompileOptions, model: str) -> float:
    return agent_turns(node, opts.agent_turns(node.name or node.id, model)
                       if node.tools else None)


def step_work(node: Node, opts: CompileOptions, model: str, uncached: float, out: float,
              cost_ms: float) -> Work:
    """What a model step (or an unexpanded map's one item) asks of its engine, at its
    planned ``cost_ms`` (a cascade or retries scale the one call's work up)."""
    step = node.step if isinstance(node, MapNode) else node
    assert isinstance(step, LLMNode)
    models = [m or opts.default_model for m in step.models()]
    if len(models) > 1:
        return _cascade_work(step, opts, models, uncached, out)
    cm = opts.costs(model)
    turns = _turns(step, opts, model)
    one = call_ms(cm, uncached, out, turns, opts.tool_ms)
    return call_work(cm, opts.engine(model), uncached, out, turns, opts.tool_ms,
                     cost_ms / one if one > 0 else 1.0)


def _cascade_work(step: LLMNode, opts: CompileOptions, models: list[str], uncached: float,
                  out: float) -> Work:
    """A cascade step's work: one :class:`Work` per model, each on that model's engine
    and under its cost model, scaled by the share of items expected to reach it times
    its attempts per item (:mod:`flowlift.escalation`), chained in the cascade's order
    (so a 1.5B model's share of the labels is planned on the 1.5B's engine, not as more
    of the first model's work)."""
    name = step.name or step.id
    reach, parts = 1.0, []
    for m in models:
        seen = opts.outcomes(name, m)
        turns = _turns(step, opts, m)
        parts.append(call_work(opts.costs(m), opts.engine(m), uncached, out, turns,
                               opts.tool_ms, reach * seen.attempts_per_item))
        reach *= seen.failure_rate
    chained: Work | None = None
    for part in reversed(parts):
        chained = dataclasses.replace(part, then=chained)
    assert chained is not None
    return chained


def other_estimate(node: Node, opts: CompileOptions, out_tok: dict[str, float],
                   nodes: dict[str, Node]) -> tuple[float, float]:
    """``(cost ms, output tokens)`` of a step that is no model call: a client-run tool
    (``tool_ms``, 32 tokens), a constant (free: its value's tokens), a group (free: its
    longest member's output) or a map (one item's step, as the items run side by side;
    its output: ``max_items`` of them). ``out_tok``: the output tokens of the steps
    before it (a group's members, a map's inputs)."""
    if isinstance(node, ToolNode):
        return opts.tool_ms, 32.0
    if isinstance(node, GroupNode):
        return 0.0, max(out_tok[m] for m in node.members)
    if isinstance(node, MapNode):
        model = node.step.models()[0] or opts.default_model
        out = _output_tokens(node.step, opts, model)
        prompt = _prompt_tokens(node.step, opts, model, out_tok, nodes)
        return opts.costs(model).step_ms(prompt, out), out * node.max_items
    assert isinstance(node, InputNode)
    return 0.0, float(len(opts.tokenize(opts.default_model, str(node.value))))


def _other_work(node: Node, opts: CompileOptions, out_tok: dict[str, float],
                nodes: dict[str, Node], cost_ms: float) -> Work:
    """A step that is no model call: a tool's time off any engine; an unexpanded map's
    one item on its model's engine; a constant or a group: nothing."""
    if isinstance(node, MapNode):
        model = node.step.models()[0] or opts.default_model
        out = _output_tokens(node.step, opts, model)
        prompt = _prompt_tokens(node.step, opts, model, out_tok, nodes)
        return step_work(node, opts, model, prompt, out, cost_ms)
    return Work(fixed_ms=cost_ms)


@dataclass(frozen=True, slots=True)
class _Timing:
    """The planned schedule and what the report reads of it: one computation for the
    headline, the named path and the rows."""

    schedule: Schedule
    remaining: dict[str, float]
    path: list[str]
    critical_ms: float
    worst_ms: float | None  # every group waiting for all its members (None: no groups)


def _step_models(node: Node) -> tuple[str | None, ...]:
    step = node.step if isinstance(node, MapNode) else node
    return step.models() if isinstance(step, LLMNode) else ()


def engine_models(models: Iterable[str], opts: CompileOptions, kind: str
                  ) -> dict[str, EngineModel]:
    """``engine name -> EngineModel`` of the engines that serve ``models`` (every model of
    a cascade: its share runs on its engine): each under the cost model of the first of
    ``models`` it serves, with its slots and prefill budget for workflow class ``kind``
    and its machine."""
    engines: dict[str, EngineModel] = {}
    for model in models:
        name = opts.engine(model)
        if name in engines:
            continue
        slots = opts.capacity(name, kind) if opts.capacity else opts.max_concurrency
        budget = opts.prefill_budget(name, kind) if opts.prefill_budget else math.inf
        engines[name] = EngineModel.of(opts.costs(model), slots, budget, opts.host(name))
    return engines


def _planned_schedule(order: list[str], deps: dict[str, frozenset[str]],
                      nodes: dict[str, Node], merged: dict[str, str],
                      model_of: dict[str, str], work: dict[str, Work],
                      tail: dict[str, float], opts: CompileOptions, kind: str) -> _Timing:
    """The graph played on its engines (:func:`flowlift.simulate.simulate`): slots taken
    by remaining critical path, as the proxy does; an identical call ends with the one
    it reuses; a group with its ``k``-th member. ``kind``: the workflow class (a batch
    run's slots and prefill budget are the proxy's for batch work)."""
    engines = engine_models((m or opts.default_model for node in nodes.values()
                             for m in _step_models(node)), opts, kind)
    groups = {nid: (n.k, tuple(n.members)) for nid, n in nodes.items()
              if isinstance(n, GroupNode)}
    sim_deps = {nid: deps[nid] | {merged[nid]} if nid in merged else deps[nid]
                for nid in order}
    sched = simulate(order, sim_deps, work, engines, tail, groups)
    worst = None if not groups else max(simulate(
        order, sim_deps, work, engines, tail,
        {g: (len(members), members) for g, (_, members) in groups.items()}
    ).finish_ms.values(), default=0.0)
    return _Timing(sched, remaining_ms(order, sim_deps, sched),
                   critical_chain(order, sim_deps, sched, groups),
                   max(sched.finish_ms.values(), default=0.0), worst)


def _tier_plan(graph: Graph, opts: CompileOptions, order: list[str],
               deps: dict[str, frozenset[str]], model_of: dict[str, str],
               cost: dict[str, float], prompt_tok: dict[str, float],
               out_tok: dict[str, float]) -> TierPlanReport | None:
    """Each step's service tier under the graph's deadline (:func:`flowlift.tiers.plan_tiers`;
    steps other than model calls run where they are, at no price)."""
    if opts.tiers is None or not graph.deadline_s:
        return None
    here = (TierProfile("local", 0.0, 0.0),)
    offered: dict[str, tuple[TierProfile, ...]] = {}  # per model, asked once
    for model in set(model_of.values()):
        offered[model] = tuple(opts.tiers(model)) or here
    steps = [StepEstimate(nid, deps[nid], cost[nid] / 1000, prompt_tok.get(nid, 0.0),
                          out_tok.get(nid, 0.0) if nid in model_of else 0.0,
                          offered[model_of[nid]] if nid in model_of else here)
             for nid in order]
    plan = plan_tiers(steps, graph.deadline_s, here)
    profiles = {t.tier: t for s in steps for t in s.tiers or ()}
    return TierPlanReport(
        watchdog_risk=round(watchdog_risk(plan, profiles), 4),
        feasible=plan.feasible, cost=round(plan.cost, 6),
        standard_cost=round(plan.standard_cost, 6),
        cost_ratio=round(plan.cost / plan.standard_cost, 3) if plan.standard_cost else None,
        by_tier=plan.by_tier(),
        steps=[TierStepReport(step_id=p.step_id, tier=p.tier, start_s=round(p.start_s, 1),
                              latest_start_s=round(p.latest_start_s, 1),
                              cost=round(p.cost, 6), standard_cost=round(p.standard_cost, 6))
               for p in plan.steps.values()])


def _cascade(node: LLMNode, opts: CompileOptions, uncached: float, prompt: float,
             out: float, turns: float = 1.0) -> CascadeReport | None:
    """A cascade step's expected cost (time and, where every model is priced, price)
    under the failure rates learned per (step, model); ``None`` for a one-model step
    (whose estimate only grows by its observed attempts per item)."""
    models = [m or opts.default_model for m in node.models()]
    step = node.name or node.id
    counts = [opts.outcomes(step, m) for m in models]
    ms = [call_ms(opts.costs(m), uncached, out, turns, opts.tool_ms) for m in models]
    if len(models) == 1:
        return None if not counts[0].items else CascadeReport(
            step_id=node.id, step=step, models=models,
            failure_rates=[round(counts[0].failure_rate, 4)],
            observed=[counts[0].items], expected_ms=round(counts[0].attempts_per_item * ms[0],
                                                          1), last_only_ms=round(ms[0], 1))
    prices = [p for p in map(opts.price, models) if p is not None]
    priced = len(prices) == len(models)
    per_attempt = [(prompt + out) / 1000.0 * p for p in prices] if priced else []
    last = counts[-1].attempts_per_item
    return CascadeReport(
        step_id=node.id, step=step, models=models,
        failure_rates=[round(c.failure_rate, 4) for c in counts],
        observed=[c.items for c in counts],
        expected_ms=round(expected_cost(ms, counts), 1), last_only_ms=round(last * ms[-1], 1),
        expected_price=round(expected_cost(per_attempt, counts), 6) if priced else None,
        last_only_price=round(last * per_attempt[-1], 6) if priced else None)


def cascade_totals(cascades: Sequence[CascadeReport]) -> dict[str, float]:
    """Sums over cascade steps: ``expected_ms``/``last_only_ms`` always, and
    ``expected_price``/``last_only_price`` when every cascade step is priced."""
    multi = [c for c in cascades if len(c.models) > 1]
    if not multi:
        return {}
    out = {"expected_ms": round(sum(c.expected_ms for c in multi), 1),
           "last_only_ms": round(sum(c.last_only_ms for c in multi), 1)}
    if all(c.expected_price is not None for c in multi):
        out["expected_price"] = round(sum(c.expected_price or 0.0 for c in multi), 6)
        out["last_only_price"] = round(sum(c.last_only_price or 0.0 for c in multi), 6)
    return out


def _critical_path(order: list[str], deps: dict[str, frozenset[str]],
                   tail: dict[str, float], children: dict[str, list[str]]) -> list[str]:
    roots = [n for n in order if not deps[n]]
    if not roots:
        return []
    node = max(roots, key=lambda n: tail[n])
    path = [node]
    while children[node]:
        node = max(children[node], key=lambda c: tail[c])
        path.append(node)
    return path


def _residency(order: list[str], model_of: dict[str, str], start: dict[str, float],
               cost: dict[str, float]) -> tuple[list[ResidencyReport], int]:
    windows: dict[str, list[float]] = {}
    for nid, model in model_of.items():
        w = windows.setdefault(model, [start[nid], start[nid] + cost[nid], 0])
        w[0] = min(w[0], start[nid])
        w[1] = max(w[1], start[nid] + cost[nid])
        w[2] += 1
    dispatch = sorted((n for n in order if n in model_of), key=lambda n: start[n])
    switches = sum(1 for a, b in itertools.pairwise(dispatch)
                   if model_of[a] != model_of[b])
    return [ResidencyReport(model=m, load_by_ms=round(w[0], 1), keep_until_ms=round(w[1], 1),
                            steps=int(w[2])) for m, w in sorted(windows.items())], switches


def _report(graph: Graph, opts: CompileOptions, order: list[str],
            deps: dict[str, frozenset[str]], nodes: dict[str, Node], merged: dict[str, str],
            model_of: dict[str, str], groups: list[tuple[int, list[str]]],
            leader: dict[int, str], cost: dict[str, float], timing: _Timing,
            prompt_tok: dict[str, float], out_tok: dict[str, float],
            group_of: dict[str, int], level_list: list[list[str]]) -> CompileReport:
    depth = {nid: k for k, level in enumerate(level_list) for nid in level}
    path, sched = timing.path, timing.schedule
    start = sched.start_ms
    took = {n: sched.finish_ms[n] - start[n] for n in order}
    on_path = set(path)
    breaks = [BreakReport(step_id=nid, reason="client-run @tool step: the chain leaves the "
                          "server and waits for the app") for nid in order
              if isinstance(nodes[nid], ToolNode)]
    for nid in order:
        node = nodes[nid]
        if not isinstance(node, LLMNode) or node.contract is None:
            continue
        for model in dict.fromkeys(m or opts.default_model for m in node.models()):
            if not opts.enforces(model):
                breaks.append(BreakReport(step_id=nid, reason=f"contract not enforceable by "
                                          f"{model}'s backend: checked after generation"))
    critical_ms = timing.critical_ms
    work_ms = sum(cost.values())
    bound_ms = max(critical_ms, work_ms / max(opts.max_concurrency, 1))
    residency, switches = _residency(order, model_of, start, took)
    deadline_ms = graph.deadline_s * 1000 if graph.deadline_s else None
    used = {model_of[n] for n in model_of} | {
        m or opts.default_model for node in map(nodes.__getitem__, model_of)
        if isinstance(node, LLMNode) for m in node.models()}
    return CompileReport(
        name=graph.name, workflow_class=graph.workflow_class, steps=len(order),
        levels=1 + max(depth.values(), default=-1),
        critical_path=path, critical_path_ms=round(critical_ms, 1),
        total_work_ms=round(work_ms, 1), lower_bound_ms=round(bound_ms, 1),
        deadline_ms=deadline_ms,
        deadline_feasible=None if deadline_ms is None else bound_ms <= deadline_ms,
        prefix_groups=[PrefixGroupReport(shared_tokens=s, steps=len(m), leader=leader[i],
                                         tokens_saved=s * (len(m) - 1), members=m[:20])
                       for i, (s, m) in enumerate(groups)],
        merges=[MergeReport(step_id=k, same_as=v) for k, v in merged.items()],
        model_switches=switches, residency=residency, breaks=breaks,
        cost_models={m: opts.costs(m) for m in sorted(used)},
        nodes=[NodeReport(step_id=nid, kind=nodes[nid].kind, model=model_of.get(nid),
                          level=depth[nid], deps=sorted(deps[nid]),
                          est_ms=round(took[nid], 1), start_ms=round(start[nid], 1),
                          wait_ms=round(start[nid] - sched.ready_ms[nid], 1),
                          remaining_ms=round(timing.remaining[nid], 1),
                          critical=nid in on_path,
                          prompt_tokens=round(prompt_tok.get(nid, 0)),
                          output_tokens=round(out_tok.get(nid, 0)),
                          prefix_group=group_of.get(nid), same_as=merged.get(nid))
               for nid in order])
