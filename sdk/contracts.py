"""Turning a step's ``output=`` into a graph contract, and raw outputs back into values.

Supported: a pydantic model class (JSON Schema, parsed back into the model), a
``Literal[...]`` or ``Enum`` (a fixed label set), a JSON Schema ``dict``, a regular
expression (``re.compile(...)`` or :class:`Regex`; the whole output must match), or
``None`` (plain text).
"""

from __future__ import annotations

import enum
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from flowlift.errors import UserError
from flowlift.graph import Contract


@dataclass(frozen=True, slots=True)
class Regex:
    """A regex contract: the step's whole output must match ``pattern``
    (``re.fullmatch``; vLLM constrains decoding to it).

    Raises:
        UserError: when ``pattern`` does not compile.
    """

    pattern: str

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise UserError(f"output=Regex({self.pattern!r}) does not compile: {exc}",
                            param="output") from None


@dataclass(frozen=True, slots=True)
class OutputSpec:
    contract: Contract | None
    parse: Callable[[Any], Any]
    fields: frozenset[str] = frozenset()


def _identity(value: Any) -> Any:
    return value


def output_spec(output: Any) -> OutputSpec:
    """Build the contract and parser of ``output``.

    Raises:
        UserError: for an ``output=`` that is none of the supported kinds.
    """
    if output is None or output is str:
        return OutputSpec(None, _identity)
    if isinstance(output, type) and issubclass(output, BaseModel):
        schema = output.model_json_schema()
        return OutputSpec(Contract(json_schema=schema), output.model_validate,
                          frozenset(output.model_fields))
    if isinstance(output, type) and issubclass(output, enum.Enum):
        labels = tuple(str(m.value) for m in output)
        return OutputSpec(Contract(choices=labels), lambda v: output(v))
    if typing.get_origin(output) is typing.Literal:
        labels = tuple(str(a) for a in typing.get_args(output))
        return OutputSpec(Contract(choices=labels), _identity)
    if isinstance(output, dict):
        return OutputSpec(Contract(json_schema=output), _identity)
    if isinstance(output, re.Pattern):
        if output.flags & ~re.UNICODE:
            raise UserError("regex flags do not travel in a contract: write them inline, "
                            "e.g. re.compile('(?i)yes|no')", param="output")
        output = Regex(output.pattern)
    if isinstance(output, Regex):
        return OutputSpec(Contract(regex=output.pattern), _identity)
    raise UserError(f"unsupported step output {output!r}: use a pydantic model, "
                    "Literal['a', 'b'], an Enum, a JSON Schema dict, re.compile(...) / "
                    "Regex('...'), or None for text",
                    param="output")
