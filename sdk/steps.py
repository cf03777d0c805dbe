"""``@step`` and ``@tool``: ordinary functions that become graph nodes inside a workflow.

A ``@step`` function returns its prompt: a string, a Semantic Variable, or a list of
chat messages (``{"role": ..., "content": ...}``). Inside ``with workflow(...)`` the
call records an ``llm`` node and returns a :class:`SemanticVariable`; outside, it runs
at once through the proxy and returns the value.

A ``@tool`` function is client-run Python: inside a workflow the proxy pauses that
branch, the SDK calls the function with the resolved arguments and posts the result.
Outside a workflow it is a plain call.

``@step(tools=[search, calculator], max_turns=8)`` is an agent step: its model may call
those tools, and the proxy loops until the model answers without calling any
(:mod:`flowlift.sdk.agents`, :mod:`flowlift.proxy.workflows.agent`); tools the proxy
runs itself are named with ``flowlift.proxy_tool("server.tool")`` among them.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Literal, ParamSpec, TypeVar, overload

from pydantic import TypeAdapter, ValidationError

from flowlift.errors import SemanticVariableError, UserError
from flowlift.graph import (
    Arg,
    Items,
    Literal_,
    LLMNode,
    MessageTemplate,
    Params,
    Ref,
    Template,
    ToolSpec,
)
from flowlift.sdk.agents import ProxyTool, agent_tools
from flowlift.sdk.conditions import NO_DEFAULT, Conditional, pop_conditional
from flowlift.sdk.contracts import OutputSpec, output_spec
from flowlift.sdk.markers import building, check_kept, check_literal, formatted, split_prompt
from flowlift.sdk.variables import SemanticVariable
from flowlift.sdk.workflow import Workflow, current_workflow

P = ParamSpec("P")
R = TypeVar("R")

_ROLES = ("system", "user", "assistant")


def _parameters(fn: Callable[..., Any]) -> frozenset[str]:
    """Names of ``fn``'s parameters (all names when it takes ``**kwargs``): a call's
    ``when=``/``default=`` go to the function when it takes them."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset({"when", "default"})
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset({"when", "default"})
    return frozenset(p.name for p in params)


def _messages(prompt: Any, wf: Workflow, step_name: str) -> tuple[MessageTemplate, ...]:
    if isinstance(prompt, (str, SemanticVariable)):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or not prompt:
        raise UserError(f"step {step_name!r} must return its prompt: a string or a "
                        f"non-empty list of chat messages, not {type(prompt).__name__}",
                        param="prompt")
    out = []
    for i, msg in enumerate(prompt):
        if not isinstance(msg, Mapping) or msg.get("role") not in _ROLES:
            raise UserError(f"step {step_name!r}: message {i} needs a role in {_ROLES} "
                            "and a content string", param=f"messages[{i}]")
        content = msg.get("content")
        if not isinstance(content, (str, SemanticVariable)):
            raise UserError(f"step {step_name!r}: message {i} content must be a string "
                            f"(got {type(content).__name__})", param=f"messages[{i}].content")
        where = f"step {step_name!r} (message {i}, {msg['role']})"
        out.append(MessageTemplate(role=msg["role"],
                                   content=tuple(split_prompt(str(content), wf.nonce, where))))
    return tuple(out)


def _arg(value: Any, wf: Workflow, where: str) -> Arg:
    """One tool argument on the wire: a reference, a template (text with variables), a
    list of arguments holding variables, or a JSON constant.

    Raises:
        SemanticVariableError: text holding a mangled variable, or a dict holding one.
        UserError: a value that is neither JSON nor a variable.
    """
    if isinstance(value, SemanticVariable):
        return value.ref
    if isinstance(value, str):
        parts = split_prompt(value, wf.nonce, where)
        if any(isinstance(p, Ref) for p in parts):
            return Template(template=tuple(parts))
        return Literal_(value=value)
    if isinstance(value, (list, tuple)):
        items = tuple(_arg(v, wf, f"{where}[{i}]") for i, v in enumerate(value))
        if all(isinstance(a, Literal_) for a in items):
            return Literal_(value=[a.value for a in items if isinstance(a, Literal_)])
        return Items(items=items)
    try:
        text = json.dumps(value, ensure_ascii=False, default=_refuse_in_json(where))
    except TypeError:
        raise UserError(f"{where}: tool arguments must be JSON values or Semantic "
                        f"Variables, not {type(value).__name__}", param=where) from None
    check_literal(text, where)
    return Literal_(value=value)


