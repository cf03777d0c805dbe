"""``wf.first(...)`` and ``wf.quorum(...)``: sibling steps the proxy resolves early.

::

    with workflow("vote") as wf:
        votes = [answer(question, seed=i) for i in range(5)]    # output=Answer
        agreed = wf.quorum(*votes, k=3, agree_on="choice")      # 3 of 5 agree: done
        fast = wf.first(search_a(q), search_b(q))               # the first good one

The group is a graph node (:class:`~flowlift.graph.GroupNode`) whose value is the
winning member's output (a quorum: the first of the agreeing ones); the members still
queued or running when it resolves are cancelled on the proxy and end *skipped*
(:mod:`flowlift.proxy.workflows.groups`). In an open run the app may await the group
like any step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from flowlift.errors import UserError
from flowlift.graph import GroupNode
from flowlift.sdk.variables import SemanticVariable

if TYPE_CHECKING:
    from flowlift.sdk.workflow import Workflow


def _members(wf: Workflow, steps: Sequence[object], what: str) -> tuple[str, ...]:
    ids: list[str] = []
    for i, var in enumerate(steps):
        if not isinstance(var, SemanticVariable) or var.path:
            raise UserError(f"{what}: member {i} must be a step's whole output (a "
                            f"Semantic Variable), not {type(var).__name__}"
                            + (" field" if isinstance(var, SemanticVariable) else ""),
                            param="members")
        if var.step_id in ids:
            raise UserError(f"{what}: step {var.step_id!r} is listed twice",
                            param="members")
        ids.append(var.step_id)
    if not ids:
        raise UserError(f"{what}: give at least one step", param="members")
    return tuple(ids)


def group(wf: Workflow, mode: Literal["first", "quorum"], steps: Sequence[object], *,
          k: int = 1, agree_on: str | Sequence[str] | None = None,
          name: str | None = None) -> SemanticVariable:
    """Record a group node over ``steps`` and return its Semantic Variable (parsed and
    projected like its first member's output).

    Raises:
        UserError: no steps, a member that is not a step's whole output, a member twice,
            a ``k`` outside 1..len(steps).
    """
    what = f"wf.{mode}()"
    members = _members(wf, steps, what)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(members):
        raise UserError(f"{what}: k={k!r} must be a whole number 1 to {len(members)} (the "
                        "members given)", param="k")
    path = tuple(agree_on.split(".")) if isinstance(agree_on, str) else tuple(agree_on or ())
    node = GroupNode(id=wf.new_id(name or mode), name=name or mode, mode=mode,
                     members=members, k=k, agree_on=path)
    head = steps[0]
    assert isinstance(head, SemanticVariable)
    parse = wf.parser_of(head.step_id)
    return wf.add_node(node, parse=parse, fields=head._fields)
