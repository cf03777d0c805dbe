"""Counters and histograms kept in plain Python structures, shown through
prometheus_client at scrape time.

prometheus_client's ``Counter.labels(...).inc()`` and ``Histogram.observe()`` take a lock
and walk Python objects per call (a value object per bucket, a linear bucket search):
several microseconds a request on the proxy's fastest path, where every request counts
its outcome, overhead, tokens, latency and spend. Here a counter's series is one float
in a dict keyed by its label values, and a histogram's one list of per-bucket counts (a
``bisect`` finds the bucket); :class:`Tallies`, a custom collector (prometheus_client's
documented way to expose values kept elsewhere: "Custom Collectors",
https://prometheus.github.io/client_python/collector/custom/), folds them into
``CounterMetricFamily`` / ``HistogramMetricFamily`` when ``/metrics`` is read.

What a scrape shows is what prometheus_client's own ``Counter`` and ``Histogram`` show
for the same observations, byte for byte (``tests/test_metrics_exposition.py``): the
``_total`` suffix, cumulative ``_bucket`` counts with prometheus_client's ``le`` text,
``_count`` and ``_sum``, a ``_created`` sample per series (the wall-clock time it was
first touched, once, unless created series are disabled as prometheus_client allows),
series in the order they were first touched, a negative counter increment refused with
``ValueError``. Label values are strings. Not thread-safe: every call and the scrape run
on the proxy's event loop thread.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Labels = tuple[str, ...]


def _created_series() -> bool:
    """Whether ``_created`` samples are shown: prometheus_client's own switch
    (``PROMETHEUS_DISABLE_CREATED_SERIES``, ``disable_created_metrics()``), read at
    scrape time as its metrics read it."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


class CounterTally:
    """A labelled counter: label values -> ``[value, created]``.

    Args:
        name: the metric's name without ``_total`` (as prometheus_client's ``Counter``).
        documentation: its help text.
        labelnames: the names of its labels, in order.
    """

    __slots__ = ("documentation", "labelnames", "name", "series")

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.series: dict[Labels, list[float]] = {}

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0) to the series of ``labels`` (made at 0 when new).

        Raises:
            ValueError: ``amount`` is negative (as prometheus_client's ``Counter.inc``).
        """
        s = self.series.get(labels)
        if s is None:  # (made first, as prometheus_client's labels() before its inc())
            s = self.series[labels] = [0.0, time.time()]
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        s[0] += amount

    def family(self, created: bool) -> Metric:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, (value, at) in list(self.series.items()):
            fam.add_metric(labels, value, created=at if created else None)
        return fam


class HistogramTally:
    """A labelled histogram: label values -> ``[sum, created, count per bucket...]``.

    Args:
        name, documentation, labelnames: as :class:`CounterTally`.
        buckets: upper bounds, ascending (``+Inf`` is added when missing), as
            prometheus_client's ``Histogram(buckets=...)``.
    """

    __slots__ = ("bounds", "documentation", "labelnames", "les", "name", "series")

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = bounds
        self.les: list[str] = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        self.series: dict[Labels, list[float]] = {}

    def observe(self, labels: Labels, amount: float) -> None:
        """Count ``amount`` in the series of ``labels``: in the first bucket whose bound
        is >= it, and in the sum (a NaN: in the sum only, as prometheus_client)."""
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0.0, time.time(), *([0.0] * len(self.bounds))]
        s[0] += amount
        if amount == amount:  # (not NaN)
            s[2 + bisect_left(self.bounds, amount)] += 1.0

    def family(self, created: bool) -> Metric:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, s in list(self.series.items()):
            acc, buckets = 0.0, []
            for le, n in zip(self.les, s[2:], strict=True):
                acc += n
                buckets.append((le, acc))
            fam.add_metric(labels, buckets, s[0])
            if created:
                fam.add_sample(f"{self.name}_created", dict(zip(self.labelnames, labels,
                                                                strict=True)), s[1])
        return fam


class Tallies(Collector):
    """A custom collector of tallies: their families at each scrape, in the order the
    tallies were made (:meth:`counter`, :meth:`histogram`)."""

    def __init__(self) -> None:
        self._tallies: list[CounterTally | HistogramTally] = []

    def counter(self, name: str, documentation: str, labelnames: Sequence[str]) -> CounterTally:
        tally = CounterTally(name, documentation, labelnames)
        self._tallies.append(tally)
        return tally

    def histogram(self, name: str, documentation: str, labelnames: Sequence[str],
                  buckets: Sequence[float]) -> HistogramTally:
        tally = HistogramTally(name, documentation, labelnames, buckets)
        self._tallies.append(tally)
        return tally

    def collect(self) -> Iterable[Metric]:
        created = _created_series()
        return [tally.family(created) for tally in self._tallies]
