"""The engine interface: what the proxy needs from an inference engine.

The proxy never imports vLLM; it talks to an :class:`Engine`. Implementations:

* :class:`flowlift.local_engine.vllm_engine.VLLMEngine` -- vLLM's ``AsyncLLM`` in process
  (CPU build here and in CI, CUDA build on GPUs).
* :class:`flowlift.testing.FakeEngine` -- a deterministic public test double.

Shapes:
    ``GenerationRequest`` in, an async iterator of ``GenerationChunk`` out. Each chunk
    carries the *new* text since the previous chunk (and, when
    ``SamplingOptions.logprobs`` is set, a :class:`TokenLogprob` per new token); the
    last chunk has ``finish_reason`` set and ``usage`` filled (prompt, completion and
    cached prompt tokens). A request is either chat ``messages`` (the engine applies the
    model's chat template) or a raw ``prompt`` (sent as it is, for legacy completions).

Tools (agent steps): a request may offer ``tools`` (:class:`ToolDef`); an answer that
calls them ends with a chunk whose ``tool_calls`` holds the calls, and the conversation
carries them on (assistant messages with ``tool_calls``, ``tool`` messages with
``tool_call_id``). Engines themselves need not know tools: above them, the proxy's
:class:`~flowlift.proxy.dispatch.steps.StepDispatcher` turns tools into constrained JSON
for the embedded engine, and upstream providers get OpenAI ``tools``.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from flowlift.errors import EngineError, RequestError
from flowlift.local_engine.step_log import StepLog

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call a model asked for: ``arguments`` is its JSON text (OpenAI's shape), as
    the model wrote it (not necessarily valid JSON)."""

    id: str
    name: str
    arguments: str = "{}"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call ``index`` (0-based, in the answer's order) while it is generated,
    as OpenAI streams calls: the first piece of a call has its ``id`` and ``name`` (and
    usually ``arguments == ""``); later pieces have only ``arguments``, the next
    fragment of its JSON text as the model writes it. A call's fragments joined are
    its ``arguments`` in the last chunk's ``tool_calls`` (or a prefix of them: the rest
    is sent at the end)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ToolDef:
    """A function the model may call: ``parameters`` is a JSON Schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object",
                                                                "properties": {}})


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message with plain-text content.

    Attributes:
        role: ``system``, ``user``, ``assistant`` or ``tool``.
        content: its text ("" for an assistant turn that only calls tools).
        tool_calls: the calls of an assistant turn.
        tool_call_id: the call a ``tool`` message answers.
    """

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling parameters (OpenAI names and meanings).

    Attributes:
        max_tokens: upper bound on generated tokens; ``None`` lets the engine choose.
        temperature: 0.0 means greedy decoding.
        top_p: nucleus sampling mass in (0, 1].
        stop: strings that end generation (not included in the output).
        seed: per-request seed for reproducible sampling.
        presence_penalty, frequency_penalty: in [-2, 2]; 0.0 is off.
        logprobs: report the log probability of each generated token and of this many
            most likely alternatives at its position (0 to 20); ``None``: no logprobs.
        logit_bias: ``(token id, bias)`` pairs added to the logits before sampling
            (-100 bans a token, 100 forces it).
    """

    max_tokens: int | None = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """A structured-output constraint enforced by constrained decoding.

    Exactly one of ``json_schema`` (a JSON Schema document), ``choices`` (a fixed
    label set; the output is exactly one of them) or ``regex`` (the whole output
    matches it) is set.
    """

    json_schema: dict[str, Any] | None = None
    choices: tuple[str, ...] | None = None
    regex: str | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation request.

    Attributes:
        request_id: unique id, used by :meth:`Engine.abort`.
        model: a name from :attr:`Engine.model_names`.
        messages: chat messages; the engine applies the model's chat template.
            Ignored when ``prompt`` is set.
        sampling: sampling options.
        constraint: optional structured-output constraint.
        priority: lower runs earlier (vLLM's ``scheduling_policy="priority"``).
        session_id: hint that this request continues an earlier one (prefix reuse).
        agent_id: the agent step this request is a turn of (its step id); None: not an
            agent turn. The agent's own conversation is a sub-session of
            ``session_id``, its parent (the routers with a parent notion get both,
            :mod:`flowlift.proxy.dispatch.routing.fleet_hints`); engines ignore it.
        prompt: raw prompt text used instead of ``messages``, with no chat template
            (the tokenizer's usual special tokens, e.g. a BOS, are still added).
        tools: functions the model may call instead of answering (see the module).
        service_tier: the tier the step was planned on (:mod:`flowlift.tiers`); an
            upstream that ``offers_flex`` is asked ``service_tier: "flex"`` for
            ``"flex"``. Engines ignore it.
        tool_choice: with ``tools``: ``"auto"`` (answer or call) or ``"required"``
            (call at least one), OpenAI's meanings.
        expected_output_tokens: the step's expected output length (the plan's), tokens;
            None: unknown. Engines ignore it; upstream hints carry it
            (:mod:`flowlift.proxy.dispatch.routing.hints`).
        resume_token_ids: the tokens this answer already generated before it was
            preempted (:mod:`flowlift.local_engine.continuation`): an engine whose
            ``capabilities.resume`` is True continues after them (the prompt's tokens
            plus these as its input, ``max_tokens`` less their count) and streams only
            what follows. Empty: a fresh answer.
    """

    request_id: str
    model: str
    messages: Sequence[ChatMessage] = ()
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    constraint: OutputConstraint | None = None
    priority: int = 0
    session_id: str | None = None
    prompt: str | None = None
    tools: tuple[ToolDef, ...] = ()
    service_tier: str | None = None
    tool_choice: Literal["auto", "required"] = "auto"
    expected_output_tokens: int | None = None
    resume_token_ids: tuple[int, ...] = ()
    parallel_tool_calls: bool = True
    """With ``tools``: more than one call per answer allowed (OpenAI's
    ``parallel_tool_calls``)."""
    agent_id: str | None = None


