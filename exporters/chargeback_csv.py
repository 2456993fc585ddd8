"""The chargeback CSV: one row per team and model, safe to open in a spreadsheet.

Columns (in this order; money in USD with two decimals, computed from whole cents):

``month``             the statement's month (YYYY-MM)
``team``              the team charged (or the platform account)
``model``             the model the line is for
``line_type``         ``usage`` for the month's own use, ``adjustment`` for late records of a
                      closed month
``for_month``         the month a line's use happened in (differs from ``month`` on adjustments)
``requests``          requests that reached a GPU (ok, client-aborted, upstream error)
``prompt_tokens``     prompt tokens, as vLLM counted them
``completion_tokens`` completion tokens, as vLLM counted them
``gpu_hours``         the team's share of measured GPU time
``energy_kwh``        the team's share of measured GPU energy (before PUE)
``compute_usd``       GPU time at the price book's USD per GPU-hour
``energy_usd``        energy at USD per kWh x PUE
``idle_usd``          idle capacity charged to the line by the replica's idle policy
``total_usd``         compute + energy + idle
``team_budget_usd``   the team's monthly budget, on the team's first line only (empty on its
                      other lines and for a team without a budget), so the column sums to the
                      budgets of the teams in the file, each counted once
``team_budget_used_percent``
                      the team's whole statement (all its lines) as a percentage of its budget,
                      on the same line: ``12.5`` is 12.5 %, ``0.01`` is one hundredth of 1 %
``basis``             the statement's basis: ``list`` (the price book's prices) or
                      ``allocation`` (node pools' costs scaled to their imported invoices); the
                      same on every row
``pricing_category``  the node pool's pricing category (``on_demand``, ``committed``, ``spot``,
                      ``owned``), empty when the statement does not split its lines by pool
``pool``              the node pool, empty likewise
``project``           the requests' project tag, empty when the lines are not split by it or
                      the requests had none

The last four came after the others, so a reader that takes columns by position still finds
the older ones where they were. A team and model's use in two pools or two projects is two rows.
The person who sent the requests (``user``) is not a column: the file is the finance view,
shared with every member of a team, and the FOCUS file's tags carry it where lines are split by
user.

The last row is the total (``line_type`` = ``total``, ``team`` and ``model`` empty): every
count and amount summed over the lines above, the budgets of the teams in the file, and their
statement as a percentage of those budgets. Leave it out before summing or pivoting the lines.

A text cell that a spreadsheet would run as a formula is written with a leading apostrophe, as
OWASP recommends: one whose first character that is not a space or a line feed is ``=``, ``+``,
``-``, ``@``, a tab or a carriage return, once Unicode NFKC has folded look-alikes (the
full-width equals sign U+FF1D, no-break and ideographic spaces) into them, because spreadsheets
skip leading blanks and some fold those forms too. Numeric columns are numbers, so a negative
amount stays a number. Escaping and quoting are Polars' CSV writer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import polars as pl

from exporters.focus_lines import with_commitments, with_optional
from infermeter.statement import CENT_COLUMNS, COUNT_COLUMNS, Statement, empty_pools, with_budgets

__all__ = ["CSV_COLUMNS", "TOTAL_LINE", "chargeback_frame", "defuse", "write_csv"]

CSV_COLUMNS: Final = (
    "month",
    "team",
    "model",
    "line_type",
    "for_month",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "gpu_hours",
    "energy_kwh",
    "compute_usd",
    "energy_usd",
    "idle_usd",
    "total_usd",
    "team_budget_usd",
    "team_budget_used_percent",
    "basis",
    "pricing_category",
    "pool",
    "project",
)
# The columns a line may be split by beyond team, model and month, that the file keeps.
_SPLITS: Final = ("pricing_category", "pool", "project")
TOTAL_LINE: Final = "total"
_SUMMED: Final = ("requests", "prompt_tokens", "completion_tokens", "gpu_hours", "energy_kwh")
_CENTS: Final = ("compute", "energy", "idle", "total")
# Blanks (any Unicode white space but tab and CR, which start formulas themselves), then a
# formula start; matched against the NFKC form of the cell (Rust regex: \s is Unicode).
_FORMULA_START: Final = r"^[\s&&[^\t\r]]*[=+\-@\t\r]"


def defuse(column: str) -> pl.Expr:
    """``column`` with every formula-looking cell prefixed by an apostrophe (the cell is kept as is)."""
    col = pl.col(column)
    formula = col.str.normalize("NFKC").str.contains(_FORMULA_START)
    return pl.when(formula).then("'" + col).otherwise(col).alias(column)


def _percent(cents: pl.Expr, budget_usd: pl.Expr) -> pl.Expr:
    """``cents`` as a percentage of ``budget_usd`` (two decimals); empty without a budget."""
    return pl.when(budget_usd > 0).then((cents / budget_usd).round(2)).otherwise(None)


def _total_row(lines: pl.DataFrame, month: str) -> pl.DataFrame:
    """The documented last row: every line summed, the budgets counted once per team."""
    budget = pl.col("team_budget_usd").sum()
    return lines.select(
        pl.lit(month).alias("month"),
        pl.lit(None, dtype=pl.String).alias("team"),
        pl.lit(None, dtype=pl.String).alias("model"),
        pl.lit(TOTAL_LINE).alias("line_type"),
        pl.lit(None, dtype=pl.String).alias("for_month"),
        *(pl.col(c).sum() for c in _SUMMED),
        *(pl.col(f"{c}_cents").sum() for c in _CENTS),
        pl.when(budget > 0).then(budget).otherwise(None).alias("team_budget_usd"),
    )


def _by_split(lines: pl.DataFrame) -> pl.DataFrame:
    """One line per month charged, team, model and ``_SPLITS`` (instances and users summed); a
    line of a pool's unused commitment names its pool."""
    keys = ["month", "for_month", "team", "model", *_SPLITS]
    return (
        with_commitments(with_optional(lines), empty_pools())
        .group_by(keys, maintain_order=True)
        .agg(pl.col(c).sum() for c in (*COUNT_COLUMNS, *CENT_COLUMNS))
    )


