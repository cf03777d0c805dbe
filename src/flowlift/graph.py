"""The workflow graph: flowlift's versioned wire format (pydantic models).

A graph is what the SDK ships to the proxy (``POST /v1/workflows``) and what
``flowlift compile`` reads. Nodes are ``llm`` steps (model, chat messages with holes,
sampling params, contract, retry policy, an optional model cascade), ``tool`` steps run
by the client, and ``input`` constants.

Edges are never listed: they are derived from variable references (:class:`Ref`)
inside prompts and tool arguments -- dataflow over Semantic Variables, as in Parrot
(Lin et al., OSDI'24). Source order means nothing.

JSON shape (version ``"1"``)::

    {"version": "1", "name": "docs", "class": "batch", "deadline_s": 600,
     "nodes": [
       {"kind": "llm", "id": "extract_1", "model": null,
        "messages": [{"role": "user", "content": [{"text": "Doc: "}, {"ref": "input_1"}]}],
        "params": {"max_tokens": 64, "temperature": 0.0},
        "contract": {"json_schema": {...}}, "retries": 1,
        "cascade": ["small", "large"], "min_confidence": 0.5},
       {"kind": "llm", "id": "agent_1", "messages": [...],
        "tools": [{"name": "search", "description": "Search the corpus.",
                   "parameters": {"type": "object", "properties": {...}}},
                  {"name": "fetch", "server": "web"}],
        "max_turns": 8, "tool_errors": "return"},
       {"kind": "tool", "id": "lookup_1", "name": "lookup",
        "args": [{"ref": "extract_1", "path": ["name"]}], "kwargs": {"k": {"value": 3}}},
       {"kind": "tool", "id": "merge_1", "name": "merge",
        "args": [{"items": [{"ref": "extract_1"}, {"value": "x"}]}]},
       {"kind": "input", "id": "input_1", "value": "..."}]}
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Final, Literal

import jsonschema
from jsonschema.exceptions import SchemaError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from flowlift.predicates import Predicate, leaves

GRAPH_VERSION: Final = "1"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Ref(_Model):
    """A reference to another node's output, optionally to a field of it (``path``)."""

    ref: str = Field(min_length=1)
    path: tuple[str, ...] = ()


class Text(_Model):
    text: str


Part = Text | Ref


class MessageTemplate(_Model):
    """A chat message whose content is literal text and references, in order."""

    role: Literal["system", "user", "assistant"]
    content: tuple[Part, ...]


MAX_TOKENS_LIMIT: Final = 32768


