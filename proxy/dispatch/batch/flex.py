"""The flex tier: ``service_tier: "flex"`` on a standard backend (slower, billed at about
batch prices, answered 429 when the provider has no capacity).

* :func:`tier_fields`: the body fields a request to a backend needs for its tier (a
  ``tier = "flex"`` backend always asks flex; a step the planner deferred asks flex on a
  backend that ``offers_flex``); a client's own ``service_tier`` is never overridden.
* :func:`served_tier`: the tier an answer says served it (OpenAI's ``service_tier``
  field: a flex request may be served at ``default``), which is the tier it is billed at
  (:func:`cost`).
* :func:`after_capacity_429`: a flex request answered 429 backs off when the wait fits
  in the step's slack, else moves to ``standard``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from flowlift.proxy.config import UpstreamSpec
from flowlift.tiers import TierProfile

_SERVED: Final = {"flex": "flex", "priority": "priority", "scale": "priority",
                  "batch": "batch", "default": "standard", "auto": "standard"}


def tier_fields(spec: UpstreamSpec, data: Mapping[str, Any], *, deferred: bool = False
                ) -> dict[str, Any]:
    """Fields to add to a request body for ``spec``'s tier (empty: none).

    Args:
        spec: the backend the attempt goes to.
        data: the request body (a ``service_tier`` already there wins).
        deferred: the tier planner put the step on flex.
    """
    if "service_tier" in data:
        return {}
    if spec.tier == "flex" or (deferred and spec.offers_flex):
        return {"service_tier": "flex"}
    if spec.tier == "priority":
        return {"service_tier": "priority"}
    return {}


def served_tier(body: Mapping[str, Any], asked: str = "standard") -> str:
    """The tier an answer (a chat completion or a stream chunk) says served it; ``asked``
    when it does not say."""
    said = body.get("service_tier")
    return _SERVED.get(said, asked) if isinstance(said, str) else asked


def cost(prompt_tokens: int, completion_tokens: int, served: str,
         tiers: Mapping[str, TierProfile]) -> float | None:
    """The price of one answer at the tier that served it (None: that tier is unpriced
    here)."""
    profile = tiers.get(served)
    return None if profile is None else profile.cost(prompt_tokens, completion_tokens)


def after_capacity_429(slack_s: float, fast_s: float, retry_after_s: float | None,
                       *, default_wait_s: float = 30.0) -> Literal["backoff", "standard"]:
    """What a flex request answered 429 (no capacity) does next.

    Args:
        slack_s: seconds until the step's latest start (:mod:`flowlift.tiers`).
        fast_s: the step's duration on the standard tier, seconds.
        retry_after_s: the answer's ``Retry-After``, or None.
        default_wait_s: the wait when the answer names none.

    Returns:
        ``"backoff"`` when waiting and retrying on flex still leaves the step its
        standard duration before the latest start, else ``"standard"``.
    """
    wait_s = default_wait_s if retry_after_s is None else retry_after_s
    return "backoff" if wait_s + fast_s <= slack_s else "standard"


__all__ = ["after_capacity_429", "cost", "served_tier", "tier_fields"]
