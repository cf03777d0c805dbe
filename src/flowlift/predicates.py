"""Conditions on earlier outputs, as data: the ``when`` of a conditional step.

A predicate is a small tree the SDK builds with Python operators on a field reference
(:func:`flowlift.sdk.conditions.field`) and ships inside the graph; the proxy evaluates
it (:func:`evaluate`) once the outputs it reads are known. It is never code: only the
operators below exist, over JSON values read from step outputs.

Wire shape (one node of the tree)::

    {"op": "eq", "ref": "judge_1", "path": ["verdict"], "value": "yes"}   # == != < <= > >=
    {"op": "in", "ref": "route_1", "path": ["to"], "value": ["a", "b"]}    # membership
    {"op": "truthy", "ref": "check_1", "path": ["ok"]}                      # bool(field)
    {"op": "and", "args": [P, Q]}   {"op": "or", "args": [P, Q]}   {"op": "not", "args": [P]}

Ops: ``eq ne lt le gt ge`` compare the field with ``value``; ``in``: the field is one of
``value`` (a list); ``truthy``: Python truthiness of the field (a boolean field, a
non-empty list or string).

:func:`problems` checks a predicate against the contracts of the steps it reads (a field
the contract lacks, a value of the wrong JSON type, an order comparison on a non-number,
a label outside a ``choices`` contract): the graph errors of
:func:`flowlift.dataflow.validate`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

Op = Literal["eq", "ne", "lt", "le", "gt", "ge", "in", "truthy", "and", "or", "not"]
COMPARISONS: Final[Mapping[str, Callable[[Any, Any], bool]]] = {
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge}
SYMBOLS: Final = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
LOGICAL: Final = ("and", "or", "not")


class PredicateFailed(Exception):
    """A predicate could not be evaluated on the values it read (a field missing from
    the output, values that do not compare)."""


class Predicate(BaseModel):
    """One node of a condition tree (see the module docstring for the wire shape)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Op
    ref: str | None = Field(default=None, min_length=1)
    path: tuple[str, ...] = ()
    value: Any = None
    args: tuple[Predicate, ...] = ()

    @model_validator(mode="after")
    def _shape(self) -> Predicate:
        if self.op in LOGICAL:
            if self.ref is not None or self.path or self.value is not None:
                raise ValueError(f"predicate op {self.op!r} combines predicates: give "
                                 "`args` only (no ref, path or value)")
            if self.op == "not" and len(self.args) != 1:
                raise ValueError("predicate op 'not' takes exactly one predicate in args")
            if self.op != "not" and len(self.args) < 2:
                raise ValueError(f"predicate op {self.op!r} takes two or more predicates "
                                 "in args")
            return self
        if self.ref is None:
            raise ValueError(f"predicate op {self.op!r} reads a field: give `ref` (a step "
                             "id) and optionally `path`")
        if self.args:
            raise ValueError(f"predicate op {self.op!r} takes no args")
        if self.op == "in" and not isinstance(self.value, list):
            raise ValueError("predicate op 'in' needs a list `value` (the allowed values)")
        return self

    @model_serializer(mode="wrap")
    def _wire(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for key, empty in (("ref", None), ("path", ()), ("path", []), ("args", ()),
                               ("args", []), ("value", None)):
                if key in data and data[key] == empty and not (
                        key == "value" and self.op in COMPARISONS):
                    del data[key]
        return data

    def describe(self) -> str:
        """The condition in words, as the SDK spelled it (``judge_1.verdict == 'yes'``)."""
        if self.op == "not":
            return f"not ({self.args[0].describe()})"
        if self.op in ("and", "or"):
            return f" {self.op} ".join(f"({a.describe()})" for a in self.args)
        name = ".".join((str(self.ref), *self.path))
        if self.op == "truthy":
            return name
        if self.op == "in":
            return f"{name} in {self.value!r}"
        return f"{name} {SYMBOLS[self.op]} {self.value!r}"


def leaves(pred: Predicate) -> Iterator[Predicate]:
    """The field-reading nodes of a predicate, in order."""
    if pred.op in LOGICAL:
        for arg in pred.args:
            yield from leaves(arg)
    else:
        yield pred


def evaluate(pred: Predicate, read: Callable[[str, tuple[str, ...]], Any]) -> bool:
    """Whether ``pred`` holds.

    Args:
        pred: the condition.
        read: ``(step_id, path) -> value`` of an output field; raises ``KeyError`` (or
            ``IndexError``) when the field is missing.

    Raises:
        PredicateFailed: a field is missing, or the values do not compare (``None < 3``).
    """
    if pred.op == "not":
        return not evaluate(pred.args[0], read)
    if pred.op == "and":
        return all(evaluate(a, read) for a in pred.args)
    if pred.op == "or":
        return any(evaluate(a, read) for a in pred.args)
    assert pred.ref is not None
    try:
        value = read(pred.ref, pred.path)
    except (KeyError, IndexError) as exc:
        raise PredicateFailed(f"condition {pred.describe()}: the output of {pred.ref!r} "
                              f"has no field {exc}") from None
    if pred.op == "truthy":
        return bool(value)
    if pred.op == "in":
        return any(_same(value, v) for v in pred.value)
    if pred.op in ("eq", "ne"):
        return _same(value, pred.value) == (pred.op == "eq")
    try:
        return bool(COMPARISONS[pred.op](value, pred.value))
    except TypeError:
        raise PredicateFailed(f"condition {pred.describe()}: cannot compare "
                              f"{value!r} with {pred.value!r}") from None


def _same(a: Any, b: Any) -> bool:
    """Equality as JSON sees it: ``True`` is not ``1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


# -- checking against contracts ---------------------------------------------------------

def json_type(value: Any) -> str:
    """The JSON type name of a Python value (``integer`` for ints, ``number`` floats)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def field_schema(schema: dict[str, Any], path: tuple[str, ...]
                 ) -> tuple[dict[str, Any] | None, str | None]:
    """The sub-schema at ``path`` of a JSON Schema (following ``properties``, ``items``
    for digit keys, local ``$ref`` and one-branch ``anyOf``).

    Returns:
        ``(schema, None)``, or ``(None, missing field name)`` when the contract has no
        such field; ``({}, None)`` when the schema does not say (free-form object).
    """
    root = schema
    node: dict[str, Any] = schema
    for key in path:
        node = _deref(node, root)
        props = node.get("properties")
        if isinstance(props, dict) and key in props:
            node = props[key]
        elif key.isdigit() and isinstance(node.get("items"), dict):
            node = node["items"]
        elif isinstance(props, dict) or node.get("additionalProperties") is False:
            return None, key
        else:
            return {}, None
    return _deref(node, root), None


def _deref(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return target if isinstance(target, dict) else {}
    return node


def schema_types(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types a schema allows, or ``None`` when it does not say."""
    if "enum" in schema and isinstance(schema["enum"], list):
        return {json_type(v) for v in schema["enum"]}
    if "const" in schema:
        return {json_type(schema["const"])}
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {str(k) for k in kind}
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        out: set[str] = set()
        for branch in branches:
            types = schema_types(branch) if isinstance(branch, dict) else None
            if types is None:
                return None
            out |= types
        return out
    return None


def _fits(value_type: str, allowed: set[str]) -> bool:
    if value_type in allowed:
        return True
    return (value_type == "integer" and "number" in allowed) \
        or (value_type == "number" and "integer" in allowed)


def leaf_problems(leaf: Predicate, field_types: set[str] | None,
                  labels: tuple[str, ...] | None, where: str) -> list[str]:
    """What is wrong with comparing one field (of JSON types ``field_types``, ``None``:
    unknown; ``labels``: a ``choices`` contract's set) with the leaf's value."""
    name = ".".join((str(leaf.ref), *leaf.path))
    values = leaf.value if leaf.op == "in" else [leaf.value]
    if leaf.op == "truthy":
        return []
    if labels is not None:
        stray = [v for v in values if v not in labels]
        return [f"{where}: condition {leaf.describe()} compares {name} with "
                f"{', '.join(map(repr, stray))}, which is not one of its labels "
                f"({', '.join(labels)})"] if stray else []
    if field_types is None:
        return []
    if leaf.op in ("lt", "le", "gt", "ge") and not field_types & {"integer", "number",
                                                                   "string"}:
        return [f"{where}: condition {leaf.describe()} orders {name}, a "
                f"{'/'.join(sorted(field_types))} field: `<`/`>` need a number or string"]
    wrong = [v for v in values if not _fits(json_type(v), field_types)]
    if wrong:
        return [f"{where}: condition {leaf.describe()} compares {name} "
                f"({'/'.join(sorted(field_types))}) with {wrong[0]!r} "
                f"({json_type(wrong[0])}): give a value of the field's type"]
    return []


Predicate.model_rebuild()
