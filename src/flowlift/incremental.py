"""Incremental compilation of a growing graph: an open run's appends cost what they add.

:func:`flowlift.compiler.compile_graph` reads a whole graph. An open run grows by a few
nodes at a time (``POST /v1/workflows/{run_id}/nodes``), and a new node can only read
nodes the run holds or nodes of its own append -- never the other way round. So
:class:`GrowingPlan` keeps the compiler's state and updates it per append with work
bounded by what the new nodes touch, not by the run's size:

* validation: duplicate ids, dangling references and unknown models are checked per new
  node against the held ids (a hash lookup each); a cycle can only run through new
  nodes, so the cycle search covers those alone;
* levels and identical calls: a new node's depth and canonical call key follow from its
  inputs; an identical call the run holds stays the representative;
* prefix groups: nodes share a prompt prefix of at least one KV block (``kv_block(model)``
  tokens: :func:`~flowlift.compiler.prefix_groups`) exactly when their first
  that-many tokens are equal (a common prefix is an ultrametric: ``lcp(a, c) >=
  min(lcp(a, b), lcp(b, c))``), so a group is keyed by (model, those tokens); a new node
  joins its key's group, and the group's shared length is the minimum with the new
  member alone (rounded down to whole blocks where it is priced). Only the new node's
  prompt is tokenized;
* costs: new nodes are estimated as the compiler does; an existing member is re-priced
  only when its group's shared length or leader changes;
* remaining critical path (``tail_ms``, the scheduler's priority): only ancestors of
  changed nodes can change. The update walks up from them in reverse topological order,
  raising a parent in O(1) per edge when a child's path grew (recomputing it from its
  children only when the child it ran through shrank), and stops at finished steps --
  whose priority is never read again (in an agent loop every earlier turn is finished,
  so an append touches the new node and its inputs only).

With no step finished, the state equals the full compile of the grown graph (checked by
``tests/test_incremental_plan.py``), with one exception by design: an existing step is
never re-pointed to a newer identical call (the full compile takes the one earliest in
level order as representative, which may be a new, shallower node). Estimates of
existing steps keep the cost models of when they were added; the report
(:attr:`Plan.report`) and a restarted run use one full compile of the grown graph.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections import ChainMap
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from flowlift.compiler import (
    CompileOptions,
    Plan,
    _canonical,
    _critical_path,
    _literal_prefix,
    _memoized,
    _output_tokens,
    _prompt_tokens,
    compile_graph,
    llm_price,
    other_estimate,
)
from flowlift.dataflow import _node_problems, find_cycle
from flowlift.errors import GraphError
from flowlift.graph import Graph, LLMNode, Node, node_refs
from flowlift.prefix_cache import _lcp
from flowlift.report import CompileReport

GroupKey = tuple[str, tuple[int, ...]]


@dataclass(slots=True)
class _Group:
    """The non-merged model steps whose prompts start with one key's tokens."""

    first: Sequence[int]  # the first member's prefix tokens
    members: list[str]
    leader: str
    shared: int = 0  # tokens every member's prefix shares (with two members or more)
    gid: int | None = None  # numbered once it has two members


def _never(step_id: str) -> bool:
    return False


