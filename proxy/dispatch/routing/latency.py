"""Predicted completion time of a request on each replica, learned from recent answers
(pure: no I/O, no clock -- every time is an argument).

The technique is llm-d's predicted-latency scheduling (the endpoint picker's latency
predictor, https://llm-d.ai/docs/architecture/advanced/latency-predictor): rather than
ranking replicas by a load count, predict each one's time to first token (TTFT) and
time per output token (TPOT) for *this* request from its current state, learned online
from the answers it gave, and send the request where it is predicted to finish first.
llm-d trains a regression per pod on queue depth, prompt length and prefix-cache score;
flowlift keeps the same features, measured where the proxy sees them:

* ``in_flight``: requests the proxy has in flight on the replica (its queue depth as
  this proxy knows it);
* ``uncached_ktokens``: the prompt's tokens, in thousands, less those the replica is
  expected to hold in its prefix cache -- the prompt last answered there under the same
  affinity key (a workflow run or a session), whose prefix the new prompt extends,
  scaled by the replica's *retention*: the share of such expected hits it reported
  (``usage.prompt_tokens_details.cached_tokens``). What a replica reports is the truth
  the TTFT model learns from; a replica that reports no hit where a sizeable one was
  expected, or that refused a connection, lost its cache (a restart) and everything
  believed cached there is forgotten (:meth:`LatencyBook.sent`, :meth:`LatencyBook.forget`);
* for the decode, ``in_flight`` alone (TPOT grows with the batch).

Each of TTFT and TPOT is an online ridge regression (a Bayesian linear model's posterior
mean, as llm-d's default predictor) over *recent* answers: its sufficient statistics
decay by ``keep_per_observation`` per answer and halve every ``half_life_s``, so a
replica that got slower is seen within a few answers, and one nothing was sent to for a
while is "unknown" again (and gets explored). Slopes are kept non-negative (more load
or a longer prompt never predicts a faster answer).

The completion time of a request expecting ``n`` output tokens is
``TTFT + (n - 1) * TPOT``; a replica that fails answers adds, with its recent failure
rate ``p``, ``p * (time to fail + the attempt again)`` (the retry the proxy will make).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

TOKENS_PER_KTOKEN = 1000.0
DEFAULT_OUTPUT_TOKENS = 128.0
"""Output tokens expected of a request before any answer on its model was seen."""


@dataclass(frozen=True, slots=True)
class Demand:
    """What the proxy knows of a request before it is sent.

    Attributes:
        prompt_tokens: its prompt's length in tokens (an estimate: bytes / 4 upstream).
        max_output_tokens: its ``max_tokens``, or None.
        affinity: its workflow run or session id (the prefix-cache key), or None.
    """

    prompt_tokens: int = 0
    max_output_tokens: int | None = None
    affinity: str | None = None


RESTART_MIN_TOKENS = 64
"""Expected cached tokens (estimated) above which a reported zero hit means the replica
lost its cache: below it, a prefix shorter than a few KV blocks may miss anyway."""
RETENTION_WEIGHT = 0.2
"""Weight of the newest report in a replica's retention (a moving average)."""


@dataclass(frozen=True, slots=True)
class CacheReport:
    """What a replica reported of one answer's prompt (its ``usage``).

    Attributes:
        prompt_tokens: the prompt's tokens, as the replica counted them.
        cached_tokens: of those, served from its prefix cache.
    """

    prompt_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, usage: object) -> CacheReport | None:
        """The report in an OpenAI ``usage`` object (``prompt_tokens`` and
        ``prompt_tokens_details.cached_tokens``; the Responses API's ``input_*`` names
        too), or None when it reports no cached tokens (vLLM without
        ``--enable-prompt-tokens-details``: nothing is known of the cache)."""
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        if (not isinstance(cached, int) or not isinstance(prompt, int) or prompt <= 0
                or isinstance(cached, bool) or cached < 0):
            return None
        return cls(prompt, min(cached, prompt))

    @property
    def hit(self) -> float:
        """The share of the prompt served from the cache (0 to 1)."""
        return self.cached_tokens / self.prompt_tokens


