"""Continuations: an answer preempted mid-way and resumed from its token ids.

A running request is aborted (vLLM ``AsyncLLM.abort``) to make room for interactive
work, and later resumed as a new engine request whose input is the prompt's tokens
plus the tokens generated so far (``GenerationRequest.resume_token_ids``, sent to vLLM as
``prompt_token_ids``: no re-tokenized text), so the prefix cache serves the prompt and
the engine decodes the next token as it would have. With greedy decoding the resumed
answer is token for token the unpreempted one (tests/test_preemption.py proves it on
the fake engine; bench/mixed_load.py checks it on vLLM). Technique: recomputation-based
preemption as in vLLM's own scheduler (Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP 2023, section 4.5), lifted above
the engine so the proxy chooses whom to preempt (Autellix, 2025: program-level
priorities).

What cannot be resumed faithfully, and is therefore never preempted
(:func:`not_resumable`):

* structured outputs (JSON schema, choices, regex): vLLM 0.32 compiles a request's
  grammar when the request arrives and advances it over *output* tokens only
  (``StructuredOutputManager.accept_tokens``); prompt tokens never enter it, and no
  sampling parameter replays a prefix into it. A continuation would restart the grammar
  at the beginning of the document, mid-way through it;
* ``stop`` strings: vLLM matches them against the output text of one request, so a stop
  string spanning the cut would be missed;
* presence and frequency penalties: they count output tokens, and the resumed tokens
  become prompt tokens;
* seeded sampling (``seed`` with ``temperature > 0``): the seeded random stream restarts.

Pure code: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flowlift.local_engine.base import GenerationRequest, Usage

_REPLACEMENT = "\ufffd"


def not_resumable(request: GenerationRequest) -> str | None:
    """Why ``request`` cannot be preempted and resumed faithfully, or None when it can.

    Returns:
        A short reason (``"constrained"``, ``"tools"``, ``"stop strings"``,
        ``"penalties"``, ``"seeded sampling"``), or None.
    """
    s = request.sampling
    if request.constraint is not None:
        return "constrained"
    if request.tools:
        return "tools"
    if s.stop:
        return "stop strings"
    if s.presence_penalty or s.frequency_penalty:
        return "penalties"
    if s.seed is not None and s.temperature > 0:
        return "seeded sampling"
    return None


def remaining_max_tokens(request: GenerationRequest) -> int | None:
    """``max_tokens`` of a continuation: the request's less the tokens already resumed
    (None: no limit). At most 0 means the answer is already complete."""
    limit = request.sampling.max_tokens
    return None if limit is None else limit - len(request.resume_token_ids)


class ContinuationText:
    """The text deltas of a continuation, seamless with what the first part streamed.

    An engine's incremental detokenizer holds back a token that ends inside a multi-byte
    character until the character is whole; a continuation starts a new detokenizer, so
    such a character cut by the preemption would be lost. This decodes the whole answer
    (resumed tokens plus new ones) and hands out what was not yet sent, holding back a
    trailing U+FFFD (an incomplete character) until it completes.

    Args:
        decode: token ids -> text (the model's tokenizer, special tokens skipped).
        resumed: the token ids the answer had before the cut.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str],
                 resumed: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(resumed)
        self._sent = len(decode(self._ids).rstrip(_REPLACEMENT))

    def feed(self, new_ids: Sequence[int], final: bool = False) -> str:
        """The text the tokens ``new_ids`` add (``final``: the last ones, nothing held
        back)."""
        self._ids.extend(new_ids)
        text = self._decode(self._ids)
        if not final:
            text = text.rstrip(_REPLACEMENT)
        delta = text[self._sent:]
        self._sent = max(self._sent, len(text))
        return delta


def merge_usage(attempts: Sequence[Usage], resumed_tokens: int) -> Usage:
    """One answer's usage from its attempts (the first, then each continuation).

    Prompt tokens are counted once (the last attempt's prompt less the
    ``resumed_tokens`` it carried); completion tokens are every token generated, over
    all attempts; cached tokens are the first attempt's (the prompt's prefix-cache hits;
    a continuation's hits on its own earlier tokens are not prompt tokens of the answer).

    Raises:
        ValueError: ``attempts`` is empty.
    """
    if not attempts:
        raise ValueError("no attempts to merge")
    prompt = attempts[-1].prompt_tokens - resumed_tokens
    return Usage(prompt, sum(u.completion_tokens for u in attempts),
                 min(attempts[0].cached_tokens, prompt))
