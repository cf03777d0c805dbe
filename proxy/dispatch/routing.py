"""Which backend answers the next attempt of a request (pure: no I/O, no clock).

A model has *replicas* (equivalent backends) and *fallbacks* (tried in order when no
replica can answer). Among available replicas:

* a request with an affinity key (a workflow or session id) goes to the replica with
  the highest rendezvous hash of (key, replica) -- highest-random-weight hashing
  (Thaler & Ravishankar, 1998). The choice depends only on the key and the set of
  healthy replicas, so it survives a proxy restart and moves only the keys of a replica
  that goes away. Staying on one replica keeps the session's prefix cache warm there
  (the vLLM production stack routes by session for the same reason).
* otherwise the replica with the fewest requests in flight (ties: the first listed).

Backends tried already by this request are avoided while untried ones are available;
a request may come back to one after its backoff.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b


@dataclass(frozen=True, slots=True)
class Route:
    """The backends of one model, by name.

    Attributes:
        model: the model name clients use.
        replicas: equivalent backends, chosen by affinity or load.
        fallbacks: tried in order when no replica is available.
        total_timeout_s: the whole budget of one request, retries included.
        max_attempts: attempts per request across all backends.
    """

    model: str
    replicas: tuple[str, ...]
    fallbacks: tuple[str, ...] = ()
    total_timeout_s: float = 600.0
    max_attempts: int = 4
    _all: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_all", self.replicas + self.fallbacks)

    @property
    def backends(self) -> tuple[str, ...]:
        return self._all


def affinity_score(key: str, backend: str) -> int:
    """Rendezvous weight of ``backend`` for ``key`` (stable across processes)."""
    digest = blake2b(f"{key}\x00{backend}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _best(names: Sequence[str], affinity: str | None, load: Callable[[str], int]) -> str:
    if affinity is not None:
        return max(names, key=lambda n: affinity_score(affinity, n))
    return min(names, key=load)


def pick(route: Route, *, available: Callable[[str], bool], load: Callable[[str], int],
         affinity: str | None = None, tried: Collection[str] = ()) -> str | None:
    """The backend for the next attempt, or None when every backend is unavailable.

    Args:
        route: the model's backends.
        available: whether a backend may take a request now (not cooling down, not full).
        load: requests in flight on a backend.
        affinity: a workflow or session id; None routes by load.
        tried: backends this request already failed on.
    """
    for avoid in (tried, ()):
        replicas = [n for n in route.replicas if n not in avoid and available(n)]
        if replicas:
            return _best(replicas, affinity, load)
        for name in route.fallbacks:
            if name not in avoid and available(name):
                return name
        if not tried:
            break
    return None


def has_untried(route: Route, *, available: Callable[[str], bool],
                tried: Collection[str]) -> bool:
    """Whether an available backend has not been tried yet (then fail over at once)."""
    return any(n not in tried and available(n) for n in route.backends)