class Params(_Model):
    """Sampling parameters (OpenAI names). ``max_tokens`` in tokens.

    ``max_tokens_ceiling`` (tokens, >= ``max_tokens``): how far a retry may raise
    ``max_tokens`` after an output was cut off (``finish_reason: "length"``); ``None``:
    twice ``max_tokens`` (at most 32768). See :meth:`ceiling`.
    """

    max_tokens: int | None = Field(default=256, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    max_tokens_ceiling: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)

    @model_validator(mode="after")
    def _ceiling_above(self) -> Params:
        if self.max_tokens_ceiling is not None and (
                self.max_tokens is None or self.max_tokens_ceiling < self.max_tokens):
            raise ValueError(f"max_tokens_ceiling {self.max_tokens_ceiling} needs a "
                             f"max_tokens at most that large (max_tokens={self.max_tokens})")
        return self

    @model_serializer(mode="wrap")
    def _wire(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _drop(handler(self), {"max_tokens_ceiling": None})

    def ceiling(self) -> int | None:
        """The most ``max_tokens`` a retry may ask for; ``None`` when ``max_tokens`` is
        unset (no limit to raise)."""
        if self.max_tokens is None:
            return None
        if self.max_tokens_ceiling is not None:
            return self.max_tokens_ceiling
        return min(2 * self.max_tokens, MAX_TOKENS_LIMIT)


def _drop(data: Any, defaults: dict[str, Any]) -> Any:
    """Leave out fields added after version "1" shipped while they hold their defaults,
    so graphs that do not use them stay readable by proxies that predate them."""
    if isinstance(data, dict):
        for key, default in defaults.items():
            if key in data and data[key] == default:
                del data[key]
    return data


class Contract(_Model):
    """What a step's output must satisfy: a JSON Schema, a fixed label set, or a regular
    expression the whole output must match (Python ``re.fullmatch`` syntax; vLLM
    constrains decoding to it natively)."""

    json_schema: dict[str, Any] | None = None
    choices: tuple[str, ...] | None = None
    regex: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> Contract:
        kinds = sum(x is not None for x in (self.json_schema, self.choices, self.regex))
        if kinds != 1:
            raise ValueError("a contract has exactly one of json_schema, choices or regex")
        if self.choices is not None and not self.choices:
            raise ValueError("contract.choices must hold at least one label")
        return self

    @model_serializer(mode="wrap")
    def _wire(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _drop(handler(self), {"regex": None})


class Literal_(_Model):
    """A constant tool argument."""

    value: Any


class Template(_Model):
    """A tool argument built from text and references (an f-string with holes)."""

    template: tuple[Part, ...]


class Items(_Model):
    """A tool argument that is a list holding Semantic Variables (``tool([a, b])``): the
    tool receives the list of the items' values, in order."""

    items: tuple[Arg, ...]


Arg = Ref | Template | Literal_ | Items
Items.model_rebuild()


class ToolSpec(_Model):
    """A tool an agent step's model may call: ``parameters`` is the JSON Schema (draft
    2020-12) its arguments must satisfy.

    ``server`` None: a client-run ``@tool`` (the app runs it: ``tool.wanted``). Else the
    name of a ``[tools.<server>]`` of the proxy's config that runs it on the proxy
    (:mod:`flowlift.proxy.tools`); ``name`` is the tool's name on that server, and the
    proxy fills ``description`` and ``parameters`` from the server when the graph is
    submitted (``flowlift.proxy_tool("server.tool")``).
    """

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}})
    server: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")

    @model_serializer(mode="wrap")
    def _wire(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _drop(handler(self), {"server": None})

    @model_validator(mode="after")
    def _a_schema(self) -> ToolSpec:
        try:
            jsonschema.Draft202012Validator.check_schema(self.parameters)
        except SchemaError as exc:
            raise ValueError(f"tool {self.name!r}: parameters is not a JSON Schema: "
                             f"{exc.message}") from None
        return self


class _Conditional(_Model):
    """The fields of a step that may be skipped (:mod:`flowlift.predicates`)."""

    when: Predicate | None = None
    """Run only when this condition over earlier outputs holds; else the step is
    *skipped* (not failed), and so are steps that need its value."""
    default: Literal_ | None = None
    """The value a skipped step stands for (its readers run with it); none: reading
    the skipped step's value skips the reader too."""


_CONDITIONAL_DEFAULTS: Final = {"when": None, "default": None}


class LLMNode(_Conditional):
    kind: Literal["llm"] = "llm"
    id: str = Field(min_length=1, max_length=200)
    name: str = ""
    model: str | None = None
    messages: tuple[MessageTemplate, ...] = Field(min_length=1)
    params: Params = Params()
    contract: Contract | None = None
    retries: int = Field(default=0, ge=0, le=10)
    """Re-runs of this step alone, per model, after its output fails its contract (the
    validation errors are fed back to the model)."""
    cascade: tuple[str, ...] | None = Field(default=None, min_length=1, max_length=8)
    """Models to try in order (FrugalGPT, Chen et al. 2023): an output that fails its
    contract after that model's retries, or falls under ``min_confidence``, escalates to
    the next. ``model``, when also given, must be ``cascade[0]``."""
    min_confidence: float | None = Field(default=None, gt=0.0, le=1.0)
    """Confidence floor: the geometric mean of the output's token probabilities
    (``exp`` of the mean token logprob). Under it, the output escalates to the next model
    of the cascade; the last model's output is kept whatever its confidence."""
    tools: tuple[ToolSpec, ...] | None = Field(default=None, min_length=1, max_length=128)
    """An agent step: the model may call these tools (client-run ``@tool`` functions,
    or proxy-run ones: ``server`` set); the proxy loops (model turn, the calls run,
    results back into the conversation) until the model answers without calls
    (:mod:`flowlift.proxy.workflows.agent`)."""
    max_turns: int = Field(default=10, ge=1, le=200)
    """Model turns an agent step may take (see ``on_max_turns``)."""
    on_max_turns: Literal["answer", "raise"] | None = None
    """What the last allowed turn does: ``answer``: it is asked for the answer with the
    tools off, and that answer is the step's output (the step's trace shows
    ``max_turns_reached``); ``raise``: it may still call tools, and then the step fails
    with ``StepFailed``. None: ``raise`` with ``tool_choice="required"`` (a loop that must
    call tools), else ``answer``."""
    tool_errors: Literal["return", "raise"] = "return"
    """A tool that raises: its error text goes back to the model (``return``), or the
    step fails (``raise``)."""
    tool_choice: Literal["auto", "required"] = "auto"
    parallel_tool_calls: bool = True
    """OpenAI's ``parallel_tool_calls`` for every turn: False: a turn calls at most one
    tool (the constrained schema's call array holds one; a small model forced to call
    may otherwise keep appending calls until ``max_tokens``)."""
    """OpenAI's ``tool_choice`` for every turn: ``auto`` (the model answers or calls
    tools) or ``required`` (each turn must call a tool: the loop runs ``max_turns`` turns
    and then fails as any loop that never answers)."""

    @model_validator(mode="after")
    def _cascade_head(self) -> LLMNode:
        if self.cascade is not None and self.model is not None \
                and self.model != self.cascade[0]:
            raise ValueError(f"model {self.model!r} must be the cascade's first model "
                             f"{self.cascade[0]!r} (or omitted)")
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError('tool_choice "required" needs tools')
        return self

    @property
    def answers_at_max_turns(self) -> bool:
        """``on_max_turns`` resolved: True when the last turn is asked for the answer."""
        if self.on_max_turns is None:
            return self.tool_choice != "required"
        return self.on_max_turns == "answer"

    @model_serializer(mode="wrap")
    def _wire(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _drop(handler(self), {"retries": 0, "cascade": None, "min_confidence": None,
                                     "tools": None, "max_turns": 10,
                                     "on_max_turns": None,
                                     "tool_errors": "return", "tool_choice": "auto",
                                     "parallel_tool_calls": True,
                                     **_CONDITIONAL_DEFAULTS})

    def models(self) -> tuple[str | None, ...]:
        """The models this step may run on, in order (``None``: the default model)."""
        return self.cascade if self.cascade is not None else (self.model,)


class ToolNode(_Conditional):
    """A client-run step: the proxy pauses this branch and the SDK runs ``name``.

    ``pure``: the app declares the tool a function of its arguments with no side effects
    (``@tool(pure=True)``), so identical calls (same name, same resolved arguments) run
    once and the others take that result, as identical deterministic llm calls do.
    ``timeout_s``: how long the app may take (``@tool(timeout_s=...)``; None: the run's
    ``deadline_s``, or unbounded without one): past it the step fails, the app is told to
    cancel the call and a result posted later is discarded (and traced).
    """

    kind: Literal["tool"] = "tool"
    id: str = Field(min_length=1, max_length=200)
    name: str = Field(min_length=1)
    args: tuple[Arg, ...] = ()
    kwargs: dict[str, Arg] = {}
    pure: bool = False
    timeout_s: float | None = Field(default=None, gt=0)

    @model_serializer(mode="wrap")
    def _wire(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _drop(handler(self), {**_CONDITIONAL_DEFAULTS, "timeout_s": None})


class InputNode(_Model):
    kind: Literal["input"] = "input"
    id: str = Field(min_length=1, max_length=200)
    value: Any


class GroupNode(_Model):
    """Sibling steps of which the first good result wins (``mode: "first"``), or ``k``
    that agree on a field (``mode: "quorum"``, ``agree_on``: the field's path; empty:
    the whole output). Its value is the winning member's output (quorum: the first of
    the agreeing ones to finish); the other members are cancelled as soon as it
    resolves and show as skipped (:mod:`flowlift.proxy.workflows.groups`)."""

    kind: Literal["group"] = "group"
    id: str = Field(min_length=1, max_length=200)
    name: str = ""
    mode: Literal["first", "quorum"]
    members: tuple[str, ...] = Field(min_length=1, max_length=256)
    k: int = Field(default=1, ge=1)
    agree_on: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _sizes(self) -> GroupNode:
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"group {self.id!r}: members must be distinct, got "
                             f"{list(self.members)}")
        if self.k > len(self.members):
            raise ValueError(f"group {self.id!r}: k={self.k} needs at least {self.k} "
                             f"members, got {len(self.members)}")
        if self.mode == "first" and (self.k != 1 or self.agree_on):
            raise ValueError(f"group {self.id!r}: a first-wins group takes no k or "
                             "agree_on (that is a quorum)")
        return self


ITEM: Final = "$item"
"""The reference a map's step template uses for its item (``{"ref": "$item", "path":
[...]}``: the item or a field of it)."""
MAX_MAP_ITEMS: Final = 10000


class MapNode(_Model):
    """Dynamic fan-out: one step per item of a list-valued output (``over``: a step's
    output or a field of it), known only at run time. ``step`` is the template: an llm
    step whose prompt (and condition) may read the item as ``{"ref": "$item"}``. The
    value is the list of the item steps' outputs, in order (skipped ones left out); a
    list longer than ``max_items`` fails the map (:mod:`flowlift.proxy.workflows.fanout`).
    """

    kind: Literal["map"] = "map"
    id: str = Field(min_length=1, max_length=200)
    name: str = ""
    over: Ref
    step: LLMNode
    max_items: int = Field(ge=1, le=MAX_MAP_ITEMS)


AnyNode = LLMNode | ToolNode | InputNode | GroupNode | MapNode
Node = Annotated[AnyNode, Field(discriminator="kind")]


DEADLINE_WARNING_HEADER = "X-Flowlift-Deadline-Warning"
"""Header of the answer to ``POST /v1/workflows`` when the compiler finds the graph's
``deadline_s`` infeasible (and it did not ask for ``strict_deadline``): why, in words."""


class Graph(_Model):
    """One workflow: nodes plus run-level settings.

    Attributes:
        version: wire-format version; only ``"1"`` exists.
        name: a human name for traces and reports.
        workflow_class: ``interactive`` (latency first) or ``batch``; JSON key ``class``.
        deadline_s: one deadline for the whole run, seconds from submission.
        open: the graph is what is known so far of a run that grows: more nodes may be
            appended (``POST /v1/workflows/{run_id}/nodes``) until the run is closed
            (``POST .../close``); the run finishes only once closed.
        detached: the run outlives its client: the proxy never cancels it for want of a
            listener and runs it on after a restart without waiting for the client
            (``@tool`` steps still wait for a client to run them: attach to deliver).
        strict_deadline: refuse the run (HTTP 400) when the compiler finds ``deadline_s``
            infeasible, instead of running it with a warning.
    """

    version: Literal["1"] = GRAPH_VERSION
    id: str | None = None
    name: str = "workflow"
    workflow_class: Literal["interactive", "batch"] = Field(default="interactive",
                                                            alias="class")
    deadline_s: float | None = Field(default=None, gt=0)
    strict_deadline: bool = False
    metadata: dict[str, Any] = {}
    open: bool = False
    detached: bool = False
    nodes: tuple[Node, ...] = Field(min_length=1)

    def node_map(self) -> dict[str, AnyNode]:
        return {n.id: n for n in self.nodes}

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready document (``class`` spelled as on the wire; ``open`` and
        ``detached`` only when true, so a whole graph reads as it did before them)."""
        unset = {f for f in ("open", "detached") if not getattr(self, f)}
        return self.model_dump(mode="json", by_alias=True, exclude=unset or None)

    def to_json(self, indent: int | None = 2) -> str:
        """The graph as JSON text: what ``POST /v1/workflows`` and ``flowlift compile``
        read (``Graph.model_validate_json`` reads it back).

        Args:
            indent: spaces per level; ``None`` for one line.
        """
        return json.dumps(self.to_wire(), indent=indent, ensure_ascii=False)


def node_refs(node: AnyNode) -> Iterator[Ref]:
    """Every reference a node makes, in order (duplicates included): its condition's
    fields first, then its inputs (a group's: its members)."""
    if isinstance(node, GroupNode):
        yield from (Ref(ref=m) for m in node.members)
        return
    if isinstance(node, MapNode):
        yield node.over
        yield from (r for r in node_refs(node.step) if r.ref != ITEM)
        return
    when = condition_of(node)
    if when is not None:
        yield from condition_refs(when)
    if isinstance(node, LLMNode):
        for message in node.messages:
            yield from (p for p in message.content if isinstance(p, Ref))
    elif isinstance(node, ToolNode):
        for arg in (*node.args, *node.kwargs.values()):
            yield from arg_refs(arg)


def condition_of(node: AnyNode) -> Predicate | None:
    """A step's ``when`` condition (None: unconditional, or a kind that has none)."""
    return node.when if isinstance(node, LLMNode | ToolNode) else None


def default_of(node: AnyNode) -> Literal_ | None:
    """A step's ``default`` (what it stands for when skipped), or None."""
    return node.default if isinstance(node, LLMNode | ToolNode) else None


def condition_refs(pred: Predicate) -> Iterator[Ref]:
    """The output fields a condition reads, as references."""
    for leaf in leaves(pred):
        assert leaf.ref is not None
        yield Ref(ref=leaf.ref, path=leaf.path)


def arg_refs(arg: Arg) -> Iterator[Ref]:
    """Every reference a tool argument makes, in order."""
    if isinstance(arg, Ref):
        yield arg
    elif isinstance(arg, Template):
        yield from (p for p in arg.template if isinstance(p, Ref))
    elif isinstance(arg, Items):
        for item in arg.items:
            yield from arg_refs(item)


def render_value(value: Any) -> str:
    """How an output is written into a prompt: strings as-is, anything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def project(value: Any, path: tuple[str, ...]) -> Any:
    """Follow ``path`` (field names / list indices) into a JSON value.

    Raises:
        KeyError: when a field along the path is missing.
    """
    for key in path:
        if isinstance(value, dict):
            value = value[key]
        elif isinstance(value, list) and key.isdigit():
            value = value[int(key)]
        else:
            raise KeyError(key)
    return value


def graph_json_schema() -> dict[str, Any]:
    """The published JSON Schema of the wire format."""
    return Graph.model_json_schema(by_alias=True)