def _refuse_in_json(where: str) -> Callable[[Any], Any]:
    def default(obj: Any) -> Any:
        if isinstance(obj, SemanticVariable):
            raise SemanticVariableError(
                f"{where}: a Semantic Variable inside a dict: tool arguments carry variables "
                "as whole arguments or as items of a list; pass it as its own argument "
                "(`tool(x, key=var)`) or in a list")
        raise TypeError(type(obj).__name__)
    return default


class Step(Generic[P]):
    """A prompt-returning function that runs on a model. Created by :func:`step`."""

    def __init__(self, fn: Callable[P, Any], *, model: str | None, spec: OutputSpec,
                 params: Params, name: str | None, cascade: tuple[str, ...] | None = None,
                 retries: int = 0, min_confidence: float | None = None,
                 tools: Sequence[Tool[Any, Any] | ProxyTool] = (), max_turns: int = 10,
                 tool_errors: Literal["return", "raise"] = "return",
                 tool_choice: Literal["auto", "required"] = "auto",
                 on_max_turns: Literal["answer", "raise"] | None = None,
                 parallel_tool_calls: bool = True) -> None:
        self.fn = fn
        self.parallel_tool_calls = parallel_tool_calls
        self.on_max_turns = on_max_turns
        self.model = model
        self.cascade = cascade
        self.retries = retries
        self.min_confidence = min_confidence
        self.spec = spec
        self.params = params
        self.name = name or fn.__name__
        self.max_turns, self.tool_errors = max_turns, tool_errors
        self.tool_choice = tool_choice
        self._tools: dict[str, Tool[Any, Any]] = {}
        self.tool_specs: tuple[ToolSpec, ...] | None = None
        if tools:
            self._tools, self.tool_specs = agent_tools(tools, self.name)
        self._takes = _parameters(fn)
        functools.update_wrapper(self, fn)

    def when(self, condition: object, *, default: Any = NO_DEFAULT) -> Callable[P, Any]:
        """This step, run only when ``condition`` holds on the proxy
        (:mod:`flowlift.sdk.conditions`); skipped otherwise, standing for ``default``
        when one is given. ``step(x, when=..., default=...)`` is the same when the
        function has no parameter so named.

        Raises:
            UserError: ``condition`` is no condition, ``default`` no JSON value.
        """
        cond = Conditional(condition, default)
        return lambda *args, **kwargs: self._record(args, kwargs, cond)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        return self._record(args, kwargs, pop_conditional(kwargs, self._takes))

    def _record(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                cond: Conditional | None) -> Any:
        wf = current_workflow()
        if wf is None:
            with Workflow(self.name) as eager:
                var = self._record(args, kwargs, cond)
            del eager
            return var.value
        with building(self.name):
            prompt = self.fn(*args, **kwargs)
            issued = formatted()
        messages = _messages(prompt, wf, self.name)
        check_kept(self.name, issued,
                   [p for m in messages for p in m.content if isinstance(p, Ref)])
        node = LLMNode(id=wf.new_id(self.name), name=self.name, model=self.model,
                       messages=messages, params=self.params,
                       contract=self.spec.contract, retries=self.retries,
                       cascade=self.cascade, min_confidence=self.min_confidence,
                       tools=self.tool_specs, max_turns=self.max_turns,
                       tool_errors=self.tool_errors, tool_choice=self.tool_choice,
                       parallel_tool_calls=self.parallel_tool_calls,
                       on_max_turns=self.on_max_turns if self.tool_specs else None,
                       **(cond.node_fields() if cond else {}))
        if self._tools:
            wf.agent_tools[node.id] = self._tools
        if cond is not None:
            cond.recorded(wf, node.id)
        return wf.add_node(node, parse=self.spec.parse, fields=self.spec.fields)


