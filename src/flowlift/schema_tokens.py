"""How many tokens a JSON value can take under its schema, and a field's sub-schema: the
compiler's output-length bounds from contracts (:mod:`flowlift.compiler`), pure."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

CHARS_PER_TOKEN = 4.0  # English text in a BPE vocabulary, for bounds given in characters
SCALAR_TOKENS = {"integer": 3.0, "number": 4.0, "boolean": 1.0, "null": 1.0}


def schema_tokens(schema: Any, count: Callable[[str], float], depth: int = 0) -> float | None:
    """The most tokens a JSON value valid under ``schema`` can take, when the schema bounds
    it (``enum``/``const``, strings with ``maxLength``, numbers, arrays with ``maxItems``
    of bounded items, objects of bounded properties; ``anyOf``/``oneOf``: the largest);
    None when it does not. ``count``: text -> tokens."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return max((count(json.dumps(v)) for v in values), default=1.0)
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives:
        sizes = [schema_tokens(a, count, depth + 1) for a in alternatives]
        return None if None in sizes else max(s for s in sizes if s is not None)
    kind = schema.get("type")
    if kind == "string":
        cap = schema.get("maxLength")
        return None if cap is None else float(cap) / CHARS_PER_TOKEN + 2.0
    if kind in SCALAR_TOKENS:
        return SCALAR_TOKENS[kind]
    if kind == "array":
        item = schema_tokens(schema.get("items"), count, depth + 1)
        most = schema.get("maxItems")
        return None if item is None or most is None else 2.0 + most * (item + 1.0)
    props = schema.get("properties")
    if kind == "object" and isinstance(props, dict):
        sizes = [schema_tokens(p, count, depth + 1) for p in props.values()]
        if None in sizes:
            return None
        return 2.0 + sum((s or 0.0) + count(json.dumps(k)) + 1.0 for k, s in
                         zip(props, sizes, strict=True))
    return None


def field_schema(schema: Any, path: Sequence[str]) -> tuple[Any, int]:
    """The sub-schema at ``path`` (``properties`` / ``items``) and how many fields share
    the last level with it (1 for a list item); ``(None, n)`` where the schema stops."""
    fields = 1
    for key in path:
        if not isinstance(schema, dict):
            return None, fields
        props = schema.get("properties")
        if isinstance(props, dict):
            fields = max(len(props), 1)
            schema = props.get(key)
        elif schema.get("type") == "array" or "items" in schema:
            fields = 1
            schema = schema.get("items")
        else:
            return None, fields
    return schema, fields
