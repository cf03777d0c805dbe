"""A small BM25 index over the corpus, in pure Python (no dependencies).

The pipeline's ``related`` tool queries it with what the model extracted (key terms
and purpose) to find the other modules a reader of one module's page should see.

Tokens are lower-cased words with a crude suffix stripper (``parser``, ``parsing``
and ``parse`` all become ``pars``) and without common English stop words. Scoring
is Okapi BM25 (k1=1.5, b=0.75) with the non-negative idf ``log(1 + (N - n + 0.5) /
(n + 0.5))``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping

_STOP = """
a about above after again all also an and any are as at be because been before being
between both but by can could do does doing done each either etc for from further had
has have having here how however if in into is it its itself just may more most much
must no nor not of off on once one only or other our out over own same see should
since so some such than that the their them then there these they this those through
to too under until up use used uses using very via was way we were what when where
which while who whom why will with within without would you your
"""
STOP_WORDS = frozenset(_STOP.split())

_SUFFIXES = ("ations", "ation", "ings", "ions", "ing", "ion", "ers", "er", "ed", "es",
             "s", "e")


def stem(word: str) -> str:
    """Strip one common English suffix when at least four letters remain."""
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 4:
            return word[:-len(suffix)]
    return word


def tokenize(text: str) -> list[str]:
    """Lower-cased, stemmed words of two or more letters, stop words removed."""
    words = re.findall(r"[a-z][a-z0-9]+", text.lower())
    return [stem(w) for w in words if w not in STOP_WORDS]


class BM25Index:
    """Okapi BM25 over named documents.

    Args:
        documents: name -> text. The name is indexed too (``urllib.parse`` adds the
            tokens ``urllib`` and ``pars``).
        k1, b: the usual BM25 parameters.
    """

    def __init__(self, documents: Mapping[str, str], *, k1: float = 1.5,
                 b: float = 0.75) -> None:
        if not documents:
            raise ValueError("BM25Index needs at least one document")
        self.k1, self.b = k1, b
        self.names = list(documents)
        self._tf: list[Counter[str]] = [Counter(tokenize(f"{name} {text}"))
                                        for name, text in documents.items()]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg_len = sum(self._len) / len(self._len) or 1.0
        df: Counter[str] = Counter()
        for tf in self._tf:
            df.update(tf.keys())
        n = len(self.names)
        self._idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def __len__(self) -> int:
        return len(self.names)

    def scores(self, query: str) -> dict[str, float]:
        """BM25 score of every document for ``query`` (repeated terms weigh more)."""
        q = Counter(tokenize(query))
        out: dict[str, float] = {}
        for name, tf, length in zip(self.names, self._tf, self._len, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / self._avg_len)
            total = 0.0
            for term, qf in q.items():
                f = tf.get(term, 0)
                if f:
                    total += qf * self._idf[term] * f * (self.k1 + 1) / (f + norm)
            out[name] = total
        return out

    def search(self, query: str, k: int = 3, *, exclude: Iterable[str] = ()
               ) -> list[tuple[str, float]]:
        """The ``k`` best documents with a positive score, best first (ties by name)."""
        skip = set(exclude)
        ranked = sorted(((s, name) for name, s in self.scores(query).items()
                         if s > 0 and name not in skip), key=lambda p: (-p[0], p[1]))
        return [(name, s) for s, name in ranked[:k]]


__all__ = ["STOP_WORDS", "BM25Index", "stem", "tokenize"]
