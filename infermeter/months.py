"""Calendar months in UTC: the unit of a statement."""

from __future__ import annotations

import re
from datetime import UTC, datetime

__all__ = ["MONTH_PATTERN", "check_month", "month_bounds", "month_of", "next_month"]

# Years from the Unix epoch to 2999 (any four digits would take 0000 and 9999-12, whose bounds
# are not dates), ASCII digits only (``\d`` takes any script's digits, which int() reads as the
# same month too), matched whole (``fullmatch``: ``$`` alone would let "2026-11\n" through).
MONTH_PATTERN = r"^(19[7-9][0-9]|2[0-9]{3})-(0[1-9]|1[0-2])$"
_MONTH = re.compile(MONTH_PATTERN)


def check_month(month: str) -> str:
    """``month`` if it is ``YYYY-MM`` (1970-01 to 2999-12); ValueError naming the bad value otherwise."""
    if not _MONTH.fullmatch(month):
        raise ValueError(f"month {month!r} is not of the form YYYY-MM (1970-01 to 2999-12)")
    return month


def month_bounds(month: str) -> tuple[float, float]:
    """Unix seconds of the first instant of ``month`` and of the month after it."""
    year, mon = (int(p) for p in check_month(month).split("-"))
    start = datetime(year, mon, 1, tzinfo=UTC)
    end = datetime(year + mon // 12, mon % 12 + 1, 1, tzinfo=UTC)
    return start.timestamp(), end.timestamp()


def month_of(t: float) -> str:
    """The UTC month Unix time ``t`` falls in."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m")


def next_month(month: str) -> str:
    """The month after ``month``."""
    return month_of(month_bounds(month)[1])
