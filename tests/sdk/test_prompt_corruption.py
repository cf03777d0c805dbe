"""No text derived from a Semantic Variable, other than its whole marker, reaches a prompt
or a tool argument (issue 15, item 1): string operations on placeholders are refused when
the step is recorded, naming the step and the operation."""

# ruff: noqa: UP031  (printf-style formatting is what these tests exercise)
from __future__ import annotations

import json
import string
import urllib.parse
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowlift import SemanticVariableError, step, tool, workflow
from flowlift.graph import Items, Literal_, Ref, Template, Text
from flowlift.sdk.variables import SemanticVariable


@step
def ask(x):
    return f"Q: {x}"


@step
def use(prompt):
    return prompt


@step
def shout(build, v):
    """Prompt code as users write it: the string operation inside the step function."""
    return build(v)


@tool
def merge(xs, k=None):
    return xs


# -- the cases users hit ---------------------------------------------------------------
@pytest.mark.parametrize(("build", "said"), [
    (lambda v: str(v).upper(), "changing case"),
    (lambda v: f"{v!r}", "repr"),
    (lambda v: str(v)[:10], "slicing"),
    (lambda v: str(v).strip(), "strip"),
    (lambda v: f"Name: {v}!".upper(), "case-changed"),
    (lambda v: f"Name: {v}!".title(), "case-changed"),
    (lambda v: f"Name: {v}!"[:9], "cut piece"),
    (lambda v: "about %.8s" % f"x{v}", "cut piece"),
    (lambda v: "{:.9}".format(f"x{v}"), "cut piece"),
    (lambda v: repr(f"x{v}"), "escaped"),
    (lambda v: ascii(f"x{v}"), "escaped"),
    (lambda v: f"{[v]}", "repr"),
    (lambda v: f"{v!r}".upper(), "repr"),
    (lambda v: "-".join(f"a {v} b"), "cut piece"),
    (lambda v: "%r" % str(v), "repr"),
    (lambda v: str(v).encode().decode(), "encode"),
    (lambda v: str(v).replace("a", "b"), "replace"),
    (lambda v: json.dumps({"doc": f"{v}"}), "escaped"),
    (lambda v: urllib.parse.quote(f"doc {v}"), "escaped"),
    (lambda v: str(f"doc {v}".encode()), "escaped"),
    (lambda v: f"doc {v}".encode("ascii", "xmlcharrefreplace").decode(), "escaped"),
])
def test_everyday_string_operations_on_a_placeholder_are_refused(build, said):
    with workflow("w", submit=False):
        v = ask("a")
        with pytest.raises(SemanticVariableError) as info:
            shout(build, v)
    message = str(info.value)
    assert said in message
    assert "step 'shout'" in message, "the error names the step being recorded"
    assert "@tool" in message and "await" in message, "the error says what to do"


def test_the_mangled_variable_is_named_when_its_payload_survived():
    with workflow("w", submit=False):
        v = ask("a")
        with pytest.raises(SemanticVariableError, match="of step 'ask_1'"):
            use(f"Name: {v}".lower())


def test_whole_placeholders_still_make_edges():
    with workflow("w", submit=False) as wf:
        a, b = ask("a"), ask("b")
        out = [use(f"{a} and {b}".strip()), use("%s" % a), use(str(a) + " | " + str(b)),
               use(" ".join([str(a), "x"])), use(f"{a.__str__()}")]
    nodes = wf.graph().node_map()
    content = nodes[out[0].step_id].messages[0].content
    assert content == (Ref(ref="ask_1"), Text(text=" and "), Ref(ref="ask_2"))
    for var in out[1:]:
        assert Ref(ref="ask_1") in nodes[var.step_id].messages[0].content


