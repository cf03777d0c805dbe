"""Document chains: the steps of a run that re-read one another's prompt prefix.

A pipeline over a corpus (extract, then classify, then answer questions about the same
document) sends, per document, several prompts that start with the same text. A
request-level client runs it stage by stage: every document's first step, then every
document's second; once the corpus outgrows the engine's KV cache, each document's
prefix is evicted before its next step comes and is prefilled again at every stage.
A workflow server sees the whole graph and can keep a document's steps together while
its text is cached (Parrot, OSDI'24: shared prefixes across a program's requests;
Halo, 2025: consolidating a batch's agentic workflows to share computation).

A *chain* is what the scheduler keeps together: a model step joins the chain of the
model step among its direct inputs whose literal prompt prefix shares the most tokens
with its own, when that is at least one whole KV block (``block`` tokens: vLLM's prefix
cache keeps and hits whole blocks only); otherwise it starts a chain of its own. One
parent at most, so a step that reads many documents (a final report) joins one chain
and does not merge them all. The chain is named by its first step.

Working-set admission (:mod:`flowlift.proxy.dispatch.slots.working_set`) then treats a
chain as one session: its KV footprint is what its next step re-reads, and a new
chain (a new document) starts only while the chains already started still fit the
cache; their next steps go first.

Pure code: token ids in, step ids out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

Prefix = tuple[str, Sequence[int]]
"""A model step's (model, literal prompt prefix tokens)."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` start with in common."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def chain_parent(prefix: Prefix, inputs: Sequence[tuple[str, Prefix]],
                 block: Callable[[str], int]) -> str | None:
    """The input whose chain a step with ``prefix`` joins: of ``inputs`` (its model-step
    inputs as ``(step id, prefix)``, in dependency order), the one on the same model
    sharing the longest prefix with it, at least ``block(model)`` tokens (the first
    such on a tie); None: it starts its own chain."""
    model, tokens = prefix
    best, best_len = None, max(block(model), 1) - 1
    for sid, (other_model, other) in inputs:
        if other_model != model:
            continue
        n = common_prefix(tokens, other)
        if n > best_len:
            best, best_len = sid, n
    return best


def document_chains(order: Sequence[str], deps: Mapping[str, frozenset[str]],
                    prefixes: Mapping[str, Prefix],
                    block: Callable[[str], int]) -> dict[str, str]:
    """Every model step of ``prefixes`` -> the first step of its chain.

    Args:
        order: the steps, each after its inputs.
        deps: step -> the steps it reads.
        prefixes: model step -> (model, literal prefix tokens); steps absent here
            (tools, constants, merged identical calls) join no chain.
        block: model -> tokens per KV block.
    """
    pos = {sid: i for i, sid in enumerate(order)}
    chain: dict[str, str] = {}
    for sid in order:
        if sid not in prefixes:
            continue
        inputs = [(d, prefixes[d]) for d in sorted(deps.get(sid, ()), key=pos.__getitem__)
                  if d in prefixes]
        parent = chain_parent(prefixes[sid], inputs, block)
        chain[sid] = sid if parent is None else chain[parent]
    return chain


def members(chain: Mapping[str, str]) -> dict[str, list[str]]:
    """Chain -> its steps (in ``chain``'s order)."""
    out: dict[str, list[str]] = {}
    for sid, root in chain.items():
        out.setdefault(root, []).append(sid)
    return out