class Tool(Generic[P, R]):
    """Client-run Python inside a workflow. Created by :func:`tool`."""

    def __init__(self, fn: Callable[P, R], name: str | None, pure: bool = False,
                 timeout_s: float | None = None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise UserError(f"tool {name or fn.__name__!r}: timeout_s must be a number of "
                            f"seconds above 0, not {timeout_s!r}", param="timeout_s")
        self.fn = fn
        self.name = name or fn.__name__
        self.pure = pure
        self.timeout_s = timeout_s
        self._takes = _parameters(fn)
        functools.update_wrapper(self, fn)

    def when(self, condition: object, *, default: Any = NO_DEFAULT) -> Callable[P, Any]:
        """This tool step, run only when ``condition`` holds (see :meth:`Step.when`)."""
        cond = Conditional(condition, default)
        return lambda *args, **kwargs: self._record(args, kwargs, cond)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        wf = current_workflow()
        if wf is None:
            return self.fn(*args, **kwargs)
        return self._record(args, kwargs, pop_conditional(kwargs, self._takes))

    def _record(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                cond: Conditional | None) -> Any:
        wf = current_workflow()
        if wf is None:
            raise UserError(f"tool {self.name!r}: when= needs a `with workflow(...)` block "
                            "(a plain call runs at once)", param="when")
        wire_args = tuple(_arg(a, wf, f"tool {self.name!r} argument {i}")
                          for i, a in enumerate(args))
        wire_kwargs = {k: _arg(v, wf, f"tool {self.name!r} argument {k!r}")
                       for k, v in kwargs.items()}
        var = wf.add_tool(self, wire_args, wire_kwargs,
                          cond.node_fields() if cond else None)
        if cond is not None:
            cond.recorded(wf, var.step_id)
        return var

    def parse_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]
                        ) -> tuple[list[Any], dict[str, Any]]:
        """JSON arguments (as a run's ``tool.wanted`` event sends them) -> the values the
        function's annotations ask for (``TypeAdapter(annotation).validate_python``: a
        dict into its pydantic model, and so on); an unannotated or ``Any`` parameter,
        and ``*args``/``**kwargs``, keep their JSON value.

        Raises:
            TypeError: the arguments do not fit the function's signature.
            pydantic.ValidationError: an argument does not parse into its annotation.
        """
        signature = inspect.signature(self.fn)
        try:
            hints = typing.get_type_hints(self.fn)
        except NameError:  # a name the function's module cannot resolve: use what is real
            hints = {k: v for k, v in getattr(self.fn, "__annotations__", {}).items()
                     if not isinstance(v, str)}
        bound = signature.bind(*args, **kwargs)
        for name, value in bound.arguments.items():
            hint = hints.get(name)
            kind = signature.parameters[name].kind
            if hint is None or hint is Any or kind in (inspect.Parameter.VAR_POSITIONAL,
                                                       inspect.Parameter.VAR_KEYWORD):
                continue
            bound.arguments[name] = TypeAdapter(hint).validate_python(value)
        return list(bound.args), dict(bound.kwargs)

    def typed(self) -> Tool[..., R]:
        """This tool taking JSON arguments: each call parses them
        (:meth:`parse_arguments`) and then runs the function (an attached run's tools:
        :func:`flowlift.attach`)."""
        def call(*args: Any, **kwargs: Any) -> R:
            py_args, py_kwargs = self.parse_arguments(args, kwargs)
            return self.fn(*py_args, **py_kwargs)
        return Tool(call, self.name)


@overload
def step(fn: Callable[P, Any], /) -> Step[P]: ...
@overload
def step(*, model: str | Sequence[str] | None = None, output: Any = None,
         max_tokens: int | None = 256, temperature: float = 0.0, top_p: float = 1.0,
         stop: Sequence[str] = (), seed: int | None = None, name: str | None = None,
         retries: int = 0, min_confidence: float | None = None,
         tools: Sequence[Tool[Any, Any] | ProxyTool] = (), max_turns: int = 10,
         tool_errors: Literal["return", "raise"] = "return",
         max_tokens_ceiling: int | None = None,
         tool_choice: Literal["auto", "required"] = "auto",
         on_max_turns: Literal["answer", "raise"] | None = None,
         parallel_tool_calls: bool = True,
         ) -> Callable[[Callable[P, Any]], Step[P]]: ...


