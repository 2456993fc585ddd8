"""Turning exact shares into cents that add up: largest-remainder rounding.

Rounding each line on its own can make a statement disagree with the fleet's bill by a few
cents. Instead the fleet total is rounded once (half up), every cell is rounded down, and the
cents still missing go, one each, to the cells with the largest remainders (ties: first cell
in order wins, so the result is deterministic).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import ROUND_HALF_UP, Decimal

__all__ = ["largest_remainder", "to_cents"]


def to_cents(usd: float) -> int:
    """``usd`` in whole cents, half up."""
    return int(Decimal(repr(usd)).scaleb(2).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def largest_remainder(amounts_usd: Sequence[float], total_usd: float | None = None) -> list[int]:
    """Cents for each of ``amounts_usd`` (all >= 0) that sum to ``to_cents(total_usd)``.

    ``total_usd`` defaults to the sum of the amounts. Raises ValueError for a negative amount or
    a total the amounts cannot reach by rounding (more than one cent per amount away).
    """
    if any(a < 0 for a in amounts_usd):
        raise ValueError("largest_remainder needs non-negative amounts")
    target = to_cents(math.fsum(amounts_usd) if total_usd is None else total_usd)
    cents = [a * 100 for a in amounts_usd]
    floors = [math.floor(c) for c in cents]
    missing = target - sum(floors)
    if not 0 <= missing <= len(floors):
        raise ValueError(f"cannot round {len(floors)} amounts to a total of {target} cents")
    order = sorted(range(len(cents)), key=lambda i: (-(cents[i] - floors[i]), i))
    for i in order[:missing]:
        floors[i] += 1
    return floors