def require_plain(request: GenerationRequest, *, native_tools: bool = False) -> None:
    """For engines that do not take tools themselves (the embedded ones: the proxy's
    dispatcher turns tools into constrained JSON before they get the request), or take
    them only in the model's own format (``native_tools``: the request may carry tools,
    calls and results).

    Raises:
        RequestError: the request offers ``tools`` or carries tool calls or results
            (``param="tools"``).
    """
    if native_tools:
        return
    if request.tools or any(m.tool_calls or m.tool_call_id is not None
                            for m in request.messages):
        raise RequestError("this engine takes no tools, tool calls or tool results: send "
                           "the request through the proxy's StepDispatcher, which turns "
                           "them into constrained JSON (flowlift.proxy.dispatch.tool_turns)",
                           param="tools")


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request; ``cached_tokens`` are prompt tokens served from the
    engine's prefix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token and its log probability (natural log, <= 0).

    Attributes:
        token: the token's text (a piece of a multi-byte character may read as U+FFFD).
        logprob: log probability of the token at its position.
        top: the most likely tokens at this position, most likely first, as
            ``(token, logprob)`` pairs; as many as ``SamplingOptions.logprobs`` asked
            for (the sampled token is among them only when it ranks that high).
    """

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """A piece of a streamed generation: ``text`` is new text since the last chunk.

    ``finish_reason`` (``"stop"``, ``"length"``, or ``"abort"`` after :meth:`Engine.abort`)
    and ``usage`` are set on the last chunk. ``logprobs`` (only when the request asked
    for them) has one entry per token generated since the last chunk. ``tool_calls``
    (last chunk only, with ``finish_reason="tool_calls"``): the calls of an answer to a
    request with ``tools``.
    """

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    service_tier: str | None = None
    """Last chunk of an upstream answer: the ``service_tier`` the provider says served
    it (``"flex"``, ``"default"``...), when it said."""
    token_ids: tuple[int, ...] | None = None
    """The ids of the tokens generated since the last chunk, from an engine whose
    ``capabilities.resume`` is True (what a continuation resumes after); else None."""
    ready_calls: tuple[ToolCall, ...] | None = None
    """Before the last chunk of an answer to a request with ``tools``: calls whose JSON
    became complete with this chunk, while the answer still streams (an agent step
    starts its proxy tools on them: :mod:`flowlift.proxy.wire.early_calls`). A head start
    only: ``tool_calls`` on the last chunk is the answer."""
    call_deltas: tuple[ToolCallDelta, ...] | None = None
    """Any chunk of an answer to a request with ``tools``, the last one included: the
    calls' pieces generated since the chunk before (their names, then their arguments' text as
    it is written), for a client that streams them; ``tool_calls`` on the last chunk
    is the answer, its ids and arguments those the pieces built when they agree."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine can do natively."""

    structured_outputs: bool = False
    prefix_caching: bool = False
    priorities: bool = False
    abort: bool = True
    logprobs: bool = False
    raw_prompt: bool = False
    resume: bool = False
    """Chunks carry ``token_ids`` and requests may carry ``resume_token_ids``."""
    native_tools: bool = False
    """The engine takes ``tools`` in the model's own tool-call format (its chat
    template and vLLM's parser for its family, :mod:`flowlift.local_engine.native_tools`):
    an answer's calls come on its last chunk (``tool_calls``), as an upstream's do."""


