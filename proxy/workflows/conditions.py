"""Skipped steps: conditions (``when``) decided on the proxy, and skips that propagate.

A step with a ``when`` condition (:mod:`flowlift.predicates`) runs only when it holds,
evaluated as soon as the outputs it reads are known (before the step's other inputs:
a branch that is not taken never waits for them). A step that is not taken is
**skipped**: a state of its own, not a failure (the run still succeeds), logged as
``step.skipped`` ``{step_id, reason, trace, value?}``.

Propagation: a skipped step that declares a ``default`` stands for that value (its
readers run with it; ``value`` in its event). Without one, a step that reads it
directly (a prompt hole, a tool argument, a condition field) is skipped too, and an item
of a list argument (``tool([a, b, c])``) that is skipped is left out of the list, so a
step that gathers several branches runs with those that ran and is skipped only when all
of them were.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from flowlift.decisions import needed_inputs
from flowlift.graph import Node, Ref, condition_of, condition_refs, project
from flowlift.predicates import PredicateFailed, evaluate

SKIPPED: Final = "step.skipped"


def condition_deps(node: Node) -> frozenset[str]:
    """The steps ``node``'s condition reads (waited for before its other inputs)."""
    when = condition_of(node)
    return frozenset() if when is None else frozenset(r.ref for r in condition_refs(when))


def _gone(ref: Any, outputs: Mapping[str, Any], skipped: Mapping[str, str]) -> bool:
    """A reference to a step skipped without a default: no value to read."""
    return isinstance(ref, Ref) and ref.ref in skipped and ref.ref not in outputs


def skip_for_condition(node: Node, outputs: Mapping[str, Any],
                       skipped: Mapping[str, str]) -> str | None:
    """Why ``node`` is skipped by its condition (None: it runs), its condition's
    inputs all known.

    Raises:
        PredicateFailed: the condition cannot be evaluated (a field missing from an
            output, values that do not compare).
    """
    when = condition_of(node)
    if when is None:
        return None
    unread = sorted(d for d in condition_deps(node) if d in skipped and d not in outputs)
    if unread:
        return f"its condition reads skipped step {unread[0]!r}"
    if evaluate(when, lambda ref, path: project(outputs[ref], path)):
        return None
    return f"condition {when.describe()} is false"


def skip_for_inputs(node: Node, outputs: Mapping[str, Any],
                    skipped: Mapping[str, str]) -> str | None:
    """Why ``node`` is skipped because inputs it needs were skipped without a default
    (None: it runs), its inputs all known. A list argument all of whose items were
    skipped counts as needed; one with some left runs without the skipped ones."""
    needed, lists = needed_inputs(node)
    for ref in needed:
        if _gone(ref, outputs, skipped):
            return f"input {ref.ref!r} was skipped"
    for items in lists:
        if items.items and all(_gone(i, outputs, skipped) for i in items.items):
            return "every item of its list argument was skipped"
    return None


def kept_items(items: Iterable[Any], outputs: Mapping[str, Any],
               skipped: Mapping[str, str]) -> list[Any]:
    """The items of a list argument whose value exists (skipped ones without a default
    are left out)."""
    return [i for i in items if not _gone(i, outputs, skipped)]


__all__ = ["SKIPPED", "PredicateFailed", "condition_deps", "kept_items", "skip_for_condition",
           "skip_for_inputs"]