def step(fn: Callable[P, Any] | None = None, /, *, model: str | Sequence[str] | None = None,
         output: Any = None, max_tokens: int | None = 256, temperature: float = 0.0,
         top_p: float = 1.0, stop: Sequence[str] = (), seed: int | None = None,
         name: str | None = None, retries: int = 0,
         min_confidence: float | None = None,
         tools: Sequence[Tool[Any, Any] | ProxyTool] = (),
         max_turns: int = 10, tool_errors: Literal["return", "raise"] = "return",
         max_tokens_ceiling: int | None = None,
         tool_choice: Literal["auto", "required"] = "auto",
         on_max_turns: Literal["answer", "raise"] | None = None,
         parallel_tool_calls: bool = True) -> Any:
    """Mark a function that returns a prompt as an LLM step.

    Args:
        model: served model name; ``None`` uses the proxy's default model; a list of
            names is a cascade (FrugalGPT): each call runs on the first, and an output
            that fails its contract (after ``retries``) or ``min_confidence`` escalates
            to the next.
        output: the contract: a pydantic model (schema-constrained decoding, parsed into
            the model), ``Literal[...]``/``Enum`` (one of fixed labels), a JSON Schema
            dict, a regex (``re.compile(...)`` or ``Regex("...")``: the whole output must
            match), or ``None`` for text.
        max_tokens, temperature, top_p, stop, seed: sampling (OpenAI meanings).
        name: node name prefix (default: the function's name).
        retries: re-runs of this step alone, per model, when its output fails the
            contract; the validation errors are fed back to the model (0 to 10).
        min_confidence: in (0, 1]: escalate outputs whose geometric-mean token
            probability is lower (only with a cascade; needs engine logprobs).
        tools: ``@tool`` functions the model may call (an agent step), and
            :func:`~flowlift.sdk.agents.proxy_tool` names of tools the proxy runs itself
            (no app round trip; :mod:`flowlift.proxy.tools`): the proxy loops
            -- model turn, the app runs the calls (concurrently, deadline clock paused),
            results back into the conversation -- until the model answers without
            calls; that answer is the step's output, checked against ``output``. A call
            of an unknown tool or with arguments that do not fit the function's
            signature gets the error as its result and the loop goes on.
        max_turns: model turns an agent step may take (1 to 200); see ``on_max_turns``.
        on_max_turns: what the last allowed turn does: ``"answer"``: it is asked for the
            answer with the tools off (the trace marks the step ``max_turns_reached``);
            ``"raise"``: it may still call tools, and then the step fails
            (``StepFailed`` naming the turns and the last tool asked for). Default:
            ``"raise"`` with ``tool_choice="required"``, else ``"answer"``.
        tool_errors: a tool that raises: ``"return"`` its error text to the model, or
            ``"raise"``: fail the step naming the tool and its error.
        max_tokens_ceiling: tokens: how far a retry may raise ``max_tokens`` after an
            output was cut off (``finish_reason: "length"``) and failed its contract;
            default twice ``max_tokens``. Each such retry doubles the budget up to it.
        tool_choice: OpenAI's ``tool_choice`` on every turn: ``"auto"`` (answer or
            call) or ``"required"`` (each turn must call a tool, so the loop runs
            ``max_turns`` turns and then fails with ``StepFailed``: a fixed number of
            tool rounds, as ``bench/agent_loop.py`` uses).
        parallel_tool_calls: OpenAI's ``parallel_tool_calls`` on every turn: False: a
            turn calls at most one tool (what a small model forced to call needs, or
            it may append calls until ``max_tokens``).

    Raises:
        UserError: for an unsupported ``output``, bad sampling values, an empty cascade,
            a bad ``retries`` / ``min_confidence``, or bad ``tools`` / ``max_turns`` /
            ``tool_errors`` / ``tool_choice`` (``"required"`` without tools).
    """
    try:
        spec = output_spec(output)
    except ValidationError as exc:  # e.g. Regex(""): an empty pattern
        problem = exc.errors(include_url=False)[0]["msg"]
        raise UserError(f"output={output!r}: {problem}; give a non-empty regex, a pydantic "
                        "model, or None for text", param="output") from None
    cascade = None
    if model is not None and not isinstance(model, str):
        cascade = tuple(model)
        if not cascade or not all(isinstance(m, str) and m for m in cascade):
            raise UserError(f"model={model!r}: a cascade is a non-empty list of model "
                            "names", param="model")
        model = cascade[0]
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 10:
        raise UserError(f"retries={retries!r}: must be a whole number 0 to 10, e.g. retries=2",
                        param="retries")
    if min_confidence is not None and (isinstance(min_confidence, bool) or not isinstance(
            min_confidence, int | float) or not 0 < min_confidence <= 1):
        raise UserError(f"min_confidence={min_confidence!r}: must be a number in (0, 1]",
                        param="min_confidence")
    if min_confidence is not None and cascade is None:
        raise UserError(f"min_confidence={min_confidence!r} escalates to a larger model: it "
                        "needs a cascade, model=[small, large]", param="min_confidence")
    try:
        params = Params(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                        stop=tuple(stop), seed=seed, max_tokens_ceiling=max_tokens_ceiling)
    except ValueError as exc:
        raise UserError(f"bad sampling parameters: {exc}", param="params") from None

    _check_agent(max_turns, tool_errors, tool_choice, bool(tools))
    if on_max_turns not in (None, "answer", "raise"):
        raise UserError(f"on_max_turns={on_max_turns!r}: must be \"answer\" (the last turn "
                        "answers with the tools off) or \"raise\" (the step fails)",
                        param="on_max_turns")

    def wrap(f: Callable[P, Any]) -> Step[P]:
        return Step(f, model=model, spec=spec, params=params, name=name, cascade=cascade,
                    retries=retries, min_confidence=min_confidence, tools=tools,
                    max_turns=max_turns, tool_errors=tool_errors, tool_choice=tool_choice,
                    on_max_turns=on_max_turns, parallel_tool_calls=parallel_tool_calls)

    return wrap(fn) if fn is not None else wrap


