"""The research agent's two tools as plain functions over the ``stdlib_docs`` corpus:
the app's ``@tool`` functions call them (examples/agents/research.py), the proxy runs
them itself as configured callables (examples/agents/proxy_tools.toml) or through the
MCP server examples/agents/docs_mcp.py."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Annotated

from pydantic import Field

if __package__ in (None, ""):  # imported by path: make `examples.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.stdlib_docs.corpus import Document, load_documents
from examples.stdlib_docs.index import BM25Index

READ_CHARS = 600

# Short arguments: a small model repeats itself, and a tool call cut by max_tokens is
# no call at all; the engine's constrained decoding keeps strings within these bounds.
Query = Annotated[str, Field(min_length=1, max_length=48)]
ModuleName = Annotated[str, Field(min_length=1, max_length=24)]


@functools.cache
def corpus() -> dict[str, Document]:
    """The ``stdlib_docs`` corpus by module name (read once)."""
    return {d.name: d for d in load_documents()}


@functools.cache
def corpus_index() -> BM25Index:
    return BM25Index({name: d.text for name, d in corpus().items()})


def first_sentence(text: str, limit: int = 160) -> str:
    """The text's first sentence (or line), at most ``limit`` characters."""
    head = re.split(r"(?<=[.!?])\s|\n\n", text.strip(), maxsplit=1)[0]
    return " ".join(head.split())[:limit]


def search(query: Query) -> list[tuple[str, str]]:
    """Search the Python standard library's module documentation. Returns the 3 best
    matching modules as [module name, its first sentence] pairs."""
    return [(name, first_sentence(corpus()[name].text))
            for name, _ in corpus_index().search(query, k=3)]


def read(module: ModuleName) -> str:
    """Read the documentation of one module, by the name search returned."""
    doc = corpus().get(module.strip())
    if doc is None:  # a text result, not an exception: the model can try again
        return f"error: no module {module!r} in the docs; search first for its name"
    return doc.text[:READ_CHARS]
