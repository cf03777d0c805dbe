"""The example's source text: module docstrings of the Python standard library.

Every CPython installation ships its standard library with documentation strings, so
this corpus is real, public, human-written technical text that is available offline
on every machine (Python Software Foundation License). Each document is the module's
docstring (``inspect.getdoc``), cut to its first ~1,200 characters at a paragraph or
sentence boundary so that a prompt stays around 300-350 tokens.

``MODULES`` pairs each module with the documentation area a maintainer would file it
under. The pipeline never shows these labels to the model; they are a reference to
compare the ``classify`` step's answers with.
"""

from __future__ import annotations

import importlib
import inspect
import platform
import re
import typing
from dataclasses import dataclass, field
from typing import Literal

Area = Literal[
    "data formats",
    "text processing",
    "networking",
    "files and processes",
    "developer tools",
    "math and algorithms",
]
AREAS: tuple[str, ...] = typing.get_args(Area)

# Chosen because their docstrings (CPython 3.11-3.13) are several sentences of real
# description, not one-liners. Order: grouped by reference area.
MODULES: dict[str, str] = {
    # data formats
    "json": "data formats",
    "csv": "data formats",
    "configparser": "data formats",
    "plistlib": "data formats",
    "struct": "data formats",
    "wave": "data formats",
    "zlib": "data formats",
    "lzma": "data formats",
    # text processing
    "re": "text processing",
    "difflib": "text processing",
    "string": "text processing",
    "gettext": "text processing",
    "locale": "text processing",
    "pprint": "text processing",
    # networking
    "socket": "networking",
    "socketserver": "networking",
    "http.server": "networking",
    "smtplib": "networking",
    "ftplib": "networking",
    "urllib.parse": "networking",
    "urllib.request": "networking",
    "xmlrpc.client": "networking",
    # files and processes
    "tempfile": "files and processes",
    "fnmatch": "files and processes",
    "os.path": "files and processes",
    "io": "files and processes",
    "subprocess": "files and processes",
    "sched": "files and processes",
    # developer tools
    "argparse": "developer tools",
    "getopt": "developer tools",
    "cmd": "developer tools",
    "ast": "developer tools",
    "inspect": "developer tools",
    "typing": "developer tools",
    "unittest": "developer tools",
    "timeit": "developer tools",
    "tokenize": "developer tools",
    # math and algorithms
    "statistics": "math and algorithms",
    "heapq": "math and algorithms",
    "random": "math and algorithms",
    "colorsys": "math and algorithms",
    "uuid": "math and algorithms",
}

MAX_CHARS = 1200
MAX_TOKENS = 320  # estimated (see estimate_tokens); dense docstrings get cut shorter
MIN_CHARS = 300  # shorter docstrings (a changed Python version) are skipped
LICENSE = "Python Software Foundation License (the docstrings ship with CPython)"


@dataclass(frozen=True, slots=True)
class Document:
    """One module's documentation.

    Attributes:
        name: the module's import name (``"urllib.parse"``).
        text: its docstring, cut to at most :data:`MAX_CHARS` characters.
        source: where the text comes from.
        reference_area: the area the module belongs to (one of :data:`AREAS`), for
            checking the pipeline's classification; never shown to the model.
    """

    name: str
    text: str
    source: str = ""
    reference_area: str = field(default="")

    @property
    def approx_tokens(self) -> int:
        """A rough token count (4 characters a token)."""
        return len(self.text) // 4


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate of a BPE token count.

    Words count 1.2 tokens, every digit and punctuation character one: closer than
    ``len(text) / 4`` for docstrings full of code, tables and directory listings.
    """
    words = len(re.findall(r"[A-Za-z]+", text))
    symbols = len(re.findall(r"[^\sA-Za-z]", text))
    return round(1.2 * words + symbols)


def _normalise(text: str) -> str:
    """Trim line ends, squeeze runs of spaces and ruler characters, at most one blank line.

    Docstrings indent their examples and draw ``=====`` rules; squeezing them keeps
    the text readable and saves prompt tokens.
    """
    lines = [re.sub(r"([=~*_-])\1{4,}", r"\1\1\1\1", re.sub(r" {3,}", "  ", line.rstrip()))
             for line in text.strip().splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def _drop_dangling_heading(text: str) -> str:
    """Remove a last paragraph that is only a heading ("Example:", "Notes\n----")."""
    head, sep, last = text.rpartition("\n\n")
    lines = last.splitlines()
    heading = (len(lines) == 1 and last.endswith(":")) or (
        len(lines) == 2 and re.fullmatch(r"[=~*_-]+", lines[1]) is not None)
    return head if sep and heading else text


def truncate(text: str, limit: int = MAX_CHARS) -> str:
    """Cut ``text`` to at most ``limit`` characters at the best boundary available.

    Whole paragraphs first; when that keeps less than half the budget, the last line
    that ends a sentence, then the last sentence end, then the last line end, then
    the last space.
    """
    text = _normalise(text)
    if len(text) <= limit:
        return text
    kept = ""
    for para in text.split("\n\n"):
        candidate = f"{kept}\n\n{para}" if kept else para
        if len(candidate) > limit:
            break
        kept = candidate
    half = limit // 2
    if len(kept) >= half:
        return _drop_dangling_heading(kept)
    head = text[:limit + 1]  # + 1: a boundary right at the limit counts
    for pattern in (r"[.!?:]\n", r"[.!?](?=\s)", r"\n", r" "):
        ends = [m.start() + 1 for m in re.finditer(pattern, head)
                if m.start() + 1 <= limit]
        if ends and (ends[-1] >= half or pattern == " "):
            return _drop_dangling_heading(head[:ends[-1]].rstrip())
    return head[:limit]


def load_documents(limit: int | None = None) -> list[Document]:
    """The corpus, in :data:`MODULES` order.

    Args:
        limit: keep only the first ``limit`` documents (``None``: all of them).

    Modules that cannot be imported or whose docstring is shorter than
    :data:`MIN_CHARS` on this Python are skipped.
    """
    version = platform.python_version()
    docs: list[Document] = []
    for name, area in MODULES.items():
        if limit is not None and len(docs) >= limit:
            break
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        raw = inspect.getdoc(module) or ""
        if len(raw.strip()) < MIN_CHARS:
            continue
        text, chars = truncate(raw), MAX_CHARS
        while estimate_tokens(text) > MAX_TOKENS and chars > MIN_CHARS:
            chars -= 100
            text = truncate(raw, chars)
        docs.append(Document(
            name=name,
            text=text,
            source=f"Python {version} standard library, module docstring of {name}",
            reference_area=area,
        ))
    return docs


if __name__ == "__main__":
    for doc in load_documents():
        print(f"{doc.name:16} {len(doc.text):5} chars ~{doc.approx_tokens:4} tokens  "
              f"{doc.reference_area}")
