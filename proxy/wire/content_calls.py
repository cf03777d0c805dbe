"""Calls written as JSON in an answer's content, and answers that are no answer.

A model asked in its own tool-call format (:mod:`flowlift.local_engine.native_tools`)
does not always use the format's markup: Qwen2.5-Coder often writes its call as a
markdown-fenced JSON object in the content (```` ```json\\n{"name": "search",
"arguments": {...}}\\n``` ````), which vLLM's ``hermes`` parser, looking for
``<tool_call>``, passes on as the answer (measured: issue 34, 0 calls on a stock
``vllm serve``). :func:`recognise` reads such content: a call to one of the request's
tools whose arguments fit its schema is taken as the call; one that is not (an unknown
name, arguments that do not fit) is refused (the caller runs the turn again under
constrained decoding, :mod:`flowlift.proxy.dispatch.tool_turns`), and never passed on
as the answer. Call-shaped text is read tolerantly (:func:`_call_values`), because
models write calls that are not JSON (measured: issue 34, bench/RESULTS.md, "Tool-call
format per model"): doubled braces (``{{"name": ...}}``, a template's escape), Python
literals (``None``, ``True``, single quotes, trailing commas: read with
:func:`ast.literal_eval`, JSON's ``true``/``false``/``null`` allowed alongside) and
``//`` or ``/* */`` comments. :func:`hold_from` says from where streamed content must be held back
until the answer ends, because it may be such a call.

:func:`fragment` tells an answer that is only a piece of JSON or markup (``{``,
``:[``, an unclosed ``<tool_call>``), and :func:`no_answer` adds an empty answer after
tool results: a loop the proxy runs (an agent step,
:mod:`flowlift.proxy.workflows.agent`; the hosted-MCP loop of ``/v1/responses``,
:mod:`flowlift.proxy.openai.responses.turn`) does not take it for the answer, but asks
once more with :func:`retry_message`. :func:`undecided` says whether streamed text may
still turn out to be no answer (what such a loop holds back from its client).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from flowlift.local_engine.base import ToolCall, ToolDef

_FENCE = re.compile(r"```[\w-]*[ \t]*\n?(.*?)\n?[ \t]*```", re.DOTALL)
_CALL_START = re.compile(r"```|^[ \t]*[{\[]|<tool_call>", re.MULTILINE)
_MARKUP_ONLY = re.compile(r"[\s{}\[\]():,;\"'`<>/|.\\-]*")
# a string (kept) or a // or /* */ comment (dropped), so "http://x" stays whole
_STRING_OR_COMMENT = re.compile(
    r"""("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')|//[^\n]*|/\*.*?\*/""", re.DOTALL)
_JSON_NAMES = {"true": True, "false": False, "null": None}


@dataclass(frozen=True, slots=True)
class Recognised:
    """What an answer's content is.

    Attributes:
        kind: ``"answer"`` (plain content), ``"calls"`` (a call written as JSON) or
            ``"refused"`` (written as a call, but not one the request allows).
        calls: the calls (``kind == "calls"``).
        content: the text before the calls (``kind == "calls"``).
        reason: why it was refused, for the log and the model.
    """

    kind: Literal["answer", "calls", "refused"]
    calls: tuple[ToolCall, ...] = ()
    content: str = ""
    reason: str = ""


def hold_from(text: str) -> int | None:
    """Where ``text`` (an answer so far) may start a call written as JSON or markup: a
    code fence, a line starting with ``{`` or ``[``, ``<tool_call>``; None: nowhere yet
    (backticks at the very end may still open a fence: the caller waits for more)."""
    found = _CALL_START.search(text)
    return None if found is None else found.start()


