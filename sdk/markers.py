"""Markers: the text a Semantic Variable writes into a prompt, and the check that refuses
any text derived from one other than the marker itself.

A marker is made only of characters that ordinary text does not contain::

    OPEN  m S  nonce  MID  payload (step id, path)  CLOSE

``OPEN``, ``MID``, ``CLOSE``, the nonce (the workflow's hex nonce, as bytes) and the
payload are characters of the Supplementary Private Use Area-B (U+10F000..U+10F1FF: one
character per byte); ``m S`` are a small and a capital letter of Medefaidrin
(U+16E40..U+16E9F), a script whose case changes under ``upper()``, ``lower()``,
``title()``, ``swapcase()``, ``casefold()`` and ``capitalize()``. So every character of
a marker is recognisable on its own: a slice (``[:10]``, ``{:.10}``, ``%.10s``), a
split, a case change, a ``replace`` that touches it leaves characters that are not
inside a whole marker, and :func:`split_prompt` refuses them with
:class:`~flowlift.errors.SemanticVariableError` naming the step and, when it can tell,
the operation. The repr of a variable (``<SemanticVariable ...>``, as ``{v!r}`` or a
printed list writes it) and the escaped form of a marker (``repr()``/``ascii()`` of a
string holding one: ``\\U0010f000``; also ``json.dumps``' ``\\udbfc\\udc00``, a
percent-encoded or ``&#x...;`` form, ``str()`` of its UTF-8 bytes, and those escaped
again, up to six deep) are refused the same way, in any case.

``str(v)`` returns a :class:`MarkerText`: the marker as a ``str`` subclass whose
string-changing methods (``upper``, ``strip``, slicing, ``split``, ``replace``,
``encode`` ...) raise at once with the operation's name; its repr is
``<SemanticVariable marker of step 'x'>``, refused in prompts as a variable's repr is.
Concatenation, ``join``, f-strings and ``%s`` keep it whole and work.

A variable that a step's prompt function formatted into text but that its prompt no
longer holds (cut off whole by ``prompt[:4000]``, say) is refused too (:func:`check_kept`).

Limits: in the workflow body (tool arguments), a cut that drops a marker whole leaves no
trace; so do a lossy conversion (``encode("ascii", "ignore")``) and a slice of a marker's
*escaped* form (``repr(s)[3:5]``). User text that itself holds these characters is
refused.
"""

from __future__ import annotations

import contextvars
import html
import re
import urllib.parse
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NoReturn, SupportsIndex

from flowlift.errors import SemanticVariableError
from flowlift.graph import Part, Ref, Text

_BASE = 0x10F000
OPEN = chr(_BASE)
CLOSE = chr(_BASE + 1)
MID = chr(_BASE + 2)
_BYTE0 = _BASE + 0x100                   # payload byte b is chr(_BYTE0 + b)
_CASED = "\U00016e60\U00016e41"          # MEDEFAIDRIN SMALL LETTER M, CAPITAL LETTER S
_SEP = 0xFF                              # between step id and path parts (never in UTF-8)

_BYTE = f"[{chr(_BYTE0)}-{chr(_BYTE0 + 0xFF)}]"
_WHOLE = re.compile(f"{OPEN}{_CASED}({_BYTE}+){MID}({_BYTE}+){CLOSE}")
_TRACE = re.compile(f"[{OPEN}-{chr(_BYTE0 + 0xFF)}\U00016e40-\U00016e9f]+")
_ESCAPED = re.compile(  # a marker's characters (U+10F000..U+10F1FF) escaped, as ...
    r"\\U0010f[01][0-9a-f]{2}"         # repr(), ascii(), "unicode_escape"
    r"|\\udbfc\\+ud[cd][0-9a-f]{2}"    # json.dumps (ensure_ascii): UTF-16 surrogates
    r"|%f4%8f%8[0-7]%"                  # urllib.parse.quote: UTF-8 percent-encoded
    r"|\\xf4\\+x8f\\+x8[0-7]"          # str() of the UTF-8 bytes
    r"|&#x10f[01][0-9a-f]{2};|&#111(?:00[1-9]\d|0[1-5]\d\d);"  # XML/HTML references
    r"|\\U00016e[4-9][0-9a-f]", re.IGNORECASE)
_REPR = re.compile(  # "<SemanticVariable", its "<" also escaped (URL, HTML, JSON, bytes)
    r"(?:<|%3c|&lt;|&#60;|&#x3c;|\\u003c|\\x3c)\s*semantic\s*variable", re.IGNORECASE)

_FIX = ("A Semantic Variable's text is a placeholder for a value not known until the run: "
        "string operations change the placeholder, not the value. Put the variable whole "
        "into the prompt (f\"...{var}...\"); to transform the value, await it in an open "
        "run (`await var` / `var.get()`) and transform the result, or move the "
        "transformation into a @tool step.")


