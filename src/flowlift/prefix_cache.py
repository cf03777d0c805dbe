"""What an engine's prefix cache probably still holds: the prompts it was sent, in whole
KV blocks (pure bookkeeping, no I/O, no clock).

vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_utils.py``: one hash per full
block, chained through the block before it) keeps the blocks of finished requests until
their room is needed, least recently used first. A prompt that starts with blocks an
earlier request computed is prefilled only from the first block that misses. The proxy
sees every prompt it sends, so it can keep the same chain of block hashes per engine and
tell the compiler, before a run starts, how much of each step's prompt is already there
(a second run over the same documents: 80% of its prompt tokens, which a plan of one
run alone cannot know; bench/RESULTS.md, "Honest plans (issue 38 item 8)").

The hashes are over the token ids the compiler counts in (its tokenizer over its
rendering of the messages), not the engine's chat template, so a block here stands for
``block`` tokens of the prompt's text; the count is an estimate, bounded by the engine's
KV capacity (:meth:`PrefixIndex.add` forgets the least recently used blocks beyond it).

Also here: the compiler's prefix groups (steps of one graph whose prompts start with the
same whole blocks: :func:`prefix_groups`) and the steps whose whole prompt repeats an
earlier one (:func:`repeated_calls`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from flowlift.chains import common_prefix as _lcp
from flowlift.graph import InputNode, LLMNode, Node, ToolNode

DEFAULT_KV_BLOCK = 16
"""Tokens per KV-cache block where the engine does not say (vLLM's default on GPUs; its
CPU build uses 128: :meth:`flowlift.local_engine.base.Engine.kv_block_tokens`)."""


def block_hashes(tokens: Sequence[int], block: int) -> Iterator[int]:
    """One hash per whole ``block`` of ``tokens``, each chained through the one before
    it (as vLLM's ``hash_block_tokens``): equal hashes mean equal prompts up to there."""
    size = max(block, 1)
    parent = 0
    for start in range(0, len(tokens) - size + 1, size):
        parent = hash((parent, tuple(tokens[start:start + size])))
        yield parent


class PrefixIndex:
    """The block hashes of the prompts one engine was sent, least recently used first.

    Args:
        block: tokens per KV block of the engine (vLLM's CPU build: 128).
        capacity_tokens: tokens its KV cache holds (None: no bound known).
    """

    def __init__(self, block: int, capacity_tokens: int | None = None) -> None:
        self.block = max(block, 1)
        self.capacity_blocks = (None if capacity_tokens is None
                                else max(capacity_tokens // self.block, 1))
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, tokens: Sequence[int]) -> None:
        """A prompt of ``tokens`` was computed: its whole blocks are (most recently) in
        the cache; the least recently used beyond the capacity are forgotten."""
        for h in reversed(list(block_hashes(tokens, self.block))):  # as vLLM frees them:
            self._blocks[h] = None  # a prompt's last block is the first to be evicted
            self._blocks.move_to_end(h)
        while self.capacity_blocks is not None and len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def cached(self, tokens: Sequence[int]) -> int:
        """Leading tokens of ``tokens`` whose blocks are in the cache (whole blocks: a
        multiple of ``block``)."""
        hit = 0
        for h in block_hashes(tokens, self.block):
            if h not in self._blocks:
                break
            hit += self.block
        return hit

    def __len__(self) -> int:
        return len(self._blocks)


def prefix_groups(prefixes: dict[str, tuple[str, Sequence[int]]],
                  block: Callable[[str], int] = lambda model: DEFAULT_KV_BLOCK
                  ) -> list[tuple[int, list[str]]]:
    """Groups of nodes (same model) whose prompts start with at least one whole KV block
    of the same tokens: ``[(shared_tokens, [node ids in dispatch order])]``, the shared
    tokens rounded down to whole blocks of the model's engine (``block(model)``, tokens):
    vLLM's prefix cache keeps and hits whole blocks only, so a shared start shorter than
    one block saves nothing and is no group (its siblings need not wait for a leader)."""
    ordered = sorted(prefixes.items(), key=lambda kv: (kv[1][0], tuple(kv[1][1])))
    groups: list[tuple[int, list[str]]] = []
    run: list[str] = []
    run_len = 0

    def close() -> None:
        if len(run) > 1:
            size = max(block(prefixes[run[0]][0]), 1)
            groups.append((run_len // size * size, run))

    prev: tuple[str, Sequence[int]] | None = None
    for nid, (model, toks) in ordered:
        lcp = _lcp(prev[1], toks) if prev is not None and prev[0] == model else 0
        if lcp >= max(block(model), 1):
            run.append(nid)
            run_len = min(run_len, lcp) if len(run) > 2 else lcp
        else:
            close()
            run, run_len = [nid], 0
        prev = (model, toks)
    close()
    return groups


def whole_blocks(tokens: float, block: int) -> int:
    """``tokens`` rounded down to whole blocks of ``block``."""
    size = max(block, 1)
    return int(tokens) // size * size


def deterministic(node: LLMNode) -> bool:
    """Greedy or seeded sampling: the same prompt gives the same output."""
    return node.params.temperature == 0.0 or node.params.seed is not None


def repeated_calls(order: Sequence[str], nodes: dict[str, Node],
                   deps: dict[str, frozenset[str]], warm: dict[str, bool]) -> set[str]:
    """Model steps whose whole prompt was most likely sent before (in the engine's prefix
    cache): deterministic (greedy or seeded), no tools, the literal start of their prompt
    in the cache in whole blocks (``warm``: step -> so), and every input a constant, a
    ``pure`` tool of such inputs, or such a step -- whose output is then the same as the
    last time, so the rest of the prompt is too (a second run over the same documents:
    its ``classify`` and ``summarize`` prompts were 70-90% cached, beyond the literal
    start the plan reads)."""
    same: set[str] = set()
    for nid in order:
        node = nodes[nid]
        inputs = all(d in same for d in deps[nid])
        tool = isinstance(node, ToolNode) and node.pure and inputs
        call = isinstance(node, LLMNode) and inputs and warm.get(nid, False) \
            and not node.tools and deterministic(node)
        if isinstance(node, InputNode) or tool or call:
            same.add(nid)
    return same


__all__ = ["DEFAULT_KV_BLOCK", "PrefixIndex", "block_hashes", "deterministic", "prefix_groups",
           "repeated_calls", "whole_blocks"]
