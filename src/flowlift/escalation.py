"""Expected cost of a model cascade from learned failure rates (pure, no I/O).

A cascade ``m1, ..., mk`` (FrugalGPT, Chen et al. 2023) runs every item on ``m1``; the
items ``m1`` fails (contract failed after its retries, confidence under the floor, or
an error no retry changes) go on to ``m2``, and so on. With ``f_i`` the failure rate
of step ``s`` on ``m_i``, ``a_i`` its attempts per item (retries included) and ``c_i``
the cost of one attempt on ``m_i``::

    E[cost] = sum_i  (f_1 * ... * f_{i-1}) * a_i * c_i

Failure rates are estimated with Laplace's rule of succession, ``(failures + 1) /
(items + 2)``: 0.5 before anything was observed, the observed rate once there are many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OutcomeCounts:
    """What a (step name, model) pair did in real runs.

    Attributes:
        items: step executions that reached this model.
        failures: of those, the ones whose output this model did not deliver (escalated
            or failed the step).
        attempts: generations on this model, retries included.
    """

    items: int = 0
    failures: int = 0
    attempts: int = 0

    @property
    def failure_rate(self) -> float:
        """Laplace-smoothed probability that an item fails on this model."""
        return (self.failures + 1) / (self.items + 2)

    @property
    def attempts_per_item(self) -> float:
        return self.attempts / self.items if self.items else 1.0


def expected_cost(costs: Sequence[float], counts: Sequence[OutcomeCounts]) -> float:
    """``E[cost]`` of one item along a cascade: ``costs[i]`` is one attempt on model ``i``
    (ms or price units), ``counts[i]`` what that model did before."""
    total, reach = 0.0, 1.0
    for cost, seen in zip(costs, counts, strict=True):
        total += reach * seen.attempts_per_item * cost
        reach *= seen.failure_rate
    return total


__all__ = ["OutcomeCounts", "expected_cost"]