@dataclass(frozen=True, slots=True)
class Features:
    """One request on one replica, when it was sent.

    Attributes:
        in_flight: requests already in flight on the replica.
        prompt_tokens: the prompt's tokens.
        cached_tokens: of those, expected in the replica's prefix cache.
    """

    in_flight: int
    prompt_tokens: int
    cached_tokens: int = 0

    def ttft_x(self) -> tuple[float, ...]:
        """``(1, in_flight, uncached thousands of tokens)``: the TTFT regressors."""
        uncached = max(self.prompt_tokens - self.cached_tokens, 0) / TOKENS_PER_KTOKEN
        return (1.0, float(self.in_flight), uncached)

    def tpot_x(self) -> tuple[float, ...]:
        """``(1, in_flight)``: the TPOT regressors."""
        return (1.0, float(self.in_flight))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting (``a``: n x n, n <= 3);
    None when ``a`` is singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass(slots=True)
class Ridge:
    """Online ridge regression ``y ~ w . x`` with forgetting (``x[0]`` is the intercept,
    not penalised; the other weights are kept >= 0).

    Attributes:
        dim: the length of ``x``.
        penalty: the ridge penalty on the slopes.
    """

    dim: int
    penalty: float = 0.05
    xtx: list[list[float]] = field(default_factory=list)
    xty: list[float] = field(default_factory=list)
    weight: float = 0.0
    """Observations in the statistics, each counted by what is left of it."""
    _w: list[float] | None = None

    def __post_init__(self) -> None:
        self.xtx = [[0.0] * self.dim for _ in range(self.dim)]
        self.xty = [0.0] * self.dim

    def decay(self, factor: float) -> None:
        """Scale every observation so far by ``factor`` (0 < factor <= 1)."""
        if factor < 1.0:
            self.xtx = [[v * factor for v in row] for row in self.xtx]
            self.xty = [v * factor for v in self.xty]
            self.weight *= factor

    def add(self, x: tuple[float, ...], y: float) -> None:
        """Add the observation ``(x, y)`` with weight 1."""
        for i in range(self.dim):
            self.xty[i] += x[i] * y
            for j in range(self.dim):
                self.xtx[i][j] += x[i] * x[j]
        self.weight += 1.0
        self._w = None

    def weights(self) -> list[float]:
        """The fitted weights (slopes fixed at 0 where the free fit makes them negative);
        all zeros before any observation."""
        if self._w is None:
            self._w = self._fit()
        return self._w

    def _fit(self) -> list[float]:
        free = list(range(self.dim))
        while True:
            a = [[self.xtx[i][j] + (self.penalty if i == j and i > 0 else 0.0)
                  for j in free] for i in free]
            solved = _solve(a, [self.xty[i] for i in free])
            w = [0.0] * self.dim
            if solved is None:
                return w
            for i, v in zip(free, solved, strict=True):
                w[i] = v
            negative = [i for i in free if i > 0 and w[i] < 0]
            if not negative:
                return w
            free.remove(min(negative, key=lambda i: w[i]))

    def predict(self, x: tuple[float, ...]) -> float:
        """``w . x``, at least 0."""
        return max(sum(w * v for w, v in zip(self.weights(), x, strict=True)), 0.0)


