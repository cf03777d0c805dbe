"""The JSON Schema of a Python function's arguments, as a model's tool definition needs.

Shared by the SDK's ``@tool`` functions (:mod:`flowlift.sdk.agents`) and the proxy's
configured callables (:mod:`flowlift.proxy.tools.callables`): pydantic's ``TypeAdapter``
of the function (annotations, defaults, ``Annotated[..., Field(description=...)]``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

from pydantic import PydanticSchemaGenerationError, TypeAdapter

_NOT_BY_NAME = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)


class NoSchema(ValueError):
    """A function a model cannot call: ``str(exc)`` says why and what to change."""


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``fn``'s keyword arguments.

    Raises:
        NoSchema: a positional-only or ``*args`` parameter (a model passes arguments by
            name), or an annotation pydantic cannot describe.
    """
    for p in inspect.signature(fn).parameters.values():
        if p.kind in _NOT_BY_NAME:
            raise NoSchema(f"parameter {p.name!r} cannot be passed by name; a model calls "
                           "tools with named arguments")
    try:
        return TypeAdapter(cast(Any, fn)).json_schema()  # a function: its arguments
    except (PydanticSchemaGenerationError, TypeError, NameError) as exc:
        raise NoSchema(f"its arguments have no JSON Schema ({exc}); annotate them with "
                       "JSON-able types or pydantic models defined at module level") from None
