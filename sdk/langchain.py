"""LangChain and LangGraph on flowlift: a chat model whose calls are steps of the run.

::

    from flowlift.sdk.langchain import FlowliftChat, areveal, reveal_state

    llm = FlowliftChat(max_tokens=200)          # a LangChain BaseChatModel

    async def route(state):                     # a LangGraph conditional edge
        label = await areveal(state["label"])   # reads the value: the run grows
        return ["diagnose", "reply"] if "bug" in label else ["reply"]

    async with workflow("triage") as wf:
        state = await graph.ainvoke({"ticket": text})   # nodes call llm.ainvoke(...)
    print(reveal_state(state, wf))              # markers -> the steps' outputs

Inside a ``workflow(...)`` block a call of :class:`FlowliftChat` runs nothing: it records
an ``llm`` step of that workflow (named after the LangGraph node that made the call,
``langgraph_node`` in the call's metadata) and answers at once with an ``AIMessage``
whose content is the step's Semantic Variable marker (:mod:`flowlift.sdk.variables`).
The graph carries the marker on in its state; a later call whose messages hold it gets
the dataflow edge (Parrot, Lin et al., OSDI'24), and its prompt receives the value when
the proxy runs it. A value already read and passed on as text makes the edge too: its
verbatim copies become the marker again (:func:`relink`). So LangGraph's supersteps
finish without waiting and the proxy runs the recorded steps in dataflow order:
independent branches at once, a step as soon as its own inputs are done, not at the
end of a superstep (LangGraph's Pregel barrier).

Where the app needs a value (a conditional edge, a tool), :func:`areveal` (``async
with``) / :func:`reveal` (``with``) reads it: that ships the steps recorded so far (the
run is open: :mod:`flowlift.sdk.open_run`) and waits for the ones the text names. After
the block, :func:`reveal_state` replaces every marker in a graph's final state with the
value.

Outside a workflow a call runs eagerly (one step in a workflow of its own) and answers
with the real text. ``langchain-core`` is an optional dependency: ``flowlift`` imports
without it; this module needs it (``pip install flowlift[frameworks]``).

Tools (``bind_tools``, what LangGraph's ``create_react_agent`` and ``ToolNode`` graphs
use): a call with tools is a real chat completion on the proxy
(:mod:`flowlift.sdk.langchain_tools`): it answers with the model's ``tool_calls`` (or
its text) at once, in the model's tool-call format; inside a workflow it carries the
run's id as ``X-Flowlift-Workflow``, so its turns join the run's program.
``with_structured_output(schema)`` is a step whose contract is ``schema`` (constrained
decoding), parsed into it. Per-call options (``.bind(max_tokens=...)``) are refused:
set them as fields.

Errors:
    UserError: a message role or content part a step cannot carry (images, tool calls),
        per-call options, or bad sampling parameters.
    SemanticVariableError: a prompt holding a changed marker (sliced, upper-cased) or a
        marker of another workflow, raised when the call is recorded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from pydantic import BaseModel, ConfigDict, PrivateAttr

from flowlift.credentials import bearer_headers, default_api_key
from flowlift.errors import UserError
from flowlift.graph import Params, Ref, Text
from flowlift.sdk.contracts import output_spec
from flowlift.sdk.langchain_tools import (
    bound_tools,
    chat_body,
    default_model,
    default_model_async,
    post_async,
    post_sync,
    structured_parser,
    tool_answer,
)
from flowlift.sdk.markers import split_prompt
from flowlift.sdk.steps import Step
from flowlift.sdk.variables import SemanticVariable
from flowlift.sdk.workflow import Workflow, current_workflow, default_base_url

_ROLES: dict[type[BaseMessage], str] = {SystemMessage: "system", HumanMessage: "user",
                                        AIMessage: "assistant", ToolMessage: "user"}
_NAME = re.compile(r"[^A-Za-z0-9_-]+")
_CHAT = "/v1/chat/completions"
MIN_RELINK_CHARS = 20  # as the proxy's inferred workflows (``inferred.MIN_OUTPUT_CHARS``)


def _role(message: BaseMessage) -> str:
    for kind, role in _ROLES.items():
        if isinstance(message, kind):
            return role
    raise UserError(f"a {type(message).__name__} cannot be part of a flowlift step's "
                    "prompt: use system, human, AI or tool messages", param="messages")


def _text(message: BaseMessage, i: int) -> str:
    """A message's content as one string (text parts joined; anything else refused)."""
    content = message.content
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            out.append(str(part.get("text", "")))
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise UserError(f"message {i} holds a {kind!r} part: a flowlift step's prompt "
                            "is text only", param=f"messages[{i}].content")
    return "".join(out)