def test_a_list_of_variables_goes_into_a_prompt_joined_not_as_a_list():
    @step
    def listing(items):
        return f"Items: {items}"

    @step
    def joined(items):
        return "Items: " + ", ".join(map(str, items))

    with workflow("w", submit=False) as wf:
        items = [ask("a"), ask("b")]
        with pytest.raises(SemanticVariableError, match=r"join their texts"):
            listing(items)
        out = joined(items)
    content = wf.graph().node_map()[out.step_id].messages[0].content
    assert content == (Text(text="Items: "), Ref(ref="ask_1"), Text(text=", "),
                       Ref(ref="ask_2"))


def test_tool_arguments_are_checked_and_lists_of_variables_are_supported():
    with workflow("w", submit=False) as wf:
        a, b = ask("a"), ask("b")
        merge([a, "x", [b, f"see {a}"]], k=(1, 2))
        with pytest.raises(SemanticVariableError, match="tool 'merge' argument 0"):
            merge(f"x {a}"[:4])
        with pytest.raises(SemanticVariableError, match="inside a dict"):
            merge({"a": a})
        with pytest.raises(SemanticVariableError, match="only a constant"):
            merge({"a": f"x {a}"})
    node = wf.graph().nodes[-1]
    arg = node.args[0]
    assert isinstance(arg, Items)
    assert arg.items[0] == Ref(ref="ask_1") and arg.items[1] == Literal_(value="x")
    inner = arg.items[2]
    assert isinstance(inner, Items) and isinstance(inner.items[1], Template)
    assert node.kwargs["k"] == Literal_(value=[1, 2])
    assert {r.ref for r in _refs(wf)} == {"ask_1", "ask_2"}


def _refs(wf: Any) -> list[Ref]:
    from flowlift.graph import node_refs

    return [r for n in wf.graph().nodes for r in node_refs(n)]


@pytest.mark.parametrize("text", [
    r"Match \d+ in C:\new\table and C:\Users\X", "100% sure &amp; <b>bold</b> &#60;",
    "naïve café 日本語 🎉 \U0001F389", "json: {\"a\": \"\\u00e9\"} %F0%9F%8E%89",
    "a <semantic> variable, SemanticVariable docs"])
def test_ordinary_prompt_text_is_never_taken_for_a_marker(text):
    with workflow("w", submit=False) as wf:
        v = ask("a")
        out = use(f"{text} {v}")
        merge(text)
    content = wf.graph().node_map()[out.step_id].messages[0].content
    assert content == (Text(text=f"{text} "), Ref(ref="ask_1"))


def test_a_variable_of_another_workflow_is_refused():
    with workflow("one", submit=False):
        old = ask("a")
    with workflow("two", submit=False), pytest.raises(SemanticVariableError,
                                                      match="another workflow"):
        use(f"{old}")


def test_str_of_a_variable_is_never_readable_text():
    with workflow("w", submit=False):
        v = ask("a")
    text = str(v)
    assert not any(c in string.printable for c in _plain(text)), "never looks like a value"
    assert repr(v) == "<SemanticVariable ask_1: pending>"
    assert repr(text) == "<SemanticVariable marker of step 'ask_1'>"


# -- the property: random string operations never produce a prompt that passes ----------
_MEDEFAIDRIN = "".join(map(chr, range(0x16E40, 0x16EA0)))  # marker letters: refused
_ALPHABET = st.characters(codec="utf-8", exclude_categories=("Cs", "Co", "Cn"),
                          exclude_characters=_MEDEFAIDRIN)
_TEXT = st.text(_ALPHABET, max_size=8)

Op = Callable[[str], str]


def _plain(s: str) -> str:
    return str.__str__(s)


