"""The fake engine and what tests read its answers with: :class:`FakeEngine` (a model-free
:class:`flowlift.local_engine.base.Engine`), its responders and schema examples, SSE
parsing, and a proxy started in a subprocess (:func:`running_proxy`). Re-exported by
:mod:`flowlift.testing`."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import heapq
import itertools
import json
import os
import re
import re._constants as _rc  # type: ignore[import-not-found]
import re._parser as _rp  # type: ignore[import-not-found]
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from cachetools import LRUCache

from flowlift.errors import EngineError, RequestError
from flowlift.local_engine.base import (
    Capabilities,
    Engine,
    GenerationChunk,
    GenerationRequest,
    TokenLogprob,
    Usage,
    require_plain,
)

Responder = Callable[[GenerationRequest], str]


def _category(cat: Any) -> str:
    return {_rc.CATEGORY_DIGIT: "0", _rc.CATEGORY_SPACE: " "}.get(cat, "a")


def _in_class(av: Any) -> str:
    if av and av[0][0] is _rc.NEGATE:
        banned = {chr(x) for op, x in av[1:] if op is _rc.LITERAL}
        return next(ch for ch in "abcxyz0 " if ch not in banned)
    op, x = av[0]
    if op is _rc.LITERAL:
        return chr(x)
    return chr(x[0]) if op is _rc.RANGE else _category(x)


def _walk(items: Any) -> str:
    rules: dict[Any, Callable[[Any], str]] = {
        _rc.LITERAL: chr,
        _rc.NOT_LITERAL: lambda av: "a" if chr(av) != "a" else "b",
        _rc.ANY: lambda av: "a",
        _rc.IN: _in_class,
        _rc.BRANCH: lambda av: _walk(av[1][0]),
        _rc.SUBPATTERN: lambda av: _walk(av[-1]),
        _rc.MAX_REPEAT: lambda av: _walk(av[2]) * max(av[0], 0),
        _rc.MIN_REPEAT: lambda av: _walk(av[2]) * max(av[0], 0),
        _rc.POSSESSIVE_REPEAT: lambda av: _walk(av[2]) * max(av[0], 0),
        _rc.CATEGORY: _category,
    }
    return "".join(rules[op](av) for op, av in items if op in rules)


def example_for_pattern(pattern: str) -> str:
    """A short string matching ``pattern`` (a walk of the regex's parse tree: literals,
    classes, alternations, repeats at their minimum count; anchors are skipped)."""
    return _walk(_rp.parse(pattern))


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    """A local ``$ref`` (a JSON pointer such as ``#/$defs/x`` or ``#/definitions/x``)."""
    node: Any = root
    for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else ():
        node = node[part.replace("~1", "/").replace("~0", "~")]
    if not isinstance(node, dict):
        raise ValueError(f"$ref {ref!r} does not point to a schema")
    return node


def example_for_schema(schema: dict[str, Any], root: dict[str, Any] | None = None,
                       depth: int = 0) -> Any:
    """A small instance that satisfies ``schema`` (objects, arrays, enums, local ``$ref``
    pointers...). Without ``required`` every property is filled, except below 8 levels
    of nesting, so recursive schemas end.

    Raises:
        ValueError: an unresolvable ``$ref``, an empty ``enum``, or nesting past 32 levels
            (a schema no instance can be built for this way).
    """
    root = root if root is not None else schema
    if depth > 32:
        raise ValueError("schema nests deeper than 32 levels (a required recursion?)")
    if "$ref" in schema:
        try:
            target = _resolve(schema["$ref"], root)
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"$ref {schema['$ref']!r} points to nothing") from None
        return example_for_schema(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        if not schema["enum"]:
            raise ValueError("enum is empty: no value can satisfy it")
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example_for_schema(schema[key][0], root, depth + 1)
    kind = schema.get("type", "object")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object":
        props = schema.get("properties", {})
        keys = schema.get("required", props if depth < 8 else ())
        return {k: example_for_schema(props.get(k, {"type": "string"}), root, depth + 1)
                for k in keys}
    if kind == "array":
        item = schema.get("items", {"type": "string"})
        return [example_for_schema(item, root, depth + 1)
                for _ in range(schema.get("minItems", 1))]
    return _scalar_example(kind, schema)


def _scalar_example(kind: str, schema: dict[str, Any]) -> Any:
    if kind == "string":
        if "pattern" in schema:
            return example_for_pattern(schema["pattern"])
        return "x" * max(1, schema.get("minLength", 1))
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    return True if kind == "boolean" else None


def default_responder(request: GenerationRequest) -> str:
    """Choices -> the first label; JSON Schema -> a minimal instance; regex -> a short
    matching string; text -> an echo of the raw prompt or of the last message."""
    c = request.constraint
    if c is not None and c.choices:
        return c.choices[0]
    if c is not None and c.json_schema is not None:
        return json.dumps(example_for_schema(c.json_schema))
    if c is not None and c.regex is not None:
        return example_for_pattern(c.regex)
    if request.prompt is not None:
        return f"echo: {request.prompt}"
    last = request.messages[-1].content if request.messages else ""
    return f"echo: {last}"


def tool_calls_text(*calls: tuple[str, Mapping[str, Any]]) -> str:
    """What the embedded engine generates to call tools: the constrained JSON of an
    answer that calls ``(name, arguments)`` in order (see
    :mod:`flowlift.proxy.wire.tool_calls`). A responder returns it to script
    a model that calls tools (e.g. an agent step's turn); a plain string is an answer.
    """
    return json.dumps({"tool_calls": [{"name": n, "arguments": dict(a)} for n, a in calls]})


def cut(text: str, stop: Sequence[str], max_tokens: int | None) -> tuple[str, str]:
    """Where a generation of ``text`` ends, as an engine would end it: before the first
    ``stop`` string (finish ``"stop"``, the stop string left out, as OpenAI and vLLM do),
    else after ``max_tokens`` fake tokens (whitespace-separated words; finish
    ``"length"``), constrained outputs included (vLLM cuts those too).

    Returns:
        ``(text, finish_reason)``.
    """
    ends = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if ends:
        text = text[:min(ends)]
    words = fake_tokens(text)
    if max_tokens is not None and len(words) > max_tokens:
        return "".join(words[:max_tokens]), "length"
    return text, "stop"


def fake_tokens(text: str) -> list[str]:
    """The fake tokenization: each word with the whitespace before it (the pieces join
    back into ``text``; trailing whitespace stays on the last piece)."""
    pieces = re.findall(r"\s*\S+", text)
    if pieces:
        pieces[-1] += text[len("".join(pieces)):]
    return pieces


def fake_logprob(token: str, k: int) -> TokenLogprob:
    """A deterministic, plausible logprob for ``token``: its own logprob in
    [-1.5, -0.2] from a CRC of its text, ranked first, then ``k - 1`` made-up
    alternatives (``"<token>~1"``, ...) each about e^-1 less likely (the probabilities
    of a position sum to less than 1)."""
    own = -0.2 - (zlib.crc32(token.encode()) % 1000) / 1000 * 1.3
    alts = [(f"{token.strip() or token}~{i}", round(own - 1.5 - i, 4)) for i in range(1, k)]
    own = round(own, 4)
    return TokenLogprob(token, own, ((token, own), *alts) if k else ())


class SeenPrompts(LRUCache[tuple[str, ...], None]):
    """The fake engine's simulated prefix cache: the prompts (as words) it has seen, the
    least recently used dropped, also kept sorted -- the longest cached prefix of a prompt
    is shared with one of its neighbours in sorted order, so a lookup compares two
    prompts, not every prompt held."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self._sorted: list[tuple[str, ...]] = []

    def __setitem__(self, key: tuple[str, ...], value: None) -> None:
        fresh = key not in self
        super().__setitem__(key, value)
        if fresh:
            bisect.insort(self._sorted, key)

    def __delitem__(self, key: tuple[str, ...]) -> None:
        super().__delitem__(key)
        del self._sorted[bisect.bisect_left(self._sorted, key)]

    def longest_prefix(self, words: tuple[str, ...]) -> int:
        """How many of ``words`` the longest held prompt starts with (words)."""
        at = bisect.bisect_left(self._sorted, words)
        return max((_common_words(self._sorted[i], words) for i in (at - 1, at)
                    if 0 <= i < len(self._sorted)), default=0)


def _common_words(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class FakeEngine(Engine):
    """A deterministic engine for tests.

    Args:
        models: model names served.
        responder: request -> full output text (default :func:`default_responder`).
        delay_s: sleep before each chunk (simulates decode time).
        chunk_chars: characters per streamed chunk.
        fail_with: if set, every request raises this error.
        fail_after_chunks: with ``fail_with``, stream this many chunks first (a failure
            in the middle of a stream).
        max_running: most requests generating at once (like vLLM's ``max_num_seqs``);
            the others wait and are admitted by ``priority`` (lower first), then arrival.
            ``None``: no limit.
        structured_outputs: False makes it a backend without native structured output
            (``capabilities.structured_outputs`` is False), like a plain upstream: the
            constraint still reaches the responder, which may ignore it.
        logprob: with it, ``(token) -> logprob`` replaces :func:`fake_logprob`'s own
            logprob (tests of confidence floors).
        prefill_delay_s: how long :meth:`prefill` takes (tests of prefill-ahead).
        kv_usage: ``() -> fraction`` that :meth:`kv_cache_usage` reports (tests of
            memory pressure); ``None``: unknown.
        kv_block: tokens per KV block that :meth:`kv_block_tokens` reports (128: as
            vLLM's CPU build); ``None``: unknown.
        parameters: the parameter count :meth:`parameters` reports for every model
            (``None``: unknown).

    Attributes:
        requests: every request received, in order.
        aborted: ids of requests closed or aborted before they finished.
        prefills: every :meth:`prefill` asked for, as ``(request, prefix text)``.
        prefilled: ids of the prefills that finished (their words are cached).
    """

    capabilities = Capabilities(structured_outputs=True, prefix_caching=True, priorities=True,
                                logprobs=True, raw_prompt=True, resume=True)

    def __init__(self, models: Sequence[str] = ("fake-model",), *,
                 responder: Responder = default_responder, delay_s: float = 0.0,
                 chunk_chars: int = 4, fail_with: Exception | None = None,
                 fail_after_chunks: int = 0, max_running: int | None = None,
                 structured_outputs: bool = True,
                 logprob: Callable[[str], float] | None = None,
                 prefill_delay_s: float = 0.0,
                 kv_usage: Callable[[], float] | None = None,
                 kv_block: int | None = None, parameters: int | None = None) -> None:
        if not structured_outputs:
            self.capabilities = dataclasses.replace(self.capabilities,
                                                    structured_outputs=False)
        self.logprob = logprob
        self._models = list(models)
        self.responder = responder
        self.delay_s = delay_s
        self.chunk_chars = chunk_chars
        self.fail_with = fail_with
        self.fail_after_chunks = fail_after_chunks
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.started = False
        self.max_running = max_running
        self._seen = SeenPrompts(maxsize=4096)
        self._active: set[str] = set()  # admitted, generating
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._abort_flags: set[str] = set()
        self.prefill_delay_s = prefill_delay_s
        self._kv_usage = kv_usage
        self.kv_block = kv_block
        self.parameter_count = parameters
        self.prefills: list[tuple[GenerationRequest, str]] = []
        self.prefilled: list[str] = []

    @property
    def model_names(self) -> Sequence[str]:
        return self._models

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False

    def _cached(self, words: tuple[str, ...]) -> int:
        best = self._seen.longest_prefix(words)
        self._seen[words] = None
        return best

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Stream the responder's text in ``chunk_chars`` pieces (one fake token per chunk
        when logprobs are asked for); tokens are whitespace-separated words. Each chunk's
        ``token_ids`` holds one id (:func:`piece_id`). A continuation
        (``resume_token_ids``) streams the pieces after as many as it resumes: like a
        greedy model, what it generates next depends on what it was given, so a piece
        lost or repeated by whoever resumed shows in the output. Its usage counts the
        resumed pieces as prompt tokens and only the words it adds as completion."""
        if request.model not in self._models:
            raise EngineError(f"fake engine does not serve {request.model!r}")
        # like the embedded engine: tools arrive as constrained JSON, or in the model's
        # own format where it takes them (flowlift.testing.native)
        require_plain(request, native_tools=self.capabilities.native_tools)
        self.requests.append(request)
        if self.fail_with is not None and not self.fail_after_chunks:
            raise self.fail_with
        prompt = self.prompt_text(request)
        words = tuple(prompt.split())
        cached = self._cached(words)
        try:
            text = self.responder(request)
        except ValueError as exc:  # what vLLM's grammar compiler rejects, the fake does too
            raise RequestError(f"the output constraint was rejected: {exc}",
                               param="response_format") from None
        text, finish = cut(text, request.sampling.stop, request.sampling.max_tokens)
        k = request.sampling.logprobs
        if k is None:
            pieces = [text[i:i + self.chunk_chars]
                      for i in range(0, max(len(text), 1), self.chunk_chars)]
        else:
            pieces = fake_tokens(text)
        rid = request.request_id
        finished = False
        resumed = len(request.resume_token_ids)  # a continuation: the pieces it had
        before = "".join(pieces[:resumed])
        try:
            await self._admit(rid, request.priority)
            sent: list[str] = []
            for n, piece in enumerate(pieces[resumed:]):
                if self.fail_with is not None and n == self.fail_after_chunks:
                    raise self.fail_with
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if rid in self._abort_flags:
                    finish = "abort"
                    break
                sent.append(piece)
                yield GenerationChunk(text=piece, logprobs=None if k is None else (
                    self._logprob(piece, k),), token_ids=(piece_id(piece),))
            finished = True
            usage = Usage(len(words) + resumed, len((before + "".join(sent)).split())
                          - len(before.split()), cached)
            yield GenerationChunk(text="", finish_reason=finish, usage=usage,
                                  logprobs=None if k is None else (), token_ids=())
        finally:
            self._release(rid)
            if not finished:
                self.aborted.append(rid)

    def _logprob(self, piece: str, k: int) -> TokenLogprob:
        lp = fake_logprob(piece, k)
        if self.logprob is None:
            return lp
        own = self.logprob(piece)
        return TokenLogprob(piece, own, ((piece, own), *lp.top[1:]) if k else ())

    async def _admit(self, request_id: str, priority: int) -> None:
        """Wait for a free slot (``max_running``); lower priority numbers first."""
        if self.max_running is not None and len(self._active) >= self.max_running:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (priority, next(self._arrivals), fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # admitted, then cancelled
                    self._active.add(request_id)
                raise
        self._active.add(request_id)

    def _release(self, request_id: str) -> None:
        self._abort_flags.discard(request_id)
        if request_id not in self._active:
            return
        self._active.discard(request_id)
        while self._waiting and (self.max_running is None
                                 or len(self._active) < self.max_running):
            *_, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)
                return

    async def abort(self, request_id: str) -> None:
        """Stop a running request: its stream ends with ``finish_reason="abort"``."""
        if request_id in self._active:
            self._abort_flags.add(request_id)
        self.aborted.append(request_id)

    def running(self) -> int:
        """Requests generating or waiting for a slot."""
        return len(self._active) + sum(not f.done() for *_, f in self._waiting)

    def tokenize(self, model: str, text: str) -> list[int] | None:
        return [hash(w) & 0xFFFFFFFF for w in text.split()]

    @staticmethod
    def prompt_text(request: GenerationRequest) -> str:
        """The fake's prompt: ``prompt``, or ``"role: content"`` of each message joined
        with spaces (its tokens are the whitespace-separated words)."""
        if request.prompt is not None:
            return request.prompt
        return " ".join(f"{m.role}: {m.content}" for m in request.messages)

    async def prefill(self, request: GenerationRequest, upto: str) -> Usage:
        """Cache the words of the prompt before ``upto`` after ``prefill_delay_s`` (a
        later prompt that starts with them counts them as ``cached_tokens``); the last
        word is left out, as the real engine leaves out the last token.

        Raises:
            EngineError: the model is not served here.
            RequestError: ``upto`` is not in the prompt.
        """
        if request.model not in self._models:
            raise EngineError(f"fake engine does not serve {request.model!r}")
        require_plain(request, native_tools=self.capabilities.native_tools)
        text = self.prompt_text(request)
        cut = text.find(upto)
        if cut < 0:
            raise RequestError("prefill-ahead: the marker is not in the prompt",
                               param="messages")
        self.prefills.append((request, text[:cut]))
        words = tuple(text[:cut].split())[:-1]
        try:
            if self.prefill_delay_s:
                await asyncio.sleep(self.prefill_delay_s)
        except asyncio.CancelledError:
            self.aborted.append(request.request_id)
            raise
        cached = self._cached(words)
        self.prefilled.append(request.request_id)
        return Usage(len(words), 1, cached)

    def kv_cache_usage(self) -> float | None:
        return None if self._kv_usage is None else self._kv_usage()

    def kv_block_tokens(self) -> int | None:
        return self.kv_block

    def parameters(self, model: str) -> int | None:
        return self.parameter_count


def piece_id(piece: str) -> int:
    """The fake token id of a streamed piece (a CRC of its text)."""
    return zlib.crc32(piece.encode())


def parse_sse(text: str) -> list[tuple[str, Any]]:
    """``[(event, data)]`` of a whole SSE body; ``data`` is JSON-decoded when it is JSON.

    For assertions on recorded streams in tests; clients should use an SSE library
    (``httpx-sse``).
    """
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            raw = "\n".join(data)
            try:
                events.append((name, json.loads(raw)))
            except json.JSONDecodeError:
                events.append((name, raw))
    return events


@contextlib.contextmanager
def running_proxy(*serve_args: str, log_path: str | os.PathLike[str],
                  ready_timeout_s: float = 900.0,
                  port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``flowlift serve`` in a subprocess until the block ends.

    Yields ``(base_url, process)`` once ``/readyz`` answers 200.

    Raises:
        RuntimeError: the proxy exited, its engine failed to load, or it was not ready
            within ``ready_timeout_s`` (the message ends with its log).
    """
    import httpx

    port = port or free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flowlift.cli", "serve", "--port", str(port), *serve_args]
    log = Path(log_path)
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"proxy exited ({proc.returncode}): "
                                   f"{log.read_text(errors='replace')[-3000:]}")
            try:
                r = httpx.get(f"{base}/readyz", timeout=2)
                if r.status_code == 200:
                    break
                if r.json().get("error"):
                    raise RuntimeError(f"engine failed to load: {r.json()['error']}")
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > ready_timeout_s:
                raise RuntimeError(f"proxy not ready in {ready_timeout_s:.0f} s: "
                                   f"{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])



def idle_core(seconds: float = 3600.0) -> None:
    """The body of :class:`FakeEngineWithCore`'s child process: sleep (an engine core
    waiting for work)."""
    time.sleep(seconds)


class FakeEngineWithCore(FakeEngine):
    """A :class:`FakeEngine` that, like vLLM's CPU build, starts an engine-core child
    process with multiprocessing's ``spawn`` method from a worker thread as it starts
    (``flowlift serve --engine fake --fake-core-process``), and stops it as it closes:
    for tests that no engine process outlives the proxy.

    Attributes:
        core_pid: the child's pid while it runs, else None.
    """

    def __init__(self, models: Sequence[str] = ("fake-model",), **kwargs: Any) -> None:
        super().__init__(models, **kwargs)
        self._core: Any = None

    @property
    def core_pid(self) -> int | None:
        return None if self._core is None else int(self._core.pid)

    async def start(self) -> None:
        import multiprocessing

        def spawn() -> None:
            self._core = multiprocessing.get_context("spawn").Process(
                target=idle_core, name="fake-engine-core", daemon=True)
            self._core.start()

        await asyncio.to_thread(spawn)  # as vLLM builds its engine: off the event loop
        await super().start()

    async def close(self) -> None:
        if self._core is not None:
            self._core.terminate()
            await asyncio.to_thread(self._core.join, 10)
            self._core = None
        await super().close()