@dataclass
class _Building:
    step: str
    issued: list[Ref] = field(default_factory=list)


_building: contextvars.ContextVar[_Building | None] = contextvars.ContextVar(
    "flowlift_building_step", default=None)


@contextmanager
def building(step: str) -> Iterator[None]:
    """While a step's prompt function runs: name the step in errors, and note every
    variable formatted into text, for :func:`check_kept`."""
    token = _building.set(_Building(step))
    try:
        yield
    finally:
        _building.reset(token)


def formatted() -> list[Ref]:
    """The variables formatted into text so far by the running prompt function."""
    record = _building.get()
    return list(record.issued) if record is not None else []


def check_kept(step: str, issued: Iterable[Ref], used: Iterable[Ref]) -> None:
    """Refuse a prompt that lost a variable its prompt function formatted into text: a
    slice or precision that cut a marker off whole leaves no trace in the text.

    Raises:
        SemanticVariableError: naming the step and the lost variable.
    """
    kept = set(used)
    lost = [r for r in dict.fromkeys(issued) if r not in kept]
    if lost:
        names = ", ".join(repr(".".join((r.ref, *r.path))) for r in lost)
        raise SemanticVariableError(
            f"step {step!r}: its prompt function formatted the Semantic Variable(s) {names} "
            "into text, but the prompt it returned does not hold them: a slice, a "
            "precision (`{:.n}`, `%.ns`) or a split cut them off, or the text holding them "
            "was dropped (to log a variable, use repr(var)). " + _FIX)


def _encode(data: bytes) -> str:
    return "".join(chr(_BYTE0 + b) for b in data)


def _decode(text: str) -> bytes:
    return bytes(ord(c) - _BYTE0 for c in text if _BYTE0 <= ord(c) <= _BYTE0 + 0xFF)


def marker(nonce: str, node_id: str, path: tuple[str, ...] = ()) -> MarkerText:
    """The marker of ``node_id``'s output (``path``: fields of it) in the workflow whose
    nonce (hex digits, :attr:`Workflow.nonce`) is ``nonce``."""
    payload = bytes([_SEP]).join(p.encode("utf-8") for p in (node_id, *path))
    record = _building.get()
    if record is not None:
        record.issued.append(Ref(ref=node_id, path=path))
    return MarkerText(OPEN + _CASED + _encode(bytes.fromhex(nonce)) + MID + _encode(payload)
                      + CLOSE)


def _ref(payload: str) -> Ref:
    node_id, *path = _decode(payload).split(bytes([_SEP]))
    return Ref(ref=node_id.decode("utf-8"), path=tuple(p.decode("utf-8") for p in path))


def split_prompt(text: str, nonce: str, where: str) -> list[Part]:
    """Split text at this workflow's markers into literal text and references.

    Args:
        text: a prompt, message content or tool argument holding markers.
        nonce: the recording workflow's nonce (hex digits).
        where: what is being recorded, for errors (``"step 'ask'"``).

    Returns:
        The parts in order: :class:`Text` (never empty unless ``text`` is) and
        :class:`Ref`; a text with no marker is one ``Text``.

    Raises:
        SemanticVariableError: a marker of another workflow, or any trace of a marker
            outside whole markers (sliced, case-changed, stripped, escaped), or a
            variable's repr.
    """
    plain = str.__str__(text)  # a MarkerText refuses slicing; work on a plain copy
    parts: list[Part] = []
    pos = 0
    for m in _WHOLE.finditer(plain):
        if _decode(m.group(1)).hex() != nonce.lower():
            raise SemanticVariableError(
                f"{where}: a Semantic Variable from another workflow was used in this one; "
                "read its `.value` after its own workflow finished instead")
        if m.start() > pos:
            parts.append(Text(text=plain[pos:m.start()]))
        parts.append(_ref(m.group(2)))
        pos = m.end()
    if pos < len(plain) or not parts:
        parts.append(Text(text=plain[pos:]))
    for part in parts:
        if isinstance(part, Text):
            check_literal(part.text, where)
    return parts


def check_literal(text: str, where: str) -> None:
    """Refuse literal text (no whole markers left) that holds any trace of a variable.

    Raises:
        SemanticVariableError: naming ``where`` and the operation, when one is seen.
    """
    how = _mangled(text)
    if how is not None:
        raise SemanticVariableError(f"{where} holds {how}. {_FIX}")


