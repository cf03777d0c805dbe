"""Conditions for ``when=``: Python operators on a field reference, shipped as data.

::

    verdict = judge(answer)                       # output=Verdict (ok: bool, score: int)
    fix = repair.when(field(verdict.ok) == False, default="(no repair)")(answer)
    deep = dig.when((field(verdict.score) < 3) & field(verdict.topic).isin(["a", "b"]))(q)
    note = remark.when(verdict.ok)(answer)        # a variable alone: its truthiness

:func:`field` wraps a Semantic Variable (a step's output or a field of it) into a
:class:`FieldRef`; its comparisons (``== != < <= > >=``), :meth:`FieldRef.isin` and
:meth:`FieldRef.truthy` make a :class:`Condition`, and conditions combine with ``&``
(and), ``|`` (or) and ``~`` (not) -- Python's ``and``/``or``/``not`` cannot be
overloaded, so they raise with the fix. The result is a
:class:`~flowlift.predicates.Predicate` in the graph, evaluated by the proxy: never code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NoReturn

from pydantic import BaseModel

from flowlift.errors import SemanticVariableError, UserError
from flowlift.graph import Literal_
from flowlift.predicates import Predicate
from flowlift.sdk.variables import SemanticVariable

_NO_BOOL = ("a condition has no truth value while recording: combine conditions with "
            "`&` (and), `|` (or), `~` (not) -- not `and`/`or`/`not`/`if` -- and pass it "
            "as `when=`")


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, SemanticVariable | FieldRef | Condition):
        raise SemanticVariableError(f"{where}: a condition compares a field with a "
                                    "constant; comparing two outputs is not supported "
                                    "(compute the comparison in a step with a contract)")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise UserError(f"{where}: compare with a JSON constant (str, int, float, bool, "
                    f"None), not {type(value).__name__}", param="when")


class Condition:
    """A predicate over earlier outputs, built from :class:`FieldRef` operators.

    Attributes:
        predicate: the wire form (:class:`~flowlift.predicates.Predicate`).
    """

    __slots__ = ("predicate",)

    def __init__(self, predicate: Predicate) -> None:
        self.predicate = predicate

    def __and__(self, other: object) -> Condition:
        return Condition(Predicate(op="and", args=(self.predicate, as_predicate(other))))

    def __or__(self, other: object) -> Condition:
        return Condition(Predicate(op="or", args=(self.predicate, as_predicate(other))))

    def __invert__(self) -> Condition:
        return Condition(Predicate(op="not", args=(self.predicate,)))

    def __bool__(self) -> NoReturn:
        raise UserError(_NO_BOOL, param="when")

    def __repr__(self) -> str:
        return f"<Condition {self.predicate.describe()}>"


class FieldRef:
    """A step's output (or a field of it) that a condition reads. Made by :func:`field`."""

    __slots__ = ("path", "step_id")

    def __init__(self, var: SemanticVariable) -> None:
        self.step_id = var.step_id
        self.path = var.path

    def _cmp(self, op: str, value: Any) -> Condition:
        where = f"condition on {'.'.join((self.step_id, *self.path))}"
        return Condition(Predicate(op=op, ref=self.step_id, path=self.path,  # type: ignore[arg-type]
                                   value=_json_value(value, where)))

    def __eq__(self, value: object) -> Condition:  # type: ignore[override]
        return self._cmp("eq", value)

    def __ne__(self, value: object) -> Condition:  # type: ignore[override]
        return self._cmp("ne", value)

    def __lt__(self, value: object) -> Condition:
        return self._cmp("lt", value)

    def __le__(self, value: object) -> Condition:
        return self._cmp("le", value)

    def __gt__(self, value: object) -> Condition:
        return self._cmp("gt", value)

    def __ge__(self, value: object) -> Condition:
        return self._cmp("ge", value)

    def isin(self, values: Iterable[Any]) -> Condition:
        """The field is one of ``values`` (JSON constants): the ``in`` of a condition
        (Python's ``x in [...]`` asks the list, not the field, so it cannot be
        overloaded)."""
        where = f"condition on {'.'.join((self.step_id, *self.path))}"
        if isinstance(values, str):
            raise UserError(f"{where}: isin() takes a list of values, not a string",
                            param="when")
        return Condition(Predicate(op="in", ref=self.step_id, path=self.path,
                                   value=[_json_value(v, where) for v in values]))

    def truthy(self) -> Condition:
        """The field is true (a boolean field; a non-empty list or string)."""
        return Condition(Predicate(op="truthy", ref=self.step_id, path=self.path))

    def __invert__(self) -> Condition:
        return ~self.truthy()

    def __and__(self, other: object) -> Condition:
        return self.truthy() & other

    def __or__(self, other: object) -> Condition:
        return self.truthy() | other

    def __bool__(self) -> NoReturn:
        raise UserError(_NO_BOOL, param="when")

    __hash__ = None  # type: ignore[assignment]


