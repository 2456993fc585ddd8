"""Exact money: integer micro-cents, split and rounded to cents so that parts add up to wholes.

Every amount of a statement is an integer number of micro-cents (a millionth of a cent,
10^-8 USD) from the moment it leaves the measurements: an instance's measured cost is converted
once (``microcents``), and from there it is only ever divided into parts by ``split``, whose
parts add up to the whole by construction. Integer sums do not depend on the order they are
taken in, and no part can exceed its whole, so a statement's lines add up to the fleet's cost
exactly, in every state of the ledger.

Cents come last (``largest_remainder``): the total is rounded once (half up), every cell is
rounded down, and the cents still missing go, one each, to the cells with the largest
remainders (ties: first cell in order wins, so the result is deterministic). Rounding each line
on its own could make a statement disagree with the fleet's bill by a few cents.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from typing import Final

__all__ = [
    "MICROCENTS_PER_CENT",
    "MICROCENTS_PER_USD",
    "RoundingError",
    "cents",
    "largest_remainder",
    "microcents",
    "split",
    "to_cents",
    "usd",
]

MICROCENTS_PER_CENT: Final = 10**6
MICROCENTS_PER_USD: Final = 10**8


class RoundingError(ValueError):
    """An amount that cannot be rounded (negative); ``index`` is its place in the input."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


def microcents(usd: float) -> int:
    """``usd`` (a finite float) in whole micro-cents, half to even.

    The float's exact binary value is converted, so the same measurement always gives the
    same integer. ValueError for NaN or infinity.
    """
    if not math.isfinite(usd):
        raise ValueError(f"not a finite amount: {usd!r} USD")
    return int(Decimal(usd).scaleb(8).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))


def usd(amount_microcents: int) -> float:
    """Micro-cents as USD, for display and comparisons in floats."""
    return amount_microcents / MICROCENTS_PER_USD


def cents(amount_microcents: int) -> int:
    """Micro-cents in whole cents, half up (away from zero for a negative amount)."""
    whole, rest = divmod(abs(amount_microcents), MICROCENTS_PER_CENT)
    rounded = whole + (1 if 2 * rest >= MICROCENTS_PER_CENT else 0)
    return rounded if amount_microcents >= 0 else -rounded


def to_cents(amount_usd: float) -> int:
    """``amount_usd`` in whole cents, half up (its shortest decimal form, as a person reads it)."""
    return int(Decimal(repr(amount_usd)).scaleb(2).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def _integer_weights(weights: Sequence[float]) -> list[int]:
    """Integers in exactly the proportions of ``weights`` (finite floats or ints, all >= 0)."""
    ratios = [w.as_integer_ratio() for w in weights]
    # Every float's denominator is a power of two: their largest is a common multiple.
    common = max((d for _, d in ratios), default=1)
    return [n * (common // d) for n, d in ratios]


def split(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` (>= 0) in integer parts proportional to ``weights``, adding up to it exactly.

    Largest remainder over the exact proportions: each part is rounded down, and the units
    still missing go to the largest remainders (ties: the first in order). ``weights`` are
    finite and >= 0; when they are all zero, every part is zero and ValueError is raised
    unless ``total`` is zero too (there is nobody to give it to).
    """
    if total < 0:
        raise ValueError(f"cannot split a negative amount: {total}")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError("split needs finite, non-negative weights")
    ints = _integer_weights(weights)
    whole = sum(ints)
    if whole == 0:
        if total:
            raise ValueError(f"cannot split {total} over weights that are all zero")
        return [0] * len(ints)
    parts = [total * w // whole for w in ints]
    remainders = [total * w % whole for w in ints]
    missing = total - sum(parts)
    for i in sorted(range(len(ints)), key=lambda i: (-remainders[i], i))[:missing]:
        parts[i] += 1
    return parts


def largest_remainder(amounts: Sequence[int], total: int | None = None) -> list[int]:
    """Cents for each of ``amounts`` (micro-cents, all >= 0) that sum to ``cents(total)``.

    ``total`` defaults to the sum of the amounts, which always succeeds. Raises
    ``RoundingError`` naming the first negative amount's index, and ValueError for a total the
    amounts cannot reach by rounding (more than one cent per amount away from their sum).
    """
    for i, a in enumerate(amounts):
        if a < 0:
            raise RoundingError(f"amount {i} is negative: {a} micro-cents", i)
    target = cents(sum(amounts) if total is None else total)
    floors = [a // MICROCENTS_PER_CENT for a in amounts]
    missing = target - sum(floors)
    if not 0 <= missing <= len(floors):
        raise ValueError(f"cannot round {len(floors)} amounts to a total of {target} cents")
    order = sorted(range(len(amounts)), key=lambda i: (-(amounts[i] % MICROCENTS_PER_CENT), i))
    for i in order[:missing]:
        floors[i] += 1
    return floors
