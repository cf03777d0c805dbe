"""How long a contract's valid outputs can be, and whether they fit ``max_tokens``.

Pure code, no I/O: the compiler's warnings (:func:`size_warnings`) about steps whose
output will be cut off at ``max_tokens`` (``finish_reason: "length"``) and then fail
their contract -- the cause a retry at the same budget cannot change.

The bounds are found by building the smallest and the largest valid JSON document of a
schema and counting its tokens with the compiler's ``tokenize``: strings are filled to
``minLength`` / ``maxLength`` (or the bounds of their ``pattern`` or ``format``) with
prose-like words, arrays to ``minItems`` /
``maxItems``, objects hold their ``required`` properties (smallest) or all of them
(largest), an enum its shortest / longest member, ``anyOf`` / ``oneOf`` the smaller /
larger branch, local ``$ref`` pointers are followed. A string without ``maxLength``, an
array without ``maxItems``, or a schema that allows anything has no largest size: those
fields are named (``unbounded``) and count at their smallest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowlift.graph import LLMNode

Count = Callable[[str], int]
"""``text -> tokens`` (the compiler's tokenizer for the step's model)."""

_FILLER = "the output of this step is a short plain sentence about what the module does and "
_DEPTH = 12  # recursive schemas: deeper levels count as empty


@dataclass(frozen=True, slots=True)
class OutputSize:
    """Token bounds of a contract's valid outputs.

    Attributes:
        smallest_tokens: the smallest valid output.
        largest_tokens: the largest valid output, counting unbounded fields at their
            smallest (so a lower bound of the largest when ``unbounded`` is not empty).
        unbounded: fields with no size bound, as ``path: reason`` (``"tags: no
            maxLength"``... ``(root)`` for the whole output).
    """

    smallest_tokens: int
    largest_tokens: int
    unbounded: tuple[str, ...] = ()


@dataclass
class _Walk:
    root: dict[str, Any]
    unbounded: list[str] = field(default_factory=list)

    def note(self, path: str, why: str) -> None:
        entry = f"{path or '(root)'}: {why}"
        if entry not in self.unbounded:
            self.unbounded.append(entry)

    def build(self, schema: Any, big: bool, path: str = "", depth: int = 0) -> Any:
        """The smallest (``big`` False) or largest valid instance of ``schema``."""
        if not isinstance(schema, dict) or depth > _DEPTH:
            return None
        if "$ref" in schema:
            return self.build(self._resolve(schema["$ref"]), big, path, depth + 1)
        if "const" in schema:
            return schema["const"]
        if schema.get("enum"):
            return _pick(schema["enum"], big)
        branches = schema.get("anyOf") or schema.get("oneOf")
        if branches:
            return _pick([self.build(b, big, path, depth + 1) for b in branches], big)
        if schema.get("allOf"):
            return self.build(schema["allOf"][0], big, path, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            return _pick([self.build({**schema, "type": k}, big, path, depth + 1)
                          for k in kind], big)
        return self._typed(schema, kind, big, path, depth)

    def _typed(self, schema: dict[str, Any], kind: Any, big: bool, path: str,
               depth: int) -> Any:
        if kind == "string":
            return self._string(schema, big, path)
        if kind in ("integer", "number"):
            bounds = [abs(float(schema[k])) for k in ("maximum", "minimum") if k in schema]
            return int(max(bounds)) if big and bounds else (-123456789 if big else 0)
        if kind == "boolean":
            return False
        if kind == "null":
            return None
        if kind == "array" or "items" in schema:
            return self._array(schema, big, path, depth)
        if kind == "object" or "properties" in schema:
            return self._object(schema, big, path, depth)
        if big:
            self.note(path, "any JSON value")
        return None

    def _string(self, schema: dict[str, Any], big: bool, path: str) -> str:
        low, high = pattern_width(schema.get("pattern"))
        low = max(low, _FORMAT_WIDTH.get(schema.get("format", ""), 0))
        length = max(int(schema.get("minLength", 0)), low)
        if big:
            bounds = [b for b in (schema.get("maxLength"), high,
                                  _FORMAT_WIDTH.get(schema.get("format", ""))) if b is not None]
            if bounds:
                length = int(min(bounds))
            else:
                self.note(path, "no maxLength")
        return filler(length)

    def _array(self, schema: dict[str, Any], big: bool, path: str, depth: int) -> list[Any]:
        count = int(schema.get("minItems", 0))
        if big and "maxItems" in schema:
            count = int(schema["maxItems"])
        elif big:
            self.note(path, "no maxItems")
        item = self.build(schema.get("items", {}), big, f"{path}[]", depth + 1)
        return [item] * count

    def _object(self, schema: dict[str, Any], big: bool, path: str,
                depth: int) -> dict[str, Any]:
        props: dict[str, Any] = schema.get("properties", {})
        keys = list(props) if big else [k for k in schema.get("required", []) if k in props]
        if big and not props:
            self.note(path, "an object with no listed properties")
        return {k: self.build(props[k], big, f"{path}.{k}" if path else k, depth + 1)
                for k in keys}

    def _resolve(self, ref: str) -> Any:
        node: Any = self.root
        for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else ():
            if not isinstance(node, dict):
                return None
            node = node.get(part.replace("~1", "/").replace("~0", "~"))
        return node


_FORMAT_WIDTH = {"date": 10, "time": 21, "date-time": 32, "uuid": 36, "ipv4": 15,
                 "ipv6": 45, "duration": 32}
"""Longest common spellings of the JSON Schema string formats whose length is bounded."""


def filler(length: int) -> str:
    """``length`` characters of prose-like words (what a string of that length costs)."""
    return (_FILLER * (length // len(_FILLER) + 1))[:length]


def pattern_width(pattern: str | None) -> tuple[int, int | None]:
    """Shortest and longest match of a regular expression, in characters (longest
    ``None``: unbounded, or no pattern); ``(0, None)`` for a pattern Python cannot parse."""
    if not pattern:
        return 0, None
    from re import _constants, _parser  # the stdlib's own parse tree of the pattern

    try:
        low, high = _parser.parse(pattern).getwidth()
    except (re.error, RecursionError, OverflowError):
        return 0, None
    return int(low), None if high >= _constants.MAXREPEAT else int(high)


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False))


def _pick(values: Sequence[Any], big: bool) -> Any:
    return (max if big else min)(values, key=_size)


def schema_size(schema: dict[str, Any], count: Count) -> OutputSize:
    """Token bounds of the JSON documents valid under ``schema``."""
    walk = _Walk(schema)
    small = walk.build(schema, big=False)
    large = walk.build(schema, big=True)
    return OutputSize(count(json.dumps(small, ensure_ascii=False)),
                      count(json.dumps(large, ensure_ascii=False)), tuple(walk.unbounded))


def size_warnings(node: LLMNode, count: Count) -> list[str]:
    """Why ``node``'s output may not fit its ``max_tokens`` (empty when it fits, when no
    ``max_tokens`` is set, or when the output is free text or a regex).

    Warned: a label longer than ``max_tokens``; a JSON contract whose smallest valid
    output does not fit (every answer is cut off), or whose largest does not (long
    answers are); an unbounded output only when even its bounded part takes more than
    half the budget.
    """
    budget = node.params.max_tokens
    contract = node.contract
    if budget is None or contract is None:
        return []
    where = f"step {node.id!r}"
    if contract.choices is not None:
        longest = max(contract.choices, key=lambda c: count(c))
        if count(longest) > budget:
            return [f"{where}: its label {longest[:40]!r} takes about {count(longest)} tokens, "
                    f"more than max_tokens={budget}: it would be cut off; raise max_tokens"]
        return []
    if contract.regex is not None:
        low, _ = pattern_width(contract.regex)
        need = count(filler(low))
        if need > budget:
            return [f"{where}: even the shortest match of its regex takes about {need} tokens, "
                    f"more than max_tokens={budget}: every answer will be cut off and fail "
                    "its contract; raise max_tokens"]
        return []
    if contract.json_schema is None:
        return []
    size = schema_size(contract.json_schema, count)
    open_ = f" ({'; '.join(size.unbounded[:3])})" if size.unbounded else ""
    if size.smallest_tokens > budget:
        return [f"{where}: even the smallest valid output of its contract takes about "
                f"{size.smallest_tokens} tokens, more than max_tokens={budget}: every answer "
                "will be cut off (finish_reason 'length') and fail its contract; raise "
                "max_tokens"]
    if size.largest_tokens > budget:
        more = " at least" if size.unbounded else ""
        return [f"{where}: the largest valid output of its contract takes{more} about "
                f"{size.largest_tokens} tokens, more than max_tokens={budget}{open_}: a long "
                "answer will be cut off (finish_reason 'length') and fail its contract; "
                f"raise max_tokens to {size.largest_tokens} or bound the schema (maxLength, "
                "maxItems)"]
    if size.unbounded and 2 * size.largest_tokens > budget:
        return [f"{where}: its contract's output has no size bound{open_} and its bounded "
                f"part already takes about {size.largest_tokens} of max_tokens={budget}: a "
                "long answer will be cut off; bound the schema (maxLength, maxItems) or "
                "raise max_tokens"]
    return []


__all__ = ["OutputSize", "filler", "pattern_width", "schema_size", "size_warnings"]