def field(var: SemanticVariable) -> FieldRef:
    """The field reference of a step's output (``field(verdict.ok)``) for a condition.

    Raises:
        UserError: ``var`` is not a Semantic Variable.
    """
    if not isinstance(var, SemanticVariable):
        raise UserError(f"field() takes a step's output (a Semantic Variable), not "
                        f"{type(var).__name__}", param="when")
    return FieldRef(var)


def as_predicate(when: object) -> Predicate:
    """A ``when=`` value as its predicate: a :class:`Condition`, a :class:`FieldRef` or a
    Semantic Variable (its truthiness).

    Raises:
        UserError: anything else (a plain ``bool`` means the condition was evaluated
            in Python: build it from ``field(...)``).
    """
    if isinstance(when, Condition):
        return when.predicate
    if isinstance(when, FieldRef):
        return when.truthy().predicate
    if isinstance(when, SemanticVariable):
        return FieldRef(when).truthy().predicate
    raise UserError(f"when={when!r}: a condition is built from step outputs, e.g. "
                    "`when=field(verdict.label) == \"yes\"` (or a boolean output field "
                    "itself); a plain value cannot change on the proxy", param="when")


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Any = _NoDefault()
"""``default=`` not given: reading the skipped step raises
:class:`~flowlift.errors.StepWasSkipped`."""


class Conditional:
    """A step call's ``when=`` and ``default=``, checked and in wire form.

    Raises:
        UserError: a ``when`` that is no condition, or a ``default`` that is not JSON
            (nor a pydantic model).
    """

    __slots__ = ("default", "predicate")

    def __init__(self, when: object, default: Any = NO_DEFAULT) -> None:
        self.predicate = None if when is None else as_predicate(when)
        self.default = default
        if default is not NO_DEFAULT:
            _json_default(default)

    def node_fields(self) -> dict[str, Any]:
        """``when`` and ``default`` of the graph node."""
        return {"when": self.predicate,
                "default": None if self.default is NO_DEFAULT
                else Literal_(value=_json_default(self.default))}

    def recorded(self, wf: Any, step_id: str) -> None:
        """Tell the workflow the Python default of step ``step_id``."""
        if self.default is not NO_DEFAULT:
            wf.set_default(step_id, self.default)


def _json_default(default: Any) -> Any:
    if isinstance(default, BaseModel):
        return default.model_dump(mode="json")
    if isinstance(default, SemanticVariable | FieldRef | Condition):
        raise UserError("default= is a constant the skipped step stands for, not a "
                        "Semantic Variable", param="default")
    try:
        json.dumps(default)
    except (TypeError, ValueError):
        raise UserError(f"default={default!r}: give a JSON value (or a pydantic model "
                        "instance) for the skipped step to stand for",
                        param="default") from None
    return default


def pop_conditional(kwargs: dict[str, Any], takes: frozenset[str]) -> Conditional | None:
    """Take ``when=`` / ``default=`` out of a step call's keywords, unless the function
    itself has parameters so named (``takes``; then use ``step.when(...)``)."""
    when = kwargs.pop("when", None) if "when" not in takes else None
    default = kwargs.pop("default", NO_DEFAULT) if "default" not in takes else NO_DEFAULT
    if when is None and default is NO_DEFAULT:
        return None
    return Conditional(when, default)