@st.composite
def _cutting_op(draw: st.DrawFn) -> tuple[str, Op]:
    """Operations that may cut or change a marker's characters."""
    kind = draw(st.sampled_from(["slice", "index", "split_join", "replace", "strip_chars",
                                 "precision", "percent_precision"]))
    i, j = draw(st.integers(-30, 30)), draw(st.integers(-30, 30))
    text = draw(_TEXT)
    if kind == "slice":
        return f"[{i}:{j}]", lambda s: s[i:j]
    if kind == "index":
        return f"[{i}] (+text)", lambda s: (s[i] + text) if -len(s) <= i < len(s) else s
    if kind == "split_join":
        def split_join(s: str) -> str:
            sep = _plain(s)[i:j] or text or "x"
            return text.join(s.split(sep))
        return "split/join", split_join
    if kind == "replace":
        def replace(s: str) -> str:
            old = _plain(s)[i:j] or "a"
            return s.replace(old, text)
        return "replace", replace
    if kind == "strip_chars":
        def strip_chars(s: str) -> str:
            return s.strip(_plain(s)[i:j] or None)
        return "strip(chars)", strip_chars
    width = abs(i)
    if kind == "precision":
        return f"{{:.{width}}}", lambda s: format(s, f".{width}")
    return f"%.{width}s", lambda s: "%.*s" % (width, s)


@st.composite
def _keeping_op(draw: st.DrawFn) -> tuple[str, Op]:
    """Operations that may keep a marker whole (or change case, or escape it)."""
    kind = draw(st.sampled_from([
        "upper", "lower", "casefold", "title", "swapcase", "capitalize", "strip", "lstrip",
        "rstrip", "codec", "pad", "percent", "concat", "fstring", "split_ws", "mul",
        "json_unicode"]))
    a, b = draw(_TEXT), draw(_TEXT)
    if kind in ("upper", "lower", "casefold", "title", "swapcase", "capitalize", "strip",
                "lstrip", "rstrip"):
        return kind, lambda s: getattr(s, kind)()
    if kind == "codec":
        codec = draw(st.sampled_from(["utf-8", "utf-16", "utf-32"]))
        return codec, lambda s: s.encode(codec).decode(codec)
    if kind == "pad":
        spec = draw(st.sampled_from([">40", "<3", "^50", "*^45", ""]))
        return f"{{:{spec}}}", lambda s: format(s, spec)
    if kind == "percent":
        return "%s", lambda s: "%s" % s
    if kind == "concat":
        return "concat", lambda s: a + s + b
    if kind == "fstring":
        return "f-string", lambda s: f"{a}{s}{b}"
    if kind == "json_unicode":  # JSON text that keeps the characters: the marker whole
        return "json.dumps(ensure_ascii=False)", lambda s: json.dumps(s, ensure_ascii=False)
    if kind == "split_ws":
        return "split()/join", lambda s: " ".join(s.split())
    return "*2", lambda s: s * 2


_ESCAPES = ("repr", "ascii", "unicode_escape", "percent_r", "json", "quote", "bytes_str")


@st.composite
def _escaping_op(draw: st.DrawFn) -> tuple[str, Op]:
    kind = draw(st.sampled_from(_ESCAPES))
    if kind == "json":
        return kind, json.dumps
    if kind == "quote":
        return kind, lambda s: urllib.parse.quote(_plain(s))
    if kind == "bytes_str":
        return kind, lambda s: str(_plain(s).encode())
    if kind == "repr":
        return kind, repr
    if kind == "ascii":
        return kind, ascii
    if kind == "percent_r":
        return kind, lambda s: "%r" % (s,)
    return kind, lambda s: s.encode("unicode_escape").decode("ascii")


@st.composite
def _pipelines(draw: st.DrawFn, with_cuts: bool = True) -> list[tuple[str, Op]]:
    """A random composition; once escaped, only operations that cannot cut follow (a
    slice of an escape sequence is ordinary text: a documented limit)."""
    ops: list[tuple[str, Op]] = []
    escaped = False
    for _ in range(draw(st.integers(1, 5))):
        choices = [_keeping_op()]
        if with_cuts and not escaped:
            choices.append(_cutting_op())
        if with_cuts:
            choices.append(_escaping_op())
        name, op = draw(st.one_of(*choices))
        escaped = escaped or name in _ESCAPES
        ops.append((name, op))
    return ops


def _apply(ops: list[tuple[str, Op]], v: SemanticVariable, source: str) -> str:
    s: str = {"str": str(v), "format": format(v), "percent": "%s" % v,
              "fstring": f"<< {v} >>"}[source]
    for _, op in ops:
        s = op(s)
    return s


