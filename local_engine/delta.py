"""Delta-only turns: a session's prompt token ids grown by the new messages alone.

An agent session resends its whole conversation every turn; rendering the chat
template over all of it and tokenizing the result costs time linear in the
conversation, every turn (quadratic over a session). When the new request's messages
start with the previous request's messages, only the new messages need rendering and
tokenizing: the previous prompt's ids (without the generation prompt) plus the ids of
the new messages' rendering (the stateful-inference paper's O(Δ) turn).

That is exact only for templates that render each message on its own and tokenizers
that split at the seams between messages (ChatML-style templates: every message is
``<|im_start|>role\\ncontent<|im_end|>\\n``, and special tokens split the text). So
:class:`DeltaPrompts` checks the template once, on probe conversations, that

* ``render(a + b) == render(a, no generation prompt) + tail(b)``, where ``tail(b)`` is
  ``b`` rendered behind a fixed anchor message with the anchor's own rendering cut off
  (the anchor keeps templates that add a default system message from adding it again);
* ``encode(render(a + b)) == encode(render(a, no gen)) + encode(tail(b))``;

and falls back to the full render for any template that fails (or any request whose
messages do not extend the session's previous ones). ``tests/test_delta.py`` checks
the equality with hypothesis on the default model's template.

Pure: the template and the tokenizer are injected (``render``, ``encode``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache

Message = dict[str, Any]
Render = Callable[[list[Message], bool], str]
"""``(messages, add_generation_prompt) -> text`` (the chat template)."""
Encode = Callable[[str], list[int]]
"""``text -> token ids`` (no special tokens added)."""

ANCHOR: list[Message] = [{"role": "system", "content": "anchor"}]
PROBES: list[tuple[list[Message], list[Message]]] = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
     [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "ls -l\n.."}]),
    ([{"role": "user", "content": "first"}],
     [{"role": "assistant", "content": " spaced "}, {"role": "user", "content": "ünï\n"}]),
]


@dataclass(slots=True)
class _Turn:
    messages: list[Message]
    ids: list[int]  # the prompt's ids without the generation prompt


class DeltaPrompts:
    """Prompt ids per session, grown by each turn's new messages.

    Args:
        render: the chat template.
        encode: the tokenizer.
        max_sessions: sessions kept (least recently used forgotten first).

    Attributes:
        exact: whether the template passed the check (False: every prompt is rendered
            and tokenized whole).
        deltas, full: prompts built from a delta, and in full, so far.
    """

    def __init__(self, render: Render, encode: Encode, max_sessions: int = 1024) -> None:
        self._render, self._encode = render, encode
        self._table: LRUCache[str, _Turn] = LRUCache(max_sessions)
        self.deltas = self.full = 0
        self.exact = False
        try:
            anchored = render(ANCHOR, False)
            self._anchor_len = len(anchored)
            self._gen = self._encode(render(ANCHOR, True)[len(anchored):])
            self.exact = all(self._check(a, b) for a, b in PROBES)
        except Exception:  # a template that rejects the probes: no deltas
            self.exact = False

    def _tail(self, messages: list[Message]) -> str:
        """``messages`` rendered as they would follow earlier ones (with the
        generation prompt)."""
        return self._render(ANCHOR + messages, True)[self._anchor_len:]

    def _check(self, a: list[Message], b: list[Message]) -> bool:
        whole = self._render(a + b, True)
        head = self._render(a, False)
        tail = self._tail(b)
        return (whole == head + tail
                and self._encode(whole) == self._encode(head) + self._encode(tail))

    def ids(self, key: str | None, messages: Sequence[Message]) -> list[int]:
        """The prompt ids of ``messages`` (with the generation prompt); ``key``: the
        session (None: no reuse).

        Raises:
            Whatever ``render`` or ``encode`` raise on the messages.
        """
        msgs = list(messages)
        prev = None if key is None or not self.exact else self._table.get(key)
        n = 0 if prev is None else len(prev.messages)
        if prev is not None and len(msgs) > n and msgs[:n] == prev.messages:
            ids = prev.ids + self._encode(self._tail(msgs[n:]))
            self.deltas += 1
        else:
            ids = self._encode(self._render(msgs, True))
            self.full += 1
        g = len(self._gen)
        if key is not None and self.exact and g and ids[-g:] == self._gen:
            self._table[key] = _Turn(msgs, ids[:-g])
        return ids
