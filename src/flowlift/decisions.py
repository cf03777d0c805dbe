"""Pure planning for the steps the proxy decides on: conditions (``when``), defaults.

Checks (:func:`condition_problems`, called by :func:`flowlift.dataflow.validate` so
their problems are listed with every other graph error) and the compiler's view
(:func:`decision_report`): which steps may not run, and the expected against the
worst-case work when every branch runs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Final

from flowlift.graph import (
    ITEM,
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
from flowlift.predicates import (
    Predicate,
    field_schema,
    json_type,
    leaf_problems,
    leaves,
    schema_types,
)
from flowlift.report import CompileReport, DecisionReport

CONDITION_P: Final = 0.5
"""The chance the compiler gives a ``when`` condition of holding (nothing is learned
about conditions yet): the expected cost counts a conditional step at half its cost."""


def needed_inputs(node: Node) -> tuple[list[Ref], list[Items]]:
    """The refs a node cannot do without (prompt holes, whole or templated tool
    arguments) and its list arguments (whose skipped items drop)."""
    if isinstance(node, LLMNode):
        return [p for m in node.messages for p in m.content if isinstance(p, Ref)], []
    if isinstance(node, MapNode):  # its list, and what its template reads besides items
        return [node.over, *(r for r in needed_inputs(node.step)[0] if r.ref != ITEM)], []
    needed: list[Ref] = []
    lists: list[Items] = []
    if isinstance(node, ToolNode):
        for arg in (*node.args, *node.kwargs.values()):
            if isinstance(arg, Ref):
                needed.append(arg)
            elif isinstance(arg, Template):
                needed.extend(p for p in arg.template if isinstance(p, Ref))
            elif isinstance(arg, Items):
                lists.append(arg)
    return needed, lists


def run_chances(order: Sequence[str], nodes: Mapping[str, Node]) -> dict[str, float]:
    """Each step's chance of running (1.0: unconditional): its condition's
    (:data:`CONDITION_P`) times the least likely input it needs that has no default
    (a list argument: its most likely item). Conditions are taken as independent."""
    p: dict[str, float] = {}

    def value_chance(ref_id: str) -> float:
        target = nodes.get(ref_id)
        if target is None or isinstance(target, InputNode) or default_of(target):
            return 1.0
        return p.get(ref_id, 1.0)

    for nid in order:
        node = nodes[nid]
        when = condition_of(node)
        own = CONDITION_P if when is not None else 1.0
        needed, lists = needed_inputs(node)
        chances = [value_chance(r.ref) for r in needed]
        chances += [max((value_chance(i.ref) if isinstance(i, Ref) else 1.0
                         for i in items.items), default=1.0) for items in lists]
        if when is not None:
            chances += [value_chance(leaf.ref) for leaf in leaves(when) if leaf.ref]
        p[nid] = own * min(chances, default=1.0)
    return p


def early_finish(order: Sequence[str], nodes: Mapping[str, Node],
                 deps: Mapping[str, Collection[str]], cost_ms: Mapping[str, float]
                 ) -> dict[str, float]:
    """Each step's estimated finish in ms from the run's start when a group resolves at
    its ``k``-th fastest member (first-wins: ``k`` = 1) instead of its slowest."""
    finish: dict[str, float] = {}
    for nid in order:
        node = nodes[nid]
        if isinstance(node, GroupNode):
            ready = sorted(finish[m] for m in node.members)[node.k - 1]
        else:
            ready = max((finish[d] for d in deps[nid]), default=0.0)
        finish[nid] = ready + cost_ms[nid]
    return finish


def _group_work(order: Sequence[str], nodes: Mapping[str, Node],
                cost_ms: Mapping[str, float], finish: Mapping[str, float]
                ) -> dict[str, float]:
    """Each step's share of its cost that runs: a group member still going when its
    group resolves is cancelled then, so only the part before counts."""
    share = dict.fromkeys(order, 1.0)
    for nid in order:
        node = nodes[nid]
        if not isinstance(node, GroupNode):
            continue
        for m in node.members:
            begun = finish[m] - cost_ms[m]
            if finish[m] > finish[nid] and cost_ms[m] > 0:
                share[m] = min(share[m], max(0.0, finish[nid] - begun) / cost_ms[m])
    return share


def decision_report(order: Sequence[str], nodes: Mapping[str, Node],
                    deps: Mapping[str, Collection[str]], cost_ms: Mapping[str, float],
                    tokens: Mapping[str, float], critical: Collection[str] = (),
                    critical_ms: float | None = None, worst_ms: float | None = None
                    ) -> DecisionReport | None:
    """The compiler's section on steps that may not run (None: every step runs).

    Args:
        order: step ids, dependencies first.
        nodes: the graph's nodes by id.
        deps: each step's inputs.
        cost_ms: each step's estimated cost in ms.
        tokens: each step's estimated prompt plus output tokens.
        critical: the critical path's steps (all assumed to run).
        critical_ms: the planned critical path (the report's, groups resolving early in
            its schedule); None: the groups' early finish with each step's ``cost_ms``.
        worst_ms: the same when every group waits for all its members (None: as
            ``critical_ms``, with each step's ``cost_ms``).
    """
    chance = run_chances(order, nodes)
    groups = [nid for nid in order if isinstance(nodes[nid], GroupNode)]
    maps = {nid: n.max_items for nid, n in nodes.items() if isinstance(n, MapNode)}
    conditional = [nid for nid in order if chance[nid] < 1.0]
    if not conditional and not groups and not maps:
        return None
    finish = early_finish(order, nodes, deps, cost_ms)
    share = _group_work(order, nodes, cost_ms, finish)
    for nid, most in maps.items():  # every item may run (the list is not known yet)
        share[nid] *= most
    worst = dict(early_finish(order, {**nodes, **{g: _all_of(nodes[g]) for g in groups}},
                              deps, cost_ms))
    return DecisionReport(
        conditional=conditional,
        run_chance={nid: round(chance[nid], 4) for nid in conditional},
        groups=groups,
        expected_work_ms=sum(cost_ms[n] * chance[n] * share[n] for n in order),
        worst_case_work_ms=sum(cost_ms[n] * maps.get(n, 1) for n in order),
        maps=maps,
        expected_tokens=round(sum(tokens.get(n, 0.0) * chance[n] * share[n] for n in order)),
        worst_case_tokens=round(sum(tokens.get(n, 0.0) * maps.get(n, 1) for n in order)),
        critical_path_ms=round(max(_settled(order, nodes, finish).values(), default=0.0)
                               if critical_ms is None else critical_ms, 1),
        worst_case_critical_path_ms=round(max(worst.values(), default=0.0)
                                          if worst_ms is None else worst_ms, 1),
        conditional_on_critical_path=[n for n in conditional if n in critical])


def with_decisions(report: CompileReport, decisions: DecisionReport | None) -> CompileReport:
    """``report`` with its decisions section (its critical path already has groups
    resolving early; the worst case is in the section)."""
    return report.model_copy(update={"decisions": decisions})


def _all_of(node: Node) -> Node:
    """A group as if it waited for every member (the worst case)."""
    assert isinstance(node, GroupNode)
    return node.model_copy(update={"k": len(node.members)})


def _settled(order: Sequence[str], nodes: Mapping[str, Node],
             finish: Mapping[str, float]) -> dict[str, float]:
    """When each step is over: a member still going when its group resolves ends then."""
    over = dict(finish)
    for nid in order:
        node = nodes[nid]
        if isinstance(node, GroupNode):
            for m in node.members:
                over[m] = min(over[m], finish[nid])
    return over


def map_problems(node: Node, nodes: Mapping[str, Node]) -> list[str]:
    """What is wrong with a map: a list it runs over that is no list (an output without
    a list contract, a constant that is not a list), an agent step as its template."""
    if not isinstance(node, MapNode):
        return []
    where = f"map {node.id!r}"
    problems = [f"{where}: its step cannot be an agent step (tools); map over a plain "
                "llm step"] if node.step.tools else []
    target = nodes.get(node.over.ref)
    over = ".".join((node.over.ref, *node.over.path))
    types: set[str] | None = None  # unknown: a tool's output, a group's, a map's list
    if isinstance(target, InputNode):
        types = _value_types(target.value, node.over.path)
    elif isinstance(target, LLMNode):
        schema = target.contract.json_schema if target.contract else None
        sub = field_schema(schema, node.over.path)[0] if schema is not None else None
        types = {"string"} if schema is None else (schema_types(sub) if sub else None)
    if types is not None and "array" not in types:
        problems.append(f"{where} runs over {over}, which is not a list: give it a "
                        "contract whose field (or whole output) is a list, e.g. a "
                        "pydantic field `items: list[str]`")
    return problems


def group_problems(node: Node, nodes: Mapping[str, Node]) -> list[str]:
    """What is wrong with a group: members that are not llm or tool steps, a quorum
    field its members' contracts lack."""
    if not isinstance(node, GroupNode):
        return []
    where = f"group {node.id!r}"
    problems: list[str] = []
    for m in node.members:
        member = nodes.get(m)
        if member is None or m == node.id:
            continue  # dangling or self references: reported by dataflow
        if not isinstance(member, LLMNode | ToolNode):
            problems.append(f"{where}: member {m!r} is a {member.kind} node; members are "
                            "llm or tool steps")
        elif node.agree_on and isinstance(member, LLMNode):
            problems.extend(_agree_problems(node, member, where))
    return problems


def _agree_problems(group: GroupNode, member: LLMNode, where: str) -> list[str]:
    field_name = ".".join(group.agree_on)
    contract = member.contract
    if contract is None or contract.json_schema is None:
        return [f"{where} agrees on field {field_name!r}, but member {member.id!r} has no "
                "JSON contract (its output is text): give it output=<a pydantic model>, "
                "or agree on the whole output (agree_on=None)"]
    schema, missing = field_schema(contract.json_schema, group.agree_on)
    if schema is None:
        fields = sorted(contract.json_schema.get("properties") or {})
        return [f"{where} agrees on field {missing!r}, which the contract of member "
                f"{member.id!r} does not have (fields: {', '.join(fields) or 'none'})"]
    return []


def condition_problems(node: Node, nodes: Mapping[str, Node]) -> list[str]:
    """What is wrong with ``node``'s condition: fields its readers' contracts lack,
    values of the wrong type, labels outside a ``choices`` set.

    Args:
        node: any node (input nodes have no condition).
        nodes: the graph's nodes by id (unknown refs are reported elsewhere).
    """
    when = condition_of(node)
    if when is None:
        return []
    where = f"node {node.id!r}"
    problems: list[str] = []
    for leaf in leaves(when):
        target = nodes.get(str(leaf.ref))
        if target is None or target.id == node.id:
            continue  # dangling or self references: reported by dataflow
        if isinstance(target, InputNode):
            problems.extend(leaf_problems(leaf, _value_types(target.value, leaf.path),
                                          None, where))
        elif isinstance(target, LLMNode):
            problems.extend(_llm_leaf(leaf, target, where))
    return problems


def _llm_leaf(leaf: Predicate, target: LLMNode, where: str) -> list[str]:
    contract = target.contract
    if contract is not None and contract.json_schema is not None:
        schema, missing = field_schema(contract.json_schema, leaf.path)
        if schema is None:
            fields = sorted(contract.json_schema.get("properties") or {})
            return [f"{where}: condition {leaf.describe()} reads field {missing!r} of "
                    f"{target.id!r}, whose contract has no such field (fields: "
                    f"{', '.join(fields) or 'none'})"]
        return leaf_problems(leaf, schema_types(schema), None, where)
    if leaf.path:
        return []  # a field of a text output: reported by dataflow (give it a contract)
    if contract is not None and contract.choices:
        return leaf_problems(leaf, None, contract.choices, where)
    return leaf_problems(leaf, {"string"}, None, where)  # text or a regex: a string


def _value_types(value: object, path: tuple[str, ...]) -> set[str] | None:
    for key in path:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return {json_type(value)}
