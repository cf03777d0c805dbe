"""Public test doubles (like ``structlog.testing``): use them in your own tests.

:class:`FakeEngine` implements :class:`flowlift.local_engine.base.Engine` without a
model: deterministic outputs, streamed in chunks, honouring structured-output
constraints, with a simulated prefix cache so cached-token accounting can be tested.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from cachetools import LRUCache

from flowlift.errors import EngineError
from flowlift.local_engine.base import (
    Capabilities,
    Engine,
    GenerationChunk,
    GenerationRequest,
    Usage,
)

Responder = Callable[[GenerationRequest], str]


def example_for_pattern(pattern: str) -> str:
    """A short string matching ``pattern`` (a walk of the regex's parse tree: literals,
    classes, alternations, repeats at their minimum count)."""
    import re._constants as c  # type: ignore[import-not-found]
    import re._parser as p  # type: ignore[import-not-found]

    def category(cat: Any) -> str:
        return {c.CATEGORY_DIGIT: "0", c.CATEGORY_SPACE: " "}.get(cat, "a")

    def walk(items: Any) -> str:
        out = []
        for op, av in items:
            if op is c.LITERAL:
                out.append(chr(av))
            elif op is c.NOT_LITERAL:
                out.append("a" if chr(av) != "a" else "b")
            elif op is c.ANY:
                out.append("a")
            elif op is c.IN:
                out.append(in_class(av))
            elif op is c.BRANCH:
                out.append(walk(av[1][0]))
            elif op is c.SUBPATTERN:
                out.append(walk(av[-1]))
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                out.append(walk(av[2]) * max(av[0], 0))
            elif op is c.CATEGORY:
                out.append(category(av))
        return "".join(out)

    def in_class(av: Any) -> str:
        if av and av[0][0] is c.NEGATE:
            banned = {chr(x) for op, x in av[1:] if op is c.LITERAL}
            return next(ch for ch in "abcxyz0 " if ch not in banned)
        op, x = av[0]
        if op is c.LITERAL:
            return chr(x)
        if op is c.RANGE:
            return chr(x[0])
        return category(x)

    return walk(p.parse(pattern))


def example_for_schema(schema: dict[str, Any], root: dict[str, Any] | None = None) -> Any:
    """A small instance that satisfies ``schema`` (objects, arrays, enums, ``$ref``...)."""
    root = root or schema
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return example_for_schema(root.get("$defs", {})[name], root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return example_for_schema(schema[key][0], root)
    kind = schema.get("type", "object")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object":
        props = schema.get("properties", {})
        return {k: example_for_schema(props[k], root) for k in schema.get("required", props)}
    if kind == "array":
        item = schema.get("items", {"type": "string"})
        return [example_for_schema(item, root) for _ in range(schema.get("minItems", 1))]
    if kind == "string":
        if "pattern" in schema:
            return example_for_pattern(schema["pattern"])
        return "x" * max(1, schema.get("minLength", 1))
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    if kind == "boolean":
        return True
    return None


def default_responder(request: GenerationRequest) -> str:
    """Choices -> the first label; JSON Schema -> a minimal instance; text -> an echo."""
    import json

    c = request.constraint
    if c is not None and c.choices:
        return c.choices[0]
    if c is not None and c.json_schema is not None:
        return json.dumps(example_for_schema(c.json_schema))
    last = request.messages[-1].content if request.messages else ""
    return f"echo: {last}"


class FakeEngine(Engine):
    """A deterministic engine for tests.

    Args:
        models: model names served.
        responder: request -> full output text (default :func:`default_responder`).
        delay_s: sleep before each chunk (simulates decode time).
        chunk_chars: characters per streamed chunk.
        fail_with: if set, every request raises this error.

    Attributes:
        requests: every request received, in order.
        aborted: ids of requests closed before they finished.
    """

    capabilities = Capabilities(structured_outputs=True, prefix_caching=True, priorities=True)

    def __init__(self, models: Sequence[str] = ("fake-model",), *,
                 responder: Responder = default_responder, delay_s: float = 0.0,
                 chunk_chars: int = 4, fail_with: Exception | None = None) -> None:
        self._models = list(models)
        self.responder = responder
        self.delay_s = delay_s
        self.chunk_chars = chunk_chars
        self.fail_with = fail_with
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.started = False
        self._seen: LRUCache[tuple[str, ...], None] = LRUCache(maxsize=4096)

    @property
    def model_names(self) -> Sequence[str]:
        return self._models

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False

    def _cached(self, words: tuple[str, ...]) -> int:
        best = 0
        for seen in self._seen:
            n = 0
            for a, b in zip(seen, words, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self._seen[words] = None
        return best

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if request.model not in self._models:
            raise EngineError(f"fake engine does not serve {request.model!r}")
        self.requests.append(request)
        if self.fail_with is not None:
            raise self.fail_with
        words = tuple(" ".join(f"{m.role}: {m.content}" for m in request.messages).split())
        cached = self._cached(words)
        text = self.responder(request)
        out = text.split()
        limit = request.sampling.max_tokens
        finish = "stop"
        if limit is not None and len(out) > limit and not request.constraint:
            text, finish = " ".join(out[:limit]), "length"
        finished = False
        try:
            for i in range(0, max(len(text), 1), self.chunk_chars):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield GenerationChunk(text=text[i:i + self.chunk_chars])
            finished = True
            yield GenerationChunk(text="", finish_reason=finish,
                                  usage=Usage(len(words), len(text.split()), cached))
        finally:
            if not finished:
                self.aborted.append(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def count_tokens(self, model: str, text: str) -> int | None:
        return len(text.split())