def chargeback_frame(statement: Statement, budgets_usd: Mapping[str, float]) -> pl.DataFrame:
    """The statement as the CSV's columns: one row per team, model and month charged (and pool
    or project when the lines are split by them), then the total."""
    order = ("line_type", "for_month", "team", "model", *_SPLITS)
    lines = (
        with_budgets(_by_split(statement.lines), budgets_usd)
        .with_columns(
            pl.when(pl.col("for_month") == pl.col("month"))
            .then(pl.lit("usage"))
            .otherwise(pl.lit("adjustment"))
            .alias("line_type")
        )
        .sort(order, descending=[True, *([False] * (len(order) - 1))], nulls_last=True)
        # The budget once per team (its first line), so summing the column counts it once.
        .with_columns(
            team_budget_usd=pl.when(
                (pl.int_range(pl.len()).over("team") == 0) & (pl.col("budget_usd") > 0)
            )
            .then(pl.col("budget_usd"))
            .otherwise(None)
        )
        .with_columns(team_cents=pl.col("total_cents").sum().over("team"))
    )
    body = lines.select(
        "month",
        "team",
        "model",
        "line_type",
        "for_month",
        *_SUMMED,
        *(pl.col(f"{c}_cents") for c in _CENTS),
        "team_budget_usd",
        _percent(pl.col("team_cents"), pl.col("team_budget_usd")).alias("team_budget_used_percent"),
        *_SPLITS,
    )
    # The total's share is of the teams that have a budget, over their budgets: the cents of a
    # team without one (and the platform's idle and unused lines) are in no budget.
    budgeted = lines.filter(pl.col("budget_usd") > 0)["total_cents"].sum()
    total = _total_row(lines, statement.month).with_columns(
        _percent(pl.lit(budgeted), pl.col("team_budget_usd")).alias("team_budget_used_percent")
    )
    frame = pl.concat([body, total], how="diagonal_relaxed")
    return frame.select(
        "month",
        "team",
        "model",
        "line_type",
        "for_month",
        "requests",
        "prompt_tokens",
        "completion_tokens",
        pl.col("gpu_hours").round(6),
        pl.col("energy_kwh").round(6),
        *((pl.col(f"{c}_cents") / 100).round(2).alias(f"{c}_usd") for c in _CENTS),
        "team_budget_usd",
        "team_budget_used_percent",
        pl.lit(statement.basis).alias("basis"),
        *(pl.col(c).cast(pl.String) for c in _SPLITS),
    ).with_columns(defuse(c) for c in ("month", "team", "model", "for_month", *_SPLITS))


def write_csv(frame: pl.DataFrame) -> str:
    """The frame as CSV text."""
    return frame.write_csv(float_scientific=False)