def _mangled(text: str) -> str | None:
    """What became of a marker in ``text`` (literal text), or None when nothing did."""
    if _REPR.search(text):
        return ("the repr of a Semantic Variable (`{var!r}`, `%r`, repr(), or a list or "
                "dict of variables formatted as a whole: to put a list of variables into a "
                "prompt, join their texts, `\", \".join(map(str, items))`)")
    if _WHOLE.search(text):
        return ("a Semantic Variable where only a constant can go (inside a dict or another "
                "JSON value): pass it as a whole argument, or as an item of a list")
    if _ESCAPED.search(text) or any(_TRACE.search(u) or _REPR.search(u) or _ESCAPED.search(u)
                                    for u in _unescaped(text)):
        return ("an escaped Semantic Variable (repr(), ascii(), json.dumps, a URL quote, "
                "HTML escaping or str() of bytes, of a string holding one)")
    trace = _TRACE.search(text)
    if trace is None:
        return None
    run = trace.group(0)
    of = _owner(run)
    if OPEN in run and CLOSE in run and _CASED not in run:
        return f"a case-changed Semantic Variable{of} (upper(), lower(), title()...)"
    if _CASED.upper() in run or _CASED.lower() in run or _CASED.swapcase() in run:
        return f"a case-changed part of a Semantic Variable{of} (upper(), lower()...)"
    return (f"a cut piece of a Semantic Variable{of}: it was sliced, truncated (`[:n]`, "
            "`{:.n}`, `%.ns`), split, stripped or replaced into")


_ESCAPE_SIGNS = re.compile(r"%[0-9a-f]{2}|&#?\w+;|\\", re.IGNORECASE)
_UTF8_RUN = re.compile("[\xc0-\xf7][\x80-\xbf]+")


def _unescaped(text: str, depth: int = 6, most: int = 64) -> list[str]:
    """What undoing percent-, HTML- and backslash-escapes makes of ``text``, nested up to
    ``depth`` deep (``quote(repr(s))`` needs two), at most ``most`` forms: the forms a
    marker may hide in."""
    found: list[str] = []
    level = [text]
    for _ in range(depth):
        level = [u for t in level if _ESCAPE_SIGNS.search(t)
                 for u in (urllib.parse.unquote(t), html.unescape(t), _unbackslash(t))
                 if u != t and u not in found][:most - len(found)]
        found += level
    return found


def _unbackslash(text: str) -> str:
    """``\\U0010f000``, ``\\udbfc\\udc00`` (a surrogate pair), ``\\xf4\\x8f...`` (UTF-8
    bytes) back to characters; ``text`` itself when it holds no valid escapes."""
    if "\\" not in text:
        return text
    try:
        with warnings.catch_warnings():  # "invalid escape sequence": ordinary backslashes
            warnings.simplefilter("ignore", DeprecationWarning)
            out = text.encode("latin-1", "backslashreplace").decode("unicode_escape")
        out = out.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    except (UnicodeDecodeError, UnicodeEncodeError):
        return text
    return _UTF8_RUN.sub(lambda m: m.group().encode("latin-1").decode("utf-8", "replace"),
                         out)


def _owner(run: str) -> str:
    """`` of step 'x'`` when the run still holds a decodable payload, else ``""``."""
    m = re.search(f"{MID}({_BYTE}+){CLOSE}", run)
    if m is None:
        return ""
    try:
        return f" of step {_ref(m.group(1)).ref!r}"
    except (UnicodeDecodeError, ValueError):
        return ""


class MarkerText(str):
    """``str(var)``: the marker, refusing the string operations that would mangle it."""

    __slots__ = ()

    def _refuse(self, what: str) -> NoReturn:
        record = _building.get()
        where = f"step {record.step!r}: " if record else ""
        raise SemanticVariableError(f"{where}{what} on the text of a Semantic Variable"
                                    f"{_owner(str.__str__(self))}. {_FIX}")

    def __getitem__(self, key: SupportsIndex | slice) -> NoReturn:
        self._refuse("slicing or indexing (`str(var)[...]`)")

    def __iter__(self) -> NoReturn:
        self._refuse("iterating over characters")

    def __repr__(self) -> str:
        # readable in debuggers and logs; refused in prompts like a variable's own repr
        return f"<SemanticVariable marker{_owner(str.__str__(self))}>"

    def __format__(self, spec: str) -> str:
        if spec:
            self._refuse(f"format spec {spec!r}")
        return self

    def _case(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("changing case (upper(), lower(), title()...)")

    upper = lower = casefold = title = swapcase = capitalize = _case

    def _strip(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("strip()")

    strip = lstrip = rstrip = removeprefix = removesuffix = _strip

    def _split(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("split()")

    split = rsplit = splitlines = partition = rpartition = _split

    def _change(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("replace() / translate() / encode()")

    replace = translate = encode = expandtabs = _change


__all__ = ["MarkerText", "building", "check_kept", "check_literal", "formatted", "marker",
           "split_prompt"]
