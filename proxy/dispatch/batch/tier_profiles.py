"""The service tiers a model's backends offer, as the tier planner
(:mod:`flowlift.tiers`) sees them: each configured backend's ``tier`` and prices, with
turnaround priors until the proxy has measured them.

A backend without prices of its own takes its model's ``price_per_1k_tokens`` times
the tier's usual factor (:data:`PRICE_FACTOR`: flex and batch bill half of standard,
priority about twice); the embedded engine (``local``) is free unless priced.
"""

from __future__ import annotations

from typing import Final

from flowlift.proxy.config import BatchSpec, EmbeddedSpec, FileConfig, ModelSpec, UpstreamSpec
from flowlift.tiers import TierProfile, TurnaroundBook

PRICE_FACTOR: Final = {"priority": 2.0, "standard": 1.0, "flex": 0.5, "batch": 0.5,
                       "local": 0.0}
TURNAROUND_PRIORS: Final = {"batch": (420.0, 3600.0), "flex": (20.0, 120.0)}
"""Tier -> (p50_s, p90_s) until measured. Batch: OpenRouter's published figures over
230k batches (median 7 minutes, 90% within an hour); flex: a guess (minutes)."""
MARGIN_S: Final = {"batch": 3600.0, "flex": 300.0, "idle": 300.0}
"""Kept free after a deferred tier's p90 when planning (seconds)."""


def _tier(tier: str, input_price: float, output_price: float,
          book: TurnaroundBook | None) -> TierProfile:
    p50, p90 = (book.quantiles(tier) if book is not None
                else TURNAROUND_PRIORS.get(tier, (0.0, 0.0)))
    return TierProfile(tier, input_price, output_price, p50, p90, MARGIN_S.get(tier, 0.0))


def _offered(spec: EmbeddedSpec | UpstreamSpec | BatchSpec, model: ModelSpec,
             book: TurnaroundBook | None) -> list[TierProfile]:
    factor = PRICE_FACTOR[spec.tier]
    fallback = (model.price_per_1k_tokens or 0.0) * factor
    prices = (fallback if spec.input_price_per_1k is None else spec.input_price_per_1k,
              fallback if spec.output_price_per_1k is None else spec.output_price_per_1k)
    out = [_tier(spec.tier, *prices, book)]
    if isinstance(spec, BatchSpec) and (book is None or book.quantiles("batch") ==
                                        TURNAROUND_PRIORS["batch"]):  # not yet measured
        out = [TierProfile("batch", *prices, spec.turnaround_p50_s, spec.turnaround_p90_s,
                           spec.margin_s)]
    if isinstance(spec, EmbeddedSpec) and spec.idle:
        out.append(TierProfile("idle", *prices, spec.idle_turnaround_p50_s,
                               spec.idle_turnaround_p90_s, MARGIN_S["idle"]))
    if isinstance(spec, UpstreamSpec) and spec.offers_flex and spec.tier != "flex":
        ratio = PRICE_FACTOR["flex"] / factor  # flex of this backend: its price, halved
        out.append(_tier("flex", prices[0] * ratio, prices[1] * ratio, book))
    return out


def model_tiers(config: FileConfig | None, model: str,
                book: TurnaroundBook | None = None) -> tuple[TierProfile, ...]:
    """The tiers ``model``'s route offers (its backends and fallbacks, and its batch
    backend), cheapest kept per tier; ``(local,)`` for a model the config does not name.

    Args:
        config: the parsed config file, or None (embedded engine only).
        model: a served model name.
        book: learned turnaround (its priors answer until measured); None: the priors of
            :data:`TURNAROUND_PRIORS`.
    """
    spec = config.models.get(model) if config is not None else None
    if config is None or spec is None:
        return (TierProfile("local", 0.0, 0.0),)
    names = [*spec.backends, *spec.fallbacks, *([spec.batch] if spec.batch else [])]
    best: dict[str, TierProfile] = {}
    for name in names:
        for profile in _offered(config.backends[name], spec, book):
            kept = best.get(profile.tier)
            if kept is None or profile.cost(1000, 1000) < kept.cost(1000, 1000):
                best[profile.tier] = profile
    return tuple(best.values())


def default_book() -> TurnaroundBook:
    """A turnaround book with :data:`TURNAROUND_PRIORS`."""
    return TurnaroundBook(dict(TURNAROUND_PRIORS))


__all__ = ["MARGIN_S", "PRICE_FACTOR", "TURNAROUND_PRIORS", "default_book", "model_tiers"]