def _json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` is made of (one, or several separated by whitespace);
    None: not JSON."""
    decoder, i, out = json.JSONDecoder(), 0, []
    text = text.strip()
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
    return out or None


class _JsonNames(ast.NodeTransformer):
    """JSON's ``true``/``false``/``null`` as constants, so that a Python literal that
    mixes them with ``None``/``True`` still reads."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id not in _JSON_NAMES:
            return node
        return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)


def _literal(text: str) -> Any:
    """The JSON value of ``text`` written as one Python literal
    (:func:`ast.literal_eval`: no names but JSON's, no calls, nothing run); None: it is
    none, or holds what JSON cannot say (a set, bytes)."""
    try:
        tree = _JsonNames().visit(ast.parse(text.strip(), mode="eval"))
        return json.loads(json.dumps(ast.literal_eval(tree)))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _call_values(text: str) -> list[Any] | None:
    """The values of call-shaped ``text`` read tolerantly: as JSON
    (:func:`_json_values`); else with ``//`` and ``/* */`` comments dropped, then one
    outer pair of doubled braces dropped (``{{"name": ..., "arguments": {}}}``) or every
    brace undoubled (``{{"name": ..., "arguments": {{...}}}}``), each read as JSON or as
    a Python literal (:func:`_literal`). None: none of these reads."""
    values = _json_values(text)
    if values is not None:
        return values
    bare = _STRING_OR_COMMENT.sub(lambda m: m.group(1) or "", text).strip()
    if not bare.startswith(("{", "[")):
        return None  # prose: not parsed as Python
    forms = [bare]
    if bare.startswith("{{") and bare.endswith("}}"):
        forms += [bare[1:-1], bare.replace("{{", "{").replace("}}", "}")]
    for form in forms:
        values = _json_values(form)
        if values is None:
            literal = _literal(form)
            values = None if literal is None else [literal]
        if values is not None:
            return values
    return None


def _as_call(value: Any) -> dict[str, Any] | None:
    """``{"name", "arguments"}`` of a value written as a call (``arguments`` or
    ``parameters``, possibly under ``"function"``), else None."""
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        value = value["function"]
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in ("arguments", "parameters"):
        if key in value:
            return {"name": value["name"], "arguments": value[key]}
    return None


def _written_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """``(text before, calls)`` when ``text`` ends in calls written as JSON (bare, in a
    code fence, or between ``<tool_call>`` tags); None otherwise."""
    stripped = text.strip()
    candidates: list[tuple[str, str]] = [("", stripped)]
    fences = list(_FENCE.finditer(stripped))
    if fences and not stripped[fences[-1].end():].strip():
        candidates.append((stripped[:fences[-1].start()], fences[-1].group(1)))
    if "<tool_call>" in stripped:
        head, _, body = stripped.partition("<tool_call>")
        candidates.append((head, body.replace("</tool_call>", " ")
                           .replace("<tool_call>", " ")))
    for before, body in candidates:
        values = _call_values(body)
        if values and len(values) == 1 and isinstance(values[0], list):
            values = values[0]
        calls = [_as_call(v) for v in values or ()]
        if calls and all(c is not None for c in calls):
            return before.strip(), [c for c in calls if c is not None]
    return None


def _problem(call: dict[str, Any], tools: Sequence[ToolDef]) -> str | None:
    spec = next((t for t in tools if t.name == call["name"]), None)
    if spec is None:
        names = ", ".join(t.name for t in tools)
        return f"there is no tool {call['name']!r} (the tools are: {names})"
    args = call["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return f"the arguments of {call['name']} are not JSON"
    if not isinstance(args, dict):
        return f"the arguments of {call['name']} are not a JSON object"
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(spec.parameters).iter_errors(args))
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "(arguments)"
        return f"bad arguments for {call['name']}: {where}: {error.message}"
    call["arguments"] = args
    return None


def recognise(text: str, tools: Sequence[ToolDef], *, parallel: bool = True,
              id_prefix: str = "call_") -> Recognised:
    """Read an answer's content (see the module docstring).

    Args:
        text: the whole content of the answer.
        tools: the request's tools.
        parallel: more than one call allowed (else the first is taken).
        id_prefix: the calls' ids are ``<id_prefix><n>``.
    """
    written = _written_calls(text)
    if written is None:
        return Recognised("answer")
    before, calls = written
    for call in calls:
        problem = _problem(call, tools)
        if problem is not None:
            return Recognised("refused", reason=f"the answer was a tool call written as "
                              f"JSON in the content, and {problem}")
    out = tuple(ToolCall(f"{id_prefix}{n}", c["name"],
                         json.dumps(c["arguments"], ensure_ascii=False))
                for n, c in enumerate(calls if parallel else calls[:1]))
    return Recognised("calls", out, before)


ANSWER_NOW = ("This is your last turn: the tools are off. Answer the question now, in "
              "words, from what you found so far.")
"""The last allowed turn's instruction (an agent step's ``on_max_turns="answer"``)."""
NOT_AN_ANSWER = "Answer the question in words, or call one of the tools."


def no_answer(text: str, *, after_tools: bool) -> str | None:
    """Why ``text``, a turn's whole answer, is no answer: a :func:`fragment`, or empty
    after tool results (``after_tools``: the model stopped without writing one); None
    when it may be one."""
    if not text.strip():
        return "the answer is empty" if after_tools else None
    return fragment(text)


def retry_message(why: str, final: bool) -> str:
    """The user message that asks again after an answer that was no answer (``why``:
    :func:`no_answer`'s reason; ``final``: the tools are off for the retry)."""
    return f"That was not an answer: {why}. {ANSWER_NOW if final else NOT_AN_ANSWER}"


def undecided(text: str) -> bool:
    """Whether streamed ``text`` (an answer so far) may still be no answer
    (:func:`no_answer`): empty, or starting with markup, JSON or punctuation. Text
    that starts with a word is decided (a code fence it leaves open is taken)."""
    stripped = text.strip()
    return not stripped or stripped[0] in "<{[`" or bool(_MARKUP_ONLY.fullmatch(stripped))


def fragment(text: str) -> str | None:
    """Why ``text`` is no answer (only markup or punctuation: ``{``, ``:[``, an
    unfinished ``<tool_call>`` or a code fence left open; the constrained protocol's
    ``{"tool_calls": [...]}`` written as the answer), or None when it may be one.
    Empty text is not judged here (a step may allow an empty answer)."""
    stripped = text.strip()
    if not stripped:
        return None
    if _MARKUP_ONLY.fullmatch(stripped):
        return f"the answer {stripped[:40]!r} is only punctuation or markup"
    if stripped.startswith(("<tool_call>", "<tool_response>", "<|")):
        return f"the answer {stripped[:40]!r} is tool-call markup, not an answer"
    if stripped.count("```") % 2:
        return "the answer leaves a code fence open"
    if stripped[0] in "{[" and _json_values(stripped) is None:
        return f"the answer {stripped[:40]!r} is a piece of JSON that does not end"
    values = _json_values(stripped) if stripped[0] in "{[" else None
    if values and len(values) == 1 and isinstance(values[0], dict) \
            and isinstance(values[0].get("tool_calls"), list):
        return "the answer is a tool call in JSON, not an answer"
    return None
