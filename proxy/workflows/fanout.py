"""Dynamic fan-out: a map node becomes one step per item once its list is known.

A :class:`~flowlift.graph.MapNode` names a list-valued output (``over``) and an llm
step template reading the item as ``{"ref": "$item"}``. When the list is known the
proxy checks it (a list, at most ``max_items`` long: else the map fails naming both)
and grows the run by, per item ``i``, an input node ``<map>-<i>-item`` holding the item
and the step ``<map>-<i>`` (the template with ``$item`` renamed to that input): plain
steps from then on, so the compiler consolidates them like a static batch (shared
prefixes warmed once, identical calls merged, critical-path priorities). The map's
value is the list of the item steps' outputs in order (items skipped by the template's
``when`` left out, unless the template has a ``default``); an item step that fails
fails the map. An empty list is an empty list.

Durable without extra state: the items and the item steps' ids are a function of the
``over`` output, so a run resumed after a restart expands the same steps again, and
those that had finished keep their outputs (``step.finished`` in the log) and are not
run again. ``map.expanded`` ``{step_id, items, steps}`` records each expansion.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from flowlift.dataflow import map_item_ids
from flowlift.errors import StepFailed
from flowlift.graph import ITEM, InputNode, LLMNode, MapNode, Node

EXPANDED: Final = "map.expanded"


def item_ids(node: MapNode, count: int) -> list[str]:
    """The ids of the item steps of a map over ``count`` items, in order (the planner
    finds them by the same names: :func:`flowlift.dataflow.expanded_maps`)."""
    return map_item_ids(node.id, count)


def _input_id(step_id: str) -> str:
    return f"{step_id}-item"


def grown_ids(step_ids: Iterable[str]) -> list[str]:
    """Every node id a map's expansion added, from its item steps' ids (a ``map.expanded``
    event's ``steps``): each item's input node and its step, as :func:`expand` makes them."""
    return [i for sid in step_ids for i in (_input_id(sid), sid)]


def check_items(node: MapNode, value: Any) -> list[Any]:
    """The items a map runs over.

    Raises:
        StepFailed: ``value`` is not a list, or it is longer than ``max_items``.
    """
    over = ".".join((node.over.ref, *node.over.path))
    if not isinstance(value, list):
        raise StepFailed(node.id, f"map {node.id!r} runs over {over}, which is a "
                         f"{type(value).__name__}, not a list")
    if len(value) > node.max_items:
        raise StepFailed(node.id, f"map {node.id!r}: {over} has {len(value)} items, more "
                         f"than its max_items={node.max_items}; raise max_items or make "
                         "the list shorter (a maxItems in its contract)")
    return value


def _renamed(data: Any, item_id: str) -> Any:
    if isinstance(data, dict):
        return {k: (item_id if k == "ref" and v == ITEM else _renamed(v, item_id))
                for k, v in data.items()}
    if isinstance(data, list):
        return [_renamed(v, item_id) for v in data]
    return data


def expand(node: MapNode, items: Sequence[Any]) -> list[Node]:
    """The nodes a map grows its run by: per item, its input node then its step."""
    template = node.step.model_dump(mode="json", by_alias=True)
    out: list[Node] = []
    for step_id, item in zip(item_ids(node, len(items)), items, strict=True):
        item_id = _input_id(step_id)
        out.append(InputNode(id=item_id, value=item))
        out.append(LLMNode.model_validate({**_renamed(template, item_id), "id": step_id,
                                           "name": node.step.name or node.name}))
    return out


def gathered(node: MapNode, ids: Sequence[str], outputs: dict[str, Any],
             failures: dict[str, str]) -> list[Any]:
    """The map's value once its item steps are done.

    Raises:
        StepFailed: an item step failed (the first, by item).
    """
    for i, step_id in enumerate(ids):
        if step_id in failures:
            raise StepFailed(node.id, f"map {node.id!r}: item {i} ({step_id}) failed: "
                             f"{failures[step_id]}")
    return [outputs[s] for s in ids if s in outputs]
