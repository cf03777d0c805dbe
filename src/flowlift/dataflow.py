"""Pure planning over a graph: dependencies from dataflow, validation, parallel levels.

No I/O here. Validation collects *every* problem (duplicate ids, dangling references,
cycles, unknown models, unusable contracts) so an invalid graph is rejected whole.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection, Mapping

import jsonschema
from jsonschema.exceptions import SchemaError

from flowlift.decisions import condition_problems, group_problems, map_problems
from flowlift.errors import GraphError
from flowlift.graph import Graph, InputNode, LLMNode, MapNode, Node, node_refs


def dependencies(graph: Graph) -> dict[str, frozenset[str]]:
    """Map node id -> ids of the nodes whose outputs it reads (a ref used twice counts once)."""
    return {node.id: frozenset(r.ref for r in node_refs(node)) for node in graph.nodes}


def map_item_ids(map_id: str, count: int) -> list[str]:
    """The ids of the item steps a map grows its run by, in order (each reads the input
    node ``<item step id>-item`` holding its item: :mod:`flowlift.proxy.workflows.fanout`)."""
    return [f"{map_id}-{i}" for i in range(count)]


def expanded_maps(graph: Graph) -> dict[str, list[str]]:
    """Map id -> the item steps the graph already holds for it (a run's grown graph;
    empty lists are left out): ``<map>-<i>`` llm steps with their ``<map>-<i>-item`` input
    node, counted from ``i = 0`` while both are there."""
    nodes = graph.node_map()
    out: dict[str, list[str]] = {}
    for node in graph.nodes:
        if not isinstance(node, MapNode):
            continue
        items: list[str] = []
        while True:
            step_id = f"{node.id}-{len(items)}"
            if not (isinstance(nodes.get(step_id), LLMNode)
                    and isinstance(nodes.get(f"{step_id}-item"), InputNode)):
                break
            items.append(step_id)
        if items:
            out[node.id] = items
    return out


def planning_dependencies(graph: Graph) -> dict[str, frozenset[str]]:
    """:func:`dependencies` as the planner sees time: an expanded map's item inputs come
    when the map's own inputs are there (its list is one of them), and the map is done
    when its item steps are. (The run itself needs no such edges: it adds the items only
    once the list is known, and the map waits for them.)"""
    deps = dependencies(graph)
    for map_id, steps in expanded_maps(graph).items():
        for step_id in steps:
            deps[f"{step_id}-item"] = deps[f"{step_id}-item"] | deps[map_id]
        deps[map_id] = deps[map_id] | frozenset(steps)
    return deps


def find_cycle(deps: Mapping[str, Collection[str]]) -> list[str] | None:
    """One dependency cycle as a list of ids (first id repeated at the end), or None."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(deps, white)
    for root in deps:
        if colour[root] != white:
            continue
        stack: list[tuple[str, list[str]]] = [(root, sorted(deps[root]))]
        path = [root]
        colour[root] = grey
        while stack:
            node, pending = stack[-1]
            if not pending:
                colour[node] = black
                stack.pop()
                path.pop()
                continue
            nxt = pending.pop()
            if nxt not in colour:
                continue
            if colour[nxt] == grey:
                return [*path[path.index(nxt):], nxt]
            if colour[nxt] == white:
                colour[nxt] = grey
                path.append(nxt)
                stack.append((nxt, sorted(deps[nxt])))
    return None


def levels(graph: Graph, deps: Mapping[str, Collection[str]] | None = None) -> list[list[str]]:
    """Parallel levels: level k holds nodes whose longest dependency chain has k edges.

    Raises:
        GraphError: when the graph has a cycle.
    """
    deps = deps if deps is not None else dependencies(graph)
    depth: dict[str, int] = {}
    remaining = dict(deps)
    while remaining:
        ready = [n for n, ds in remaining.items() if all(d in depth for d in ds)]
        if not ready:
            cycle = find_cycle(remaining) or list(remaining)
            raise GraphError([f"dependency cycle: {' -> '.join(cycle)}"])
        for n in ready:
            depth[n] = 1 + max((depth[d] for d in remaining[n]), default=-1)
            del remaining[n]
    out: list[list[str]] = [[] for _ in range(1 + max(depth.values(), default=-1))]
    for node in graph.nodes:
        out[depth[node.id]].append(node.id)
    return out