def _check_agent(max_turns: Any, tool_errors: Any, tool_choice: Any, has_tools: bool) -> None:
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) \
            or not 1 <= max_turns <= 200:
        raise UserError(f"max_turns={max_turns!r}: must be a whole number 1 to 200",
                        param="max_turns")
    if tool_errors not in ("return", "raise"):
        raise UserError(f"tool_errors={tool_errors!r}: must be \"return\" (the error goes "
                        "back to the model) or \"raise\" (the step fails)",
                        param="tool_errors")
    if tool_choice not in ("auto", "required") or (tool_choice == "required"
                                                   and not has_tools):
        raise UserError(f"tool_choice={tool_choice!r}: must be \"auto\" or \"required\" "
                        "(\"required\" needs tools=[...])", param="tool_choice")


def tool(fn: Callable[P, R] | None = None, /, *, name: str | None = None,
         pure: bool = False, timeout_s: float | None = None) -> Any:
    """Mark a function as a client-run step (runs in the app, not on a model).

    Args:
        name: the step's name (default: the function's name).
        pure: the function's result depends on its arguments only and calling it has no
            side effect (a lookup, a parse, a local search): identical calls in one
            workflow (same name, same arguments once resolved) run once and share the
            result, so steps reading them can be merged too (Halo's consolidated graph).
            Leave it False for anything that writes, sends, reads a clock or a changing
            source.
        timeout_s: seconds the app may take over one call of it in a workflow (default:
            the run's ``deadline_s``; with neither, no bound). The deadline clock stops
            while a tool is out, but never past this: a call still running then fails its
            step (``ToolError`` "timed out", or ``DeadlineExceeded`` at the run's
            deadline), the proxy tells the app to cancel it (an async tool's task is
            cancelled; a sync tool's thread cannot be, its result is dropped) and a
            result that arrives later is discarded and recorded in the trace
            (``late_result_ms``).
    """

    def wrap(f: Callable[P, R]) -> Tool[P, R]:
        return Tool(f, name, pure, timeout_s)

    return wrap(fn) if fn is not None else wrap


__all__ = ["Step", "Tool", "step", "tool"]
