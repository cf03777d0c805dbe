"""Which backend answers the next attempt of a request (pure: no I/O, no clock).

A model has *replicas* (equivalent backends) and *fallbacks* (tried in order when no
replica can answer). Among available replicas:

* a request with an affinity key (a workflow or session id) goes to the replica with
  the highest rendezvous hash of (key, replica) -- highest-random-weight hashing
  (Thaler & Ravishankar, 1998). The choice depends only on the key and the set of
  healthy replicas, so it survives a proxy restart and moves only the keys of a replica
  that goes away. Staying on one replica keeps the session's prefix cache warm there
  (the vLLM production stack routes by session for the same reason).
* otherwise, by the route's ``strategy``:

  - ``"predicted-latency"`` (the default): the replica with the smallest predicted
    completion time for this request (:mod:`flowlift.proxy.dispatch.routing.latency`, after
    llm-d's predicted-latency scorer); a replica with too few recent answers to predict
    counts as fast as the best predicted one and wins the tie, so it gets explored, one
    request at a time (while one is in flight there, the replica is left out).
    Other ties, and a route where nothing is predicted yet: the fewest requests in
    flight. Here affinity is
    bounded: the affinity replica wins only while it is predicted at most
    ``affinity_max_slowdown`` times slower than the best (a warm prefix cache is worth
    that much, a replica stuck behind a long queue is not); past it, the key goes to
    the next replica in its rendezvous order that is within the bound, so a session
    that must move still moves to one stable replica. A difference within noise never
    moves a key: the affinity replica also wins while it is predicted at most
    :data:`AFFINITY_MIN_MARGIN_S` slower, or slower by no more than the two replicas'
    measured spread (each one's mean absolute prediction error,
    :meth:`flowlift.proxy.dispatch.routing.latency.LatencyBook.spread`): ratios of sub-millisecond
    predictions, or of predictions the measurements cannot tell apart, are noise, and a
    session moved for noise loses its warm prefix cache for nothing (issue 38, item 11).
  - ``"least-loaded"``: the fewest requests in flight (ties: the first listed).
  - ``"round-robin"``: each replica in turn.

  With ``"least-loaded"`` and ``"round-robin"`` affinity always wins.

Backends tried already by this request are avoided while untried ones are available;
a request may come back to one after its backoff.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

from flowlift.proxy.config import Strategy

STRATEGIES: tuple[Strategy, ...] = ("predicted-latency", "least-loaded", "round-robin")
AFFINITY_MIN_MARGIN_S = 0.005
"""Seconds by which the affinity replica may be predicted slower than the best and still
keep its key whatever the ratio (a difference this small is measurement noise)."""


@dataclass(frozen=True, slots=True)
class Route:
    """The backends of one model, by name.

    Attributes:
        model: the model name clients use.
        replicas: equivalent backends, chosen by affinity or load.
        fallbacks: tried in order when no replica is available.
        total_timeout_s: the whole budget of one request, retries included.
        max_attempts: attempts per request across all backends.
        strategy: how a replica is chosen (:data:`Strategy`).
        affinity_max_slowdown: with ``"predicted-latency"``, the affinity replica wins
            while its predicted time is at most this many times the best one's.
    """

    model: str
    replicas: tuple[str, ...]
    fallbacks: tuple[str, ...] = ()
    total_timeout_s: float = 600.0
    max_attempts: int = 4
    strategy: Strategy = "predicted-latency"
    affinity_max_slowdown: float = 1.5
    _all: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_all", self.replicas + self.fallbacks)

    @property
    def backends(self) -> tuple[str, ...]:
        return self._all

    @property
    def predicts(self) -> bool:
        """Whether its replica choice predicts latency (``"predicted-latency"`` with
        more than one replica: a request's demand and timing are read only then)."""
        return self.strategy == "predicted-latency" and len(self.replicas) > 1


def affinity_score(key: str, backend: str) -> int:
    """Rendezvous weight of ``backend`` for ``key`` (stable across processes)."""
    digest = blake2b(f"{key}\x00{backend}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _predicted(route: Route, names: Sequence[str], affinity: str | None,
               load: Callable[[str], int], predict: Callable[[str], float | None],
               noise: Callable[[str], float]) -> str:
    known = {n: t for n in names if (t := predict(n)) is not None}
    # an unknown replica is explored as the best one, one request at a time (another
    # waits for the first one's answer): never a burst sent to a replica nobody measured
    probes = [n for n in names if n not in known and load(n) == 0]
    if not known:  # nothing learned yet: least loaded (affinity, if any, wins)
        return _best(names, affinity, load, "least-loaded", 0)
    floor = min(known.values())
    names = [n for n in names if n in known or n in probes]
    times = {n: known.get(n, floor) for n in names}
    if affinity is not None:  # the first in the key's rendezvous order within the bound
        best = min(names, key=lambda n: (times[n], n))
        bound = route.affinity_max_slowdown * floor

        def within(n: str) -> bool:
            margin = max(AFFINITY_MIN_MARGIN_S, noise(n) + noise(best))
            return times[n] <= bound or times[n] - floor <= margin
        return next(n for n in sorted(names, key=lambda n: -affinity_score(affinity, n))
                    if within(n))
    return min(names, key=lambda n: (times[n], n in known, load(n)))  # unknown first


def _best(names: Sequence[str], affinity: str | None, load: Callable[[str], int],
          strategy: Strategy, turn: int) -> str:
    if affinity is not None:
        return max(names, key=lambda n: affinity_score(affinity, n))
    if strategy == "round-robin":
        return names[turn % len(names)]
    return min(names, key=load)


def pick(route: Route, *, available: Callable[[str], bool], load: Callable[[str], int],
         affinity: str | None = None, tried: Collection[str] = (),
         predict: Callable[[str], float | None] | None = None, turn: int = 0,
         noise: Callable[[str], float] | None = None) -> str | None:
    """The backend for the next attempt, or None when every backend is unavailable.

    Args:
        route: the model's backends and its :data:`Strategy`.
        available: whether a backend may take a request now (not cooling down, not full).
        load: requests in flight on a backend.
        affinity: a workflow or session id; None routes by the strategy alone.
        tried: backends this request already failed on.
        predict: predicted seconds until this request would be answered on a replica
            (None: unknown); used by ``"predicted-latency"`` (absent: least loaded).
        turn: a counter the caller advances per request (``"round-robin"``).
        noise: a replica's measured spread, the mean absolute error of its predictions
            (seconds; absent: 0): a key stays where the best is not faster by more.
    """
    if len(route.backends) == 1:  # no choice to make (tried or not, it is the one)
        name = route.backends[0]
        return name if available(name) else None
    for avoid in (tried, ()):
        replicas = [n for n in route.replicas if n not in avoid and available(n)]
        if replicas:
            if route.strategy == "predicted-latency" and predict is not None:
                return _predicted(route, replicas, affinity, load, predict,
                                  noise or (lambda n: 0.0))
            return _best(replicas, affinity, load, route.strategy, turn)
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