def _node_problems(node: Node, ids: Collection[str], nodes: Mapping[str, Node],
                   models: Collection[str] | None) -> list[str]:
    problems: list[str] = []
    if node.id in (".", ".."):  # URLs drop dot segments (RFC 3986 §5.2.4): a tool step
        problems.append(f"node id {node.id!r} cannot be addressed in a URL (its @tool "
                        "result route); use letters, digits, '-' or '_'")  # never answered
    for ref in node_refs(node):
        if ref.ref == node.id:
            problems.append(f"node {node.id!r} references its own output")
        elif ref.ref not in ids:
            problems.append(f"node {node.id!r} references unknown node {ref.ref!r} "
                            "(dangling reference)")
        elif ref.path and isinstance(nodes[ref.ref], LLMNode):
            target = nodes[ref.ref]
            assert isinstance(target, LLMNode)
            if target.contract is None or target.contract.json_schema is None:
                problems.append(f"node {node.id!r} reads field {'.'.join(ref.path)!r} of "
                                f"{ref.ref!r}, whose output is text (give it a JSON contract)")
    problems.extend(condition_problems(node, nodes))
    problems.extend(group_problems(node, nodes))
    problems.extend(map_problems(node, nodes))
    if isinstance(node, MapNode):
        problems.extend(_llm_problems(node.step, models))
    if isinstance(node, LLMNode):
        problems.extend(_llm_problems(node, models))
    return problems


def _llm_problems(node: LLMNode, models: Collection[str] | None) -> list[str]:
    problems: list[str] = []
    for model in dict.fromkeys(node.models()):
        if models is not None and model is not None and model not in models:
            problems.append(f"node {node.id!r} asks for unknown model {model!r} "
                            f"(served: {', '.join(sorted(models)) or 'none'})")
    regex = node.contract.regex if node.contract else None
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as exc:
            problems.append(f"node {node.id!r} has an invalid regex contract: {exc}")
        else:
            unsupported = _not_regular(regex)
            if unsupported:
                problems.append(f"node {node.id!r} has a regex contract with {unsupported}, "
                                "which constrained decoding cannot follow (a regular "
                                "expression only: no look-arounds or backreferences)")
    schema = node.contract.json_schema if node.contract else None
    if schema is not None:
        error = _schema_error(json.dumps(schema, sort_keys=True))
        if error is not None:
            problems.append(f"node {node.id!r} has an invalid JSON Schema contract: "
                            f"{error}")
    return problems


@functools.lru_cache(maxsize=256)
def _schema_error(schema_json: str) -> str | None:
    """Why a JSON Schema is invalid, or None (cached: batches repeat one schema)."""
    try:
        jsonschema.Draft202012Validator.check_schema(json.loads(schema_json))
    except SchemaError as exc:
        return exc.message
    return None


def validate(graph: Graph, models: Collection[str] | None = None) -> None:
    """Check a graph whole.

    Args:
        graph: the parsed graph.
        models: model names that may be asked for; ``None`` skips the check.

    Raises:
        GraphError: listing every problem found.
    """
    problems: list[str] = []
    seen: set[str] = set()
    for node in graph.nodes:
        if node.id in seen:
            problems.append(f"duplicate node id {node.id!r}")
        seen.add(node.id)
    nodes = graph.node_map()
    for node in graph.nodes:
        problems.extend(_node_problems(node, seen, nodes, models))
    deps = {n: {d for d in ds if d in seen} for n, ds in dependencies(graph).items()}
    cycle = find_cycle(deps)
    if cycle:
        problems.append(f"dependency cycle: {' -> '.join(cycle)}")
    if problems:
        raise GraphError(problems)


def _not_regular(pattern: str) -> str | None:
    """What in ``pattern`` is beyond a regular language (look-arounds, backreferences:
    what vLLM's grammar-based structured outputs reject), or ``None``."""
    from re import _constants as c
    from re import _parser  # the stdlib's own parse tree of the pattern

    names = {c.ASSERT: "a look-ahead/look-behind", c.ASSERT_NOT: "a negative look-around",
             c.GROUPREF: "a backreference", c.GROUPREF_EXISTS: "a conditional group"}
    stack = [_parser.parse(pattern)]
    while stack:
        for op, arg in stack.pop():
            if op in names:
                return names[op]
            for item in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(item, _parser.SubPattern):
                    stack.append(item)
                elif isinstance(item, (list, tuple)):
                    stack.extend(x for x in item if isinstance(x, _parser.SubPattern))
    return None