class Engine(abc.ABC):
    """An inference engine serving one or more models.

    Lifecycle: ``await start()`` inside the running event loop, then
    ``generate``/``abort``, then ``await close()``.

    Errors: implementations raise :class:`flowlift.errors.EngineError` for failures of
    the engine itself and :class:`flowlift.errors.RequestError` for requests the engine
    rejects (e.g. a prompt longer than the model's context).
    """

    capabilities: Capabilities = Capabilities()

    @property
    @abc.abstractmethod
    def model_names(self) -> Sequence[str]:
        """Names of the models this engine serves (the ``model`` field of requests)."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load models; called once inside the server's event loop."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's processes and memory."""

    def sleep_host_mb(self) -> float:
        """Host memory (MB) a :meth:`sleep` takes (the weights copied off the GPU); 0:
        this engine cannot sleep, so leaving the GPU means :meth:`close`."""
        return 0.0

    async def sleep(self) -> None:
        """Free the engine's GPU memory, keeping its process (then :meth:`wake_up`).

        Raises:
            EngineError: the engine cannot sleep (:meth:`sleep_host_mb` is 0).
        """
        raise EngineError(f"the engine of {', '.join(self.model_names)} cannot sleep")

    async def wake_up(self) -> None:
        """Take the GPU memory a :meth:`sleep` gave back.

        Raises:
            EngineError: the engine cannot sleep.
        """
        raise EngineError(f"the engine of {', '.join(self.model_names)} cannot sleep")

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Stream the generation of ``request`` (an async generator, as ``async def``
        with ``yield`` makes one).

        Closing the generator early (``aclose()``) aborts the request in the engine.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a running request; unknown ids are ignored."""

    async def healthy(self) -> bool:
        """True while the engine can take requests."""
        return True

    def running(self) -> int | None:
        """Requests the engine is still working on (queued or decoding), or ``None`` when
        the engine cannot tell. After a request is aborted or its stream closed, it no
        longer counts: tests use this to prove no generation is left orphaned."""
        return None

    def tokenize(self, model: str, text: str) -> list[int] | None:
        """Token ids of ``text`` in ``model``'s tokenizer, or ``None`` when unknown."""
        return None

    async def prefill(self, request: GenerationRequest, upto: str) -> Usage | None:
        """Compute the KV of the start of a prompt a later request will have, so the
        engine's prefix cache holds it then (prefill-ahead:
        :mod:`flowlift.proxy.dispatch.slots.prefill_ahead`). Nothing is generated for the
        caller.

        Args:
            request: the later request as far as it is known (``messages``, or
                ``prompt``), at the ``priority`` to run at; no ``tools`` (the
                dispatcher turns them into plain messages first).
            upto: a marker inside one message's content: the prefix is the prompt as
                :meth:`generate` would build it (chat template applied) up to the first
                occurrence of ``upto``.

        Returns:
            ``Usage`` (``prompt_tokens``: the prefix's tokens, ``cached_tokens``: those
            the cache already held), or ``None`` when this engine keeps no prefix cache
            (the default: nothing done). Cancelling the call aborts the work.

        Raises:
            RequestError: ``upto`` is not in the prompt, or the prompt is invalid.
            EngineError: the engine failed.
        """
        return None

    def step_log(self) -> StepLog | None:
        """The engine's own timings of its recent steps (what each held, how long it
        took: :mod:`flowlift.local_engine.step_log`), or ``None`` when it keeps none
        (the default)."""
        return None

    def kv_cache_usage(self) -> float | None:
        """Fraction of the engine's KV cache (0 to 1) its requests hold or may take
        before they finish, or ``None`` when the engine cannot tell (the default)."""
        return None

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the engine's KV cache holds in all (blocks times block size), or
        ``None`` when the engine cannot tell (the default): what working-set admission
        (:mod:`flowlift.proxy.dispatch.slots.working_set`) fits sessions into."""
        return None

    def parameters(self, model: str) -> int | None:
        """``model``'s parameter count (the planner's default figures grow with it:
        :func:`flowlift.costs.sized_default`), or ``None`` when unknown (the default)."""
        return None

    def kv_block_tokens(self) -> int | None:
        """Tokens per KV-cache block (the unit the cache allocates and the prefix cache
        keeps), or ``None`` when the engine cannot tell (the default)."""
        return None

    def count_tokens(self, model: str, text: str) -> int | None:
        """Tokens of ``text`` in ``model``'s tokenizer, or ``None`` when unknown."""
        ids = self.tokenize(model, text)
        return None if ids is None else len(ids)
