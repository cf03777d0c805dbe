"""``wf.map(step, items, max_items=...)``: one step per item of a list known at run time.

::

    with workflow("fan") as wf:
        plan = outline(topic)                                  # output=Outline(sections: list[str])
        drafts = wf.map(draft, plan.sections, topic, max_items=12)   # draft(section, topic)
        final = merge_drafts(drafts)                           # a reduce step reads the list

The step is recorded once, as a template whose first argument is the item (a Semantic
Variable: project fields of it, ``item.title``, as of any output); ``when=`` may be a
function of the item (``when=lambda item: field(item.keep)``) to run only some items,
the others left out of the list (or standing for ``default=``); the proxy makes one
step per item when the list is known (:mod:`flowlift.proxy.workflows.fanout`). The
result is a list-valued Semantic Variable: its value is the items' outputs in order,
each parsed like the step's output. An empty list gives an empty list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowlift.errors import UserError
from flowlift.graph import ITEM, MAX_MAP_ITEMS, LLMNode, MapNode
from flowlift.sdk.variables import SemanticVariable

if TYPE_CHECKING:
    from flowlift.sdk.workflow import Workflow


def map_step(wf: Workflow, step: Any, items: object, args: tuple[Any, ...],
             kwargs: dict[str, Any], *, max_items: int,
             name: str | None = None) -> SemanticVariable:
    """Record a map node (see the module docstring) and return its Semantic Variable.

    Raises:
        UserError: ``step`` is not a ``@step``, ``items`` not a step's output, or
            ``max_items`` not a whole number 1 to 10000.
    """
    from flowlift.sdk.steps import Step

    if not isinstance(step, Step):
        raise UserError(f"wf.map(): the step must be a @step function, not "
                        f"{type(step).__name__}", param="step")
    if not isinstance(items, SemanticVariable):
        raise UserError("wf.map(): items must be a step's output holding a list (a "
                        f"Semantic Variable), not {type(items).__name__}", param="items")
    if isinstance(max_items, bool) or not isinstance(max_items, int) \
            or not 1 <= max_items <= MAX_MAP_ITEMS:
        raise UserError(f"wf.map(): max_items={max_items!r} must be a whole number 1 to "
                        f"{MAX_MAP_ITEMS}: the most items the map may run", param="max_items")
    item = SemanticVariable(wf, ITEM, fields=None)
    when = kwargs.get("when")
    if callable(when) and not isinstance(when, SemanticVariable):
        kwargs = {**kwargs, "when": when(item)}  # a condition on the item's fields
    with wf.capturing() as recorded:
        step(item, *args, **kwargs)
    template = recorded[-1]
    assert isinstance(template, LLMNode)
    parse = wf.parser_of(template.id)
    node = MapNode(id=wf.new_id(name or f"map_{step.name}"), name=name or step.name,
                   over=items.ref, step=template, max_items=max_items)
    return wf.add_node(node, parse=None if parse is None else _each(parse), fields=None)


def _each(parse: Any) -> Any:
    def parse_list(raw: Any) -> list[Any]:
        return [parse(x) for x in raw]
    return parse_list