_SOURCES = st.sampled_from(["str", "format", "percent", "fstring"])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_pipelines(), source=_SOURCES)
def test_string_operations_never_yield_a_prompt_that_records(ops, source):
    """Whatever the operations (done in the step's prompt function, as prompt code is),
    the prompt records only when every marker in it is whole and untouched: the same
    operations on another variable's marker give the same text with that marker in its
    place (the operations treated the marker as opaque)."""
    with workflow("prop", submit=False) as wf:
        v1, v2 = ask("one"), ask("two")
        m1, m2 = _plain(str(v1)), _plain(str(v2))
        try:
            out = shout(lambda v: _apply(ops, v, source), v1)
        except SemanticVariableError:
            return
        out1 = _plain(_apply(ops, v1, source))
        try:
            out2 = _plain(_apply(ops, v2, source))
        except SemanticVariableError:
            out2 = None
        names = [n for n, _ in ops]
        assert m1 in out1 and out1.replace(m1, m2) == out2, \
            f"{names} on a placeholder recorded without error: {out1!r}"
        node = wf.graph().node_map()[out.step_id]
        assert Ref(ref="ask_1") in node.messages[0].content
        for part in _literal_texts(node):
            assert not set(part) & set(m1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_pipelines(), source=_SOURCES)
def test_tool_arguments_never_carry_a_piece_of_a_placeholder(ops, source):
    """Tool arguments are built in the workflow body, where no prompt function frames
    them: a cut that drops a marker whole leaves ordinary text (a documented limit); any
    piece of a marker, or a changed one, is refused."""
    with workflow("prop", submit=False) as wf:
        v1, v2 = ask("one"), ask("two")
        m1, m2 = _plain(str(v1)), _plain(str(v2))
        try:
            out1 = _apply(ops, v1, source)
            merge(out1)
        except SemanticVariableError:
            return
        out1, out2 = _plain(out1), _plain(_apply(ops, v2, source))
        names = [n for n, _ in ops]
        kept_whole = m1 in out1 and out1.replace(m1, m2) == out2
        dropped_whole = out1 == out2 and not set(out1) & (set(m1) | set(m2))
        assert kept_whole or dropped_whole, \
            f"{names} on a placeholder recorded without error: {out1!r}"
        for part in _literal_texts(wf.graph().nodes[-1]):
            assert not set(str(part)) & set(m1)


def _literal_texts(node: Any) -> list[str]:
    if node.kind == "llm":
        return [p.text for m in node.messages for p in m.content if isinstance(p, Text)]
    arg = node.args[0]
    if isinstance(arg, Template):
        return [p.text for p in arg.template if isinstance(p, Text)]
    return [arg.value] if isinstance(arg, Literal_) else []


@settings(max_examples=200, deadline=None)
@given(pre=_TEXT, post=_TEXT, spec=st.sampled_from(["", ">40", "^50"]),
       strip=st.booleans())
def test_prompts_that_keep_placeholders_whole_record_with_their_edges(pre, post, spec,
                                                                      strip):
    """No false alarm: padding, stripping the whole prompt, and text around it are fine."""
    with workflow("ok", submit=False) as wf:
        v = ask("a")
        text = format(f"{pre}{v}{post}\n", spec)
        out = use(text.strip() if strip else text)
    content = wf.graph().node_map()[out.step_id].messages[0].content
    assert Ref(ref="ask_1") in content
    literal = "".join(p.text for p in content if isinstance(p, Text))
    assert literal.strip() == f"{pre}{post}".strip() or spec


def test_a_workflow_input_is_a_constant_never_a_placeholder():
    with workflow("w", submit=False) as wf:
        v = ask("a")
        with pytest.raises(SemanticVariableError, match="workflow input 'doc'"):
            wf.input(f"text {v}", name="doc")
        with pytest.raises(SemanticVariableError, match="only a constant"):
            wf.input({"k": v})
        assert wf.input({"k": ["plain", 1]}).step_id == "input_1"