@dataclass(slots=True)
class ReplicaModel:
    """What one replica's recent answers say (see the module doc).

    Attributes:
        ttft: TTFT regression on :meth:`Features.ttft_x` (seconds).
        tpot: TPOT regression on :meth:`Features.tpot_x` (seconds per token).
        failures, attempts: failed and all attempts, decayed like the regressions.
        fail_s: the mean time a failed attempt took (seconds).
        updated_at: the time of the last observation (seconds, the caller's clock).
        prefixes: affinity key -> prompt tokens last answered here under it (LRU).
        retention: the share of expected prefix-cache hits the replica reported (a
            moving average; 1 until it reports).
        spread_s: the mean absolute error of its completion-time predictions, over
            recent answers (seconds; an exponential average, weight 0.2 per answer).
    """

    ttft: Ridge = field(default_factory=lambda: Ridge(3))
    tpot: Ridge = field(default_factory=lambda: Ridge(2))
    failures: float = 0.0
    attempts: float = 0.0
    fail_s: float = 0.0
    updated_at: float = 0.0
    prefixes: OrderedDict[str, int] = field(default_factory=OrderedDict)
    retention: float = 1.0
    spread_s: float = 0.0

    def _age(self, now: float, half_life_s: float, keep: float) -> None:
        factor = keep * float(0.5 ** (max(now - self.updated_at, 0.0) / half_life_s))
        for ridge in (self.ttft, self.tpot):
            ridge.decay(factor)
        self.failures *= factor
        self.attempts *= factor
        self.updated_at = now

    def weight_at(self, now: float, half_life_s: float) -> float:
        """Answers behind the TTFT model, as left at ``now``."""
        age_s = max(now - self.updated_at, 0.0)
        return self.ttft.weight * float(0.5 ** (age_s / half_life_s))