class GrowingPlan:
    """The compiler's state of one growing graph, updated per append.

    Args:
        graph: the graph so far (validated).
        opts: compile options (tokenizer, cost models, ...), as for ``compile_graph``.
        finished: ``step id -> bool``: the step has finished (its remaining path is
            never read again, so updates stop there).

    Attributes:
        graph: the grown graph.
        visited: nodes and edges the updates have walked so far (a work counter).

    Raises:
        GraphError: ``graph`` has a cycle.
    """

    def __init__(self, graph: Graph, opts: CompileOptions,
                 finished: Callable[[str], bool] = _never) -> None:
        self.opts = dataclasses.replace(opts, tokenize=_memoized(opts.tokenize))
        self.finished = finished
        self.graph = graph.model_copy(update={"nodes": ()})
        self.nodes: dict[str, Node] = {}
        self.deps: dict[str, frozenset[str]] = {}
        self.children: dict[str, list[str]] = {}
        self.depth: dict[str, int] = {}
        self.index: dict[str, int] = {}  # arrival (graph order)
        self.seq: dict[str, int] = {}  # a topological order: each node after its inputs
        self.canon: dict[str, str] = {}
        self.seen: dict[str, str] = {}  # canonical call -> its representative
        self.merged: dict[str, str] = {}
        self.model_of: dict[str, str] = {}
        self.groups: dict[GroupKey, _Group] = {}
        self.key_of: dict[str, GroupKey] = {}
        self.group_of: dict[str, int] = {}
        self.group_leader: dict[int, str] = {}
        self.out_tok: dict[str, float] = {}
        self.prompt_tok: dict[str, float] = {}
        self.uncached: dict[str, float] = {}
        self.cost: dict[str, float] = {}
        self.tail: dict[str, float] = {}
        self.visited = 0
        self.add(graph.nodes)

    # -- validation ------------------------------------------------------------------
    def problems(self, nodes: Sequence[Node], models: Collection[str] | None) -> list[str]:
        """Every problem ``nodes`` would bring into the graph (what
        :func:`flowlift.dataflow.validate` finds in the grown graph, for graphs whose
        held nodes are valid)."""
        problems: list[str] = []
        new: dict[str, Node] = {}
        for node in nodes:
            if node.id in self.nodes or node.id in new:
                problems.append(f"duplicate node id {node.id!r}")
            new[node.id] = node
        held: ChainMap[str, Node] = ChainMap(new, self.nodes)
        for node in nodes:
            problems.extend(_node_problems(node, held, held, models))
        cycle = find_cycle({n.id: {r.ref for r in node_refs(n) if r.ref in new}
                            for n in nodes})
        if cycle:
            problems.append(f"dependency cycle: {' -> '.join(cycle)}")
        return problems

    def check(self, nodes: Sequence[Node], models: Collection[str] | None) -> None:
        """Raises GraphError listing every problem of ``nodes`` (:meth:`problems`)."""
        problems = self.problems(nodes, models)
        if problems:
            raise GraphError(problems)

    # -- growth ----------------------------------------------------------------------
    def add(self, nodes: Iterable[Node]) -> None:
        """Grow by validated ``nodes`` (:meth:`check`); work bounded by what they touch.

        Raises:
            GraphError: they close a dependency cycle.
        """
        arrived = tuple(nodes)
        batch = self._ordered(list(arrived))
        if not batch:
            return
        self.graph = self.graph.model_copy(update={"nodes": (*self.graph.nodes, *arrived)})
        repriced: set[str] = set()
        formed: list[_Group] = []
        for node in batch:
            self._place(node)
            if isinstance(node, LLMNode) and node.id not in self.merged:
                repriced |= self._join(node, formed)
        for group in sorted(formed, key=lambda g: (self.model_of[g.leader], tuple(g.first))):
            group.gid = max(self.group_leader, default=-1) + 1
            for m in group.members:
                self.group_of[m] = group.gid
            self.group_leader[group.gid] = group.leader
        for node in batch:
            self._estimate(node)
        fresh = {n.id for n in batch}
        for nid in repriced - fresh:
            self._reprice(nid)
        self._retail(fresh, repriced - fresh)

    def _ordered(self, nodes: list[Node]) -> list[Node]:
        """``nodes`` in level order among themselves (depth, then arrival), which is
        topological; their depths set.

        Raises:
            GraphError: they close a dependency cycle.
        """
        new = {n.id: n for n in nodes}
        local = {n.id: {r.ref for r in node_refs(n) if r.ref in new} for n in nodes}
        waiting = {nid: len(ds) for nid, ds in local.items()}
        users: dict[str, list[str]] = {nid: [] for nid in new}
        for nid, ds in local.items():
            for d in ds:
                users[d].append(nid)
        ready = [nid for nid, k in waiting.items() if k == 0]
        topo: list[str] = []
        while ready:
            nid = ready.pop()
            topo.append(nid)
            for u in users[nid]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    ready.append(u)
        if len(topo) < len(new):
            cycle = find_cycle({k: v for k, v in local.items() if waiting[k]}) or []
            raise GraphError([f"dependency cycle: {' -> '.join(cycle)}"])
        start = len(self.index)
        for i, nid in enumerate(new):
            self.index[nid] = start + i
        for nid in topo:
            refs = {r.ref for r in node_refs(new[nid])}
            self.depth[nid] = 1 + max((self.depth[d] for d in refs), default=-1)
        return sorted(nodes, key=lambda n: (self.depth[n.id], self.index[n.id]))

    def _place(self, node: Node) -> None:
        """Dependencies, children and identical-call merging of a new node."""
        nid = node.id
        self.nodes[nid] = node
        self.seq[nid] = len(self.seq)
        deps = self.deps[nid] = frozenset(r.ref for r in node_refs(node))
        self.children[nid] = []
        for d in deps:
            self.children[d].append(nid)
        self.visited += 1 + len(deps)
        key = _canonical(node, self.canon)
        if key is not None and key in self.seen:
            self.canon[nid] = self.merged[nid] = self.seen[key]
        else:
            self.canon[nid] = nid
            if key is not None:
                self.seen[key] = nid
        if isinstance(node, LLMNode):
            self.model_of[nid] = node.models()[0] or self.opts.default_model

    def _rank(self, nid: str) -> tuple[int, int, int]:
        """The compiler's leader order: fewest inputs, then level order."""
        return len(self.deps[nid]), self.depth[nid], self.index[nid]

    def _join(self, node: LLMNode, formed: list[_Group]) -> set[str]:
        """Put a new model step in its prefix group; returns the held members whose
        cached share changed (a lower shared length, or a new leader)."""
        model = self.model_of[node.id]
        tokens = self.opts.tokenize(model, _literal_prefix(node))
        block = max(self.opts.kv_block(model), 1)
        if len(tokens) < block:
            return set()
        key = (model, tuple(tokens[:block]))
        self.key_of[node.id] = key
        group = self.groups.get(key)
        if group is None:
            self.groups[key] = _Group(first=tokens, members=[node.id], leader=node.id)
            return set()
        lcp = _lcp(group.first, tokens)
        shared = lcp if len(group.members) == 1 else min(group.shared, lcp)
        old_leader = group.leader
        group.members.append(node.id)
        changed: set[str] = set()
        if group.gid is None:
            if len(group.members) == 2:
                formed.append(group)
            changed.add(old_leader)
        elif shared != group.shared:
            changed.update(group.members)
        group.shared = shared
        if self._rank(node.id) < self._rank(old_leader):
            group.leader = node.id
            changed.add(old_leader)
            if group.gid is not None:
                self.group_leader[group.gid] = node.id
        if group.gid is not None:
            self.group_of[node.id] = group.gid
        self.visited += 1
        return changed

    def _shared(self, nid: str) -> int:
        key = self.key_of.get(nid)
        group = None if key is None else self.groups[key]
        if group is None or len(group.members) < 2 or group.leader == nid:
            return 0
        block = max(self.opts.kv_block(self.model_of[nid]), 1)
        return group.shared // block * block

    def _estimate(self, node: Node) -> None:
        """A new node's output tokens, prompt tokens and cost, as the compiler's."""
        nid = node.id
        if nid in self.merged:
            self.cost[nid] = 0.0
            self.out_tok[nid] = self.out_tok.get(self.merged[nid], 16.0)
        elif isinstance(node, LLMNode):
            model = self.model_of[nid]
            self.out_tok[nid] = _output_tokens(node, self.opts, model)
            self.prompt_tok[nid] = _prompt_tokens(node, self.opts, model, self.out_tok,
                                                  self.nodes)
            self._reprice(nid)
        else:
            self.cost[nid], self.out_tok[nid] = other_estimate(node, self.opts, self.out_tok,
                                                               self.nodes)

    def _reprice(self, nid: str) -> None:
        node = self.nodes[nid]
        assert isinstance(node, LLMNode)
        self.uncached[nid], self.cost[nid], _ = llm_price(
            node, self.opts, self.model_of[nid], self.prompt_tok[nid], self.out_tok[nid],
            self._shared(nid))
        self.visited += 1

    def _retail(self, fresh: set[str], repriced: set[str]) -> None:
        """Remaining critical paths after new nodes (``fresh``) and held nodes whose cost
        changed (``repriced``): reverse topological order from them up their unfinished
        ancestors, each parent raised by a grown child in O(1) and recomputed from its
        children when the child its path ran through shrank."""
        recompute = set(fresh) | {n for n in repriced if not self.finished(n)}
        raised: dict[str, float] = {}
        heap = [(-self.seq[n], n) for n in recompute]
        heapq.heapify(heap)
        queued = set(recompute)
        while heap:
            _, nid = heapq.heappop(heap)
            queued.discard(nid)
            old = self.tail.get(nid)
            if nid in recompute:
                recompute.discard(nid)
                new = self.cost[nid] + max((self.tail[c] for c in self.children[nid]),
                                           default=0.0)
                self.visited += 1 + len(self.children[nid])
            else:
                new = max(old or 0.0, raised.pop(nid))
                self.visited += 1
            raised.pop(nid, None)
            if new == old:
                continue
            self.tail[nid] = new
            for p in self.deps[nid]:
                self.visited += 1
                if p in recompute or self.finished(p):
                    continue
                if old is None or new > old:
                    cand = self.cost[p] + new
                    if cand <= self.tail[p]:
                        continue
                    raised[p] = max(raised.get(p, cand), cand)
                elif self.cost[p] + old == self.tail[p]:  # its path ran through nid
                    recompute.add(p)
                else:
                    continue
                if p not in queued:
                    queued.add(p)
                    heapq.heappush(heap, (-self.seq[p], p))

    def _order(self, nid: str) -> tuple[int, int]:
        return self.depth[nid], self.index[nid]

    # -- reading -----------------------------------------------------------------------
    def critical_path(self) -> list[str]:
        """The chain of longest remaining paths (``tail_ms``, each step alone on its
        engine: the scheduler's priorities), computed now: O(graph). The report's critical
        path is the planned schedule's (:mod:`flowlift.simulate`)."""
        order = sorted(self.nodes, key=self._order)
        children = {n: sorted(cs, key=self.index.__getitem__)
                    for n, cs in self.children.items()}
        return _critical_path(order, self.deps, self.tail, children)

    def plan(self, previous: CompileReport | None = None) -> Plan:
        """The scheduler's view (its tables are this state's, updated in place by later
        appends); the report is one full compile of the graph as it is now, made when
        first read. ``previous``: the report to fall back on until then."""
        return Plan(tail_ms=self.tail, cost_ms=self.cost, uncached_tokens=self.uncached,
                    merged_into=self.merged, prefix_group=self.group_of,
                    group_leader=self.group_leader,
                    compiled=functools.partial(_report, self.graph, self.opts),
                    previous=previous, output_tokens=self.out_tok)


def _report(graph: Graph, opts: CompileOptions) -> CompileReport:
    return compile_graph(graph, opts).report