def to_prompt(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages -> the chat messages of a ``@step`` prompt (tool results
    become user messages; markers stay in the text, so they become edges).

    Raises:
        UserError: an unsupported message type or content part.
    """
    return [{"role": _role(m), "content": _text(m, i)} for i, m in enumerate(messages)]


def _step_name(run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
               default: str) -> str:
    """The LangGraph node making the call (``langgraph_node``), as a step name."""
    node = (run_manager.metadata if run_manager is not None else {}).get("langgraph_node")
    name = _NAME.sub("_", str(node or default)).strip("_")[:64]
    return name or default


class FlowliftChat(BaseChatModel):
    """A LangChain chat model whose calls are steps of the current flowlift workflow.

    Attributes:
        model: served model name (None: the proxy's default model).
        max_tokens, temperature, top_p, seed: sampling (OpenAI meanings).
        output: the step's contract, as ``@step(output=...)`` takes it (None: text; a
            ``Literal[...]`` of labels; a regex). A pydantic model's output is its JSON.
        step_name: the step name when the call comes from outside a LangGraph node.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str | None = None
    max_tokens: int | None = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    output: Any = None
    step_name: str = "chat"
    base_url: str | None = None
    """The proxy of calls with tools made outside a workflow (default
    ``$FLOWLIFT_BASE_URL``); inside one, the workflow's."""
    api_key: str | None = None
    _steps: dict[tuple[str, tuple[str, ...]], Step[...]] = PrivateAttr(default_factory=dict)

    @property
    def _llm_type(self) -> str:
        return "flowlift"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

    def _step(self, name: str, stop: Sequence[str]) -> Step[...]:
        key = (name, tuple(stop))
        made = self._steps.get(key)
        if made is None:
            try:
                params = Params(max_tokens=self.max_tokens, temperature=self.temperature,
                                top_p=self.top_p, stop=tuple(stop), seed=self.seed)
            except ValueError as exc:
                raise UserError(f"bad sampling parameters: {exc}", param="params") from None
            made = Step(lambda prompt: prompt, model=self.model,
                        spec=output_spec(self.output), params=params, name=name)
            self._steps[key] = made
        return made

    def _record(self, wf: Workflow, messages: list[BaseMessage], stop: list[str] | None,
                name: str) -> ChatResult:
        prompt = [{**m, "content": relink(m["content"], wf)} for m in to_prompt(messages)]
        var = self._step(name, stop or ())(prompt)
        text = str.__str__(str(var))  # a plain str: LangChain may slice or strip it
        message = AIMessage(content=text, response_metadata={
            "flowlift_step": var.step_id, "flowlift_workflow": wf.name})
        return ChatResult(generations=[ChatGeneration(message=message)])

    @staticmethod
    def _answer(value: Any) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=_str(value)))])

    def _begin(self, kwargs: Mapping[str, Any],
               run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None
               ) -> tuple[str, Workflow | None]:
        """The step name of a call and the workflow it joins (None: run it eagerly)."""
        _no_call_options(kwargs)
        return _step_name(run_manager, self.step_name), current_workflow()

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` (LangChain tools, functions, pydantic models or
        OpenAI tool dicts) offered on each call; ``tool_choice``: ``"auto"``,
        ``"any"``/``"required"``/True (a call is required), ``"none"``, or a tool's
        name.

        Raises:
            UserError: other options.
        """
        return self.bind(**bound_tools(tools, tool_choice), **kwargs)

    def with_structured_output(self, schema: Any, *, include_raw: bool = False,
                               **kwargs: Any) -> Runnable[Any, Any]:
        """A runnable that answers with ``schema`` (a pydantic model, a JSON Schema
        dict, ``Literal[...]``): a step whose contract is ``schema`` (constrained
        decoding; outside a workflow it runs at once, inside one the value is awaited).

        Raises:
            UserError: ``include_raw`` or other options (not supported).
        """
        if include_raw or kwargs:
            raise UserError("FlowliftChat.with_structured_output takes only the schema "
                            "(include_raw and method options are not supported)",
                            param="with_structured_output")
        typed = self.model_copy(update={"output": schema})
        typed._steps = {}
        return typed | structured_parser(schema)

    def _call_tools(self, messages: list[BaseMessage], kwargs: Mapping[str, Any],
                    ) -> tuple[str, dict[str, Any], dict[str, str]]:
        wf = current_workflow()
        url = (wf.base_url if wf is not None else self.base_url or default_base_url())
        body = chat_body(self, messages, kwargs)
        headers = {**bearer_headers(self.api_key or (wf._api_key if wf else None)
                                    or default_api_key())}
        if wf is not None:  # the run's turns with tools are one program (a session)
            headers["X-Flowlift-Session"] = wf.run_id or f"{wf.name}-{wf.nonce}"
        return f"{url.rstrip('/')}{_CHAT}", body, headers

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        if "tools" in kwargs:
            url, body, headers = self._call_tools(messages, {**kwargs, "stop": stop})
            if self.model is None:
                body["model"] = default_model(url.removesuffix(_CHAT), headers)
            return tool_answer(post_sync(url, body, headers))
        name, wf = self._begin(kwargs, run_manager)
        if wf is not None:
            return self._record(wf, messages, stop, name)
        with Workflow(name):
            var = self._step(name, stop or ())(to_prompt(messages))
        return self._answer(var.value)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        if "tools" in kwargs:
            url, body, headers = self._call_tools(messages, {**kwargs, "stop": stop})
            if self.model is None:
                body["model"] = await default_model_async(url.removesuffix(_CHAT), headers)
            return tool_answer(await post_async(url, body, headers))
        name, wf = self._begin(kwargs, run_manager)
        if wf is not None:
            return self._record(wf, messages, stop, name)
        async with Workflow(name):
            var = self._step(name, stop or ())(to_prompt(messages))
        return self._answer(var.value)


def relink(text: str, wf: Workflow) -> str:
    """``text`` with each verbatim copy of an output already read in this run (text of
    at least :data:`MIN_RELINK_CHARS` characters, longest first) put back as that step's
    marker: a value the app read (:func:`areveal`) and wrote into the graph's state as
    text still makes an edge. The prompt the model gets is the same."""
    found = sorted(((v.strip(), sid) for sid, v in wf.outputs.items()
                    if isinstance(v, str) and len(v.strip()) >= MIN_RELINK_CHARS
                    and v.strip() in text), key=lambda vs: -len(vs[0]))
    for value, sid in found:
        text = text.replace(value, str.__str__(str(SemanticVariable(wf, sid))))
    return text


def _no_call_options(kwargs: Mapping[str, Any]) -> None:
    """Refuse per-call options (``.bind(...)``, ``invoke(..., x=...)``, ``bind_tools``):
    a step's sampling is the model's fields; dropping them would be a silent change."""
    if kwargs:
        raise UserError(f"FlowliftChat takes no per-call options (got {sorted(kwargs)}): "
                        "set sampling as fields, FlowliftChat(max_tokens=..., "
                        "temperature=...); for a model that calls tools use a flowlift "
                        "agent step, @step(tools=[...])", param=sorted(kwargs)[0])


def _str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return json.dumps(value, ensure_ascii=False, default=str)


def _workflow(wf: Workflow | None) -> Workflow:
    found = wf or current_workflow()
    if found is None:
        raise UserError("no workflow to read values from: call this inside the "
                        "`with workflow(...)` block, or pass the workflow (`wf=`) after it",
                        param="wf")
    return found


def _parts(text: str | BaseMessage, wf: Workflow) -> list[Text | Ref]:
    raw = _text(text, 0) if isinstance(text, BaseMessage) else text
    return [p for p in split_prompt(raw, wf.nonce, "the text read")
            if isinstance(p, Text | Ref)]


async def areveal(text: str | BaseMessage, wf: Workflow | None = None) -> str:
    """The text with each marker replaced by its step's output: inside ``async with
    workflow(...)`` it waits for those steps (``await var``: the run is open); after
    the block, the outputs the run produced.

    Args:
        text: a string or a message (what a :class:`FlowliftChat` call answered, or text
            built from such answers).
        wf: the workflow (default: the one being recorded here).

    Raises:
        UserError: no workflow here and none given.
        StepFailed: a step named in the text failed.
        SemanticVariableError: a changed marker, or one of another workflow.
    """
    wf = _workflow(wf)
    out = []
    for part in _parts(text, wf):
        if isinstance(part, Text):
            out.append(part.text)
        else:
            out.append(_str(await SemanticVariable(wf, part.ref, part.path)))
    return "".join(out)


def reveal(text: str | BaseMessage, wf: Workflow | None = None) -> str:
    """:func:`areveal` for ``with workflow(...)`` blocks and after a run (``var.get()``).

    Raises:
        UserError, StepFailed, SemanticVariableError: as :func:`areveal`.
    """
    wf = _workflow(wf)
    return "".join(part.text if isinstance(part, Text) else
                   _str(SemanticVariable(wf, part.ref, part.path).get())
                   for part in _parts(text, wf))


def reveal_state(state: Any, wf: Workflow) -> Any:
    """A finished run's LangGraph state (or any value) with every marker replaced by
    its step's output: strings, message contents, and the dicts, lists and tuples
    holding them; other values unchanged.

    Raises:
        StepFailed: a step named in the state failed.
        SemanticVariableError: the run has not produced a named step yet (read inside
            the block with :func:`areveal`).
    """
    if isinstance(state, str):
        return reveal(state, wf)
    if isinstance(state, BaseMessage):
        return state.model_copy(update={"content": reveal(state, wf)})
    if isinstance(state, Mapping):
        return {k: reveal_state(v, wf) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(reveal_state(v, wf) for v in state)
    return state


__all__ = ["MIN_RELINK_CHARS", "FlowliftChat", "areveal", "relink", "reveal", "reveal_state",
           "to_prompt"]