@dataclass(slots=True)
class LatencyBook:
    """Every replica's :class:`ReplicaModel` and each model's expected output length.

    Attributes:
        half_life_s: an observation counts half after this long (seconds).
        keep_per_observation: every new observation scales the older ones by this.
        min_weight: answers a replica's model needs (decayed) before it predicts; below
            it, the replica is unknown (:meth:`predict` returns None).
        max_prefixes: affinity keys remembered per replica.
        output_tokens: model -> moving average of its answers' output tokens.
    """

    half_life_s: float = 60.0
    keep_per_observation: float = 0.9
    min_weight: float = 1.5
    max_prefixes: int = 4096
    replicas: dict[str, ReplicaModel] = field(default_factory=dict)
    output_tokens: dict[str, float] = field(default_factory=dict)

    def _model(self, name: str) -> ReplicaModel:
        model = self.replicas.get(name)
        if model is None:
            model = self.replicas[name] = ReplicaModel()
        return model

    def features(self, name: str, demand: Demand, in_flight: int) -> Features:
        """``demand`` on replica ``name`` with ``in_flight`` requests already there."""
        cached = 0
        model = self.replicas.get(name)
        if model is not None and demand.affinity is not None:
            prefix = min(model.prefixes.get(demand.affinity, 0), demand.prompt_tokens)
            cached = round(prefix * model.retention)
        return Features(in_flight, demand.prompt_tokens, cached)

    def expected_output(self, model: str, max_output_tokens: int | None) -> float:
        """Output tokens expected of a request on ``model`` (its recent mean, at most
        ``max_output_tokens``)."""
        mean = self.output_tokens.get(model, DEFAULT_OUTPUT_TOKENS)
        return mean if max_output_tokens is None else min(mean, float(max_output_tokens))

    def predict(self, name: str, features: Features, output_tokens: float,
                now: float) -> float | None:
        """Predicted seconds until the request is answered whole on ``name`` (failure
        penalty included), or None while too few recent answers are known.

        Args:
            name: the replica.
            features: the request on that replica (:meth:`features`).
            output_tokens: expected output tokens (:meth:`expected_output`).
            now: the current time on the clock observations were made with (seconds).
        """
        model = self.replicas.get(name)
        if model is None or model.weight_at(now, self.half_life_s) < self.min_weight:
            return None
        ttft = model.ttft.predict(features.ttft_x())
        tpot = model.tpot.predict(features.tpot_x()) if model.tpot.weight > 0 else 0.0
        answer = ttft + max(output_tokens - 1.0, 0.0) * tpot
        fail_rate = model.failures / (model.attempts + 1.0)
        return answer + fail_rate * (model.fail_s + answer)

    def sent(self, name: str, affinity: str | None, prompt_tokens: int, *,
             expected_cached: int = 0, report: CacheReport | None = None) -> None:
        """Replica ``name`` answered a prompt of ``prompt_tokens`` under ``affinity``:
        that prefix is now expected in its cache.

        Args:
            expected_cached: of ``prompt_tokens``, what was expected cached when it was
                sent (:attr:`Features.cached_tokens`).
            report: what the replica reported of the prompt (None: nothing). Where at
                least :data:`RESTART_MIN_TOKENS` were expected cached, a zero hit
                forgets every prefix of the replica (it lost its cache), another report
                moves its retention toward the reported share of the expected hit.
        """
        if report is not None and expected_cached >= RESTART_MIN_TOKENS and prompt_tokens:
            replica = self._model(name)  # (a smaller expected hit: a report within a
            if report.cached_tokens == 0:  # few KV blocks says little)
                self.forget(name)
            else:
                share = min(report.hit / (expected_cached / prompt_tokens), 1.0)
                replica.retention += RETENTION_WEIGHT * (share - replica.retention)
        if affinity is None:
            return
        prefixes = self._model(name).prefixes
        prefixes[affinity] = prompt_tokens
        prefixes.move_to_end(affinity)
        while len(prefixes) > self.max_prefixes:
            prefixes.popitem(last=False)

    def forget(self, name: str) -> None:
        """Replica ``name`` lost its prefix cache (it restarted): nothing is expected
        cached there any more (its retention is kept: a restart says nothing of it)."""
        model = self.replicas.get(name)
        if model is not None:
            model.prefixes.clear()

    def observe(self, name: str, model_name: str, features: Features, *, ttft_s: float,
                total_s: float, output_tokens: int | None, now: float,
                streamed: bool = True) -> None:
        """A successful answer on ``name``.

        Args:
            name: the replica.
            model_name: the model asked (its output length is learned).
            features: the request on the replica when it was sent.
            ttft_s: seconds from sending to the first token (a whole answer: to the
                answer).
            total_s: seconds from sending to the end of the answer.
            output_tokens: tokens in the answer, or None when unknown.
            now: the time of the observation (seconds, the prediction clock).
            streamed: False for a whole (non-streamed) answer, whose TTFT is its total
                less the decode predicted by the current TPOT model.
        """
        replica = self._model(name)
        if replica.weight_at(now, self.half_life_s) >= self.min_weight:  # it predicted
            expected = replica.ttft.predict(features.ttft_x())
            if output_tokens is not None and output_tokens > 1 and replica.tpot.weight > 0:
                expected += (output_tokens - 1) * replica.tpot.predict(features.tpot_x())
            replica.spread_s = 0.8 * replica.spread_s + 0.2 * abs(total_s - expected)
        replica._age(now, self.half_life_s, self.keep_per_observation)
        replica.attempts += 1.0
        n = output_tokens if output_tokens is not None and output_tokens > 0 else None
        if n is not None:
            mean = self.output_tokens.get(model_name)
            self.output_tokens[model_name] = float(n) if mean is None else (
                0.9 * mean + 0.1 * n)
        if streamed:
            replica.ttft.add(features.ttft_x(), ttft_s)
            if n is not None and n > 1:
                replica.tpot.add(features.tpot_x(), max(total_s - ttft_s, 0.0) / (n - 1))
        else:
            decode = 0.0
            if n is not None and replica.tpot.weight > 0:
                decode = (n - 1) * replica.tpot.predict(features.tpot_x())
            replica.ttft.add(features.ttft_x(), max(total_s - decode, 0.0))

    def spread(self, name: str) -> float:
        """How far ``name``'s recent answers were from what was predicted of them: the
        mean absolute error in seconds (0 before it predicted anything). Predictions
        closer than this are not told apart by routing (:mod:`.routing`)."""
        model = self.replicas.get(name)
        return 0.0 if model is None else model.spread_s

    def failed(self, name: str, elapsed_s: float, now: float) -> None:
        """An attempt on ``name`` failed through the backend's fault after
        ``elapsed_s`` seconds (``now``: the prediction clock)."""
        replica = self._model(name)
        replica._age(now, self.half_life_s, self.keep_per_observation)
        replica.fail_s = elapsed_s if replica.failures < 1e-9 else (
            0.8 * replica.fail_s + 0.2 * elapsed_s)
        replica.failures += 1.0
        replica.attempts += 1.0
