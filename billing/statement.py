"""A month's statement: allocation lines in cents, adjustments for closed months, budgets.

Pure functions over frames. A statement reconciles when its lines add up to the fleet's cost
for the month plus the adjustments it carries for earlier, closed months, to the cent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import polars as pl

from billing.allocation import ERROR_PREFIX
from billing.rounding import largest_remainder

__all__ = [
    "CENT_COLUMNS",
    "COUNT_COLUMNS",
    "Statement",
    "adjustment_lines",
    "cents_lines",
    "error_lines",
    "with_budgets",
]

COUNT_COLUMNS: Final = ("requests", "prompt_tokens", "completion_tokens", "gpu_hours", "energy_kwh")
CENT_COLUMNS: Final = ("compute_cents", "energy_cents", "idle_cents", "total_cents")
_LINE_SCHEMA: Final = {
    "month": pl.String, "for_month": pl.String, "team": pl.String, "model": pl.String,
    "requests": pl.Int64, "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64,
    "gpu_hours": pl.Float64, "energy_kwh": pl.Float64, "compute_cents": pl.Int64,
    "energy_cents": pl.Int64, "idle_cents": pl.Int64, "total_cents": pl.Int64,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Statement:
    """One month's lines (cents) and the totals they must reconcile to."""

    month: str
    closed: bool
    lines: pl.DataFrame  # _LINE_SCHEMA columns
    fleet_cents: int
    adjustment_cents: int

    @property
    def total_cents(self) -> int:
        """Sum of every line."""
        return int(self.lines["total_cents"].sum()) if self.lines.height else 0

    @property
    def reconciles(self) -> bool:
        """True when the lines add up to fleet cost plus adjustments, to the cent."""
        return self.total_cents == self.fleet_cents + self.adjustment_cents


def empty_lines() -> pl.DataFrame:
    """A statement with no lines."""
    return pl.DataFrame(schema=_LINE_SCHEMA)


def cents_lines(month: str, lines: pl.DataFrame, fleet_usd: float) -> pl.DataFrame:
    """Allocation lines (USD floats) as cents that add up to ``fleet_usd`` rounded.

    Every cell (compute, energy and idle of every line) takes part in one largest-remainder
    rounding, so both the line totals and the statement total are exact. Error lines stay out
    of it: a leftover cent must never land on a line that says it could not be priced.
    """
    if lines.height == 0:
        return empty_lines()
    rows = lines.select("compute_usd", "energy_usd", "idle_usd").rows()
    priced = [i for i, m in enumerate(lines["model"]) if not (m or "").startswith(ERROR_PREFIX)]
    rounded = largest_remainder([max(0.0, c) for i in priced for c in rows[i]], fleet_usd)
    cents = [0] * (3 * len(rows))
    for k, i in enumerate(priced):
        cents[3 * i : 3 * i + 3] = rounded[3 * k : 3 * k + 3]
    compute, energy, idle = cents[0::3], cents[1::3], cents[2::3]
    return lines.select(
        pl.lit(month).alias("month"),
        pl.lit(month).alias("for_month"),
        "team", "model", *COUNT_COLUMNS,
        pl.Series("compute_cents", compute, dtype=pl.Int64),
        pl.Series("energy_cents", energy, dtype=pl.Int64),
        pl.Series("idle_cents", idle, dtype=pl.Int64),
        pl.Series("total_cents", [a + b + c for a, b, c in zip(compute, energy, idle, strict=True)], dtype=pl.Int64),
    ).cast(_LINE_SCHEMA)  # type: ignore[arg-type]  # fmt: skip


def adjustment_lines(
    month: str, for_month: str, now: pl.DataFrame, issued: pl.DataFrame
) -> pl.DataFrame:
    """What ``for_month``'s lines say now minus what its statements already charged.

    ``now`` is ``for_month`` recomputed with every record the ledger has today; ``issued`` is
    every line already issued for it (its own statement and earlier adjustments). Lines with
    nothing to adjust are left out.
    """
    keys = ["team", "model"]
    value_cols = [*COUNT_COLUMNS, *CENT_COLUMNS]
    a = now.group_by(keys).agg(pl.col(value_cols).sum())
    b = issued.group_by(keys).agg(pl.col(value_cols).sum())
    diff = a.join(b, on=keys, how="full", coalesce=True, suffix="_issued").select(
        *keys,
        *(
            (pl.col(c).fill_null(0) - pl.col(f"{c}_issued").fill_null(0)).alias(c)
            for c in value_cols
        ),
    )
    nonzero = pl.any_horizontal(
        pl.col(c) != 0 for c in (*CENT_COLUMNS, "requests", "prompt_tokens", "completion_tokens")
    )
    return diff.filter(nonzero).select(
        pl.lit(month).alias("month"), pl.lit(for_month).alias("for_month"), *keys, *value_cols
    ).cast(_LINE_SCHEMA).sort(keys)  # type: ignore[arg-type]  # fmt: skip


def error_lines(lines: pl.DataFrame) -> pl.DataFrame:
    """The lines that could not be priced: zero cost, and the model column says why."""
    return lines.filter(pl.col("model").str.starts_with(ERROR_PREFIX))


def with_budgets(lines: pl.DataFrame, budgets_usd: Mapping[str, float]) -> pl.DataFrame:
    """Lines plus each team's monthly budget and the share of it the team's lines use.

    ``budget_used_pct`` is the team's whole statement (all its lines) against its budget, so
    it is the same on every line of a team; empty when the team has no budget.
    """
    team_total = pl.col("total_cents").sum().over("team")
    budget = pl.col("team").replace_strict(dict(budgets_usd), default=None, return_dtype=pl.Float64)
    return lines.with_columns(budget_usd=budget).with_columns(
        budget_used_pct=pl.when(pl.col("budget_usd") > 0)
        .then((team_total / pl.col("budget_usd")).round(2))
        .otherwise(None)
    )


def team_totals(lines: pl.DataFrame, teams: Sequence[str]) -> dict[str, int]:
    """Cents per team over all lines, with 0 for teams without lines."""
    totals = dict.fromkeys(teams, 0)
    for team, cents in lines.group_by("team").agg(pl.col("total_cents").sum()).iter_rows():
        totals[team] = totals.get(team, 0) + int(cents)
    return totals
