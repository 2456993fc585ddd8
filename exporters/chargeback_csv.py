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
``budget_usd``        the team's monthly budget (empty: none)
``budget_used_pct``   the team's whole statement as a percentage of its budget

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

from infermeter.statement import Statement, with_budgets

__all__ = ["CSV_COLUMNS", "chargeback_frame", "defuse", "write_csv"]

CSV_COLUMNS: Final = (
    "month", "team", "model", "line_type", "for_month", "requests", "prompt_tokens",
    "completion_tokens", "gpu_hours", "energy_kwh", "compute_usd", "energy_usd", "idle_usd",
    "total_usd", "budget_usd", "budget_used_pct",
)  # fmt: skip
# Blanks (any Unicode white space but tab and CR, which start formulas themselves), then a
# formula start; matched against the NFKC form of the cell (Rust regex: \s is Unicode).
_FORMULA_START: Final = r"^[\s&&[^\t\r]]*[=+\-@\t\r]"


def defuse(column: str) -> pl.Expr:
    """``column`` with every formula-looking cell prefixed by an apostrophe (the cell is kept as is)."""
    col = pl.col(column)
    formula = col.str.normalize("NFKC").str.contains(_FORMULA_START)
    return pl.when(formula).then("'" + col).otherwise(col).alias(column)


def chargeback_frame(statement: Statement, budgets_usd: Mapping[str, float]) -> pl.DataFrame:
    """The statement as the CSV's columns, one row per team, model and month charged."""
    lines = with_budgets(statement.lines, budgets_usd)
    usd = {
        c: (pl.col(f"{c[:-4]}_cents") / 100).round(2).alias(c)
        for c in ("compute_usd", "energy_usd", "idle_usd", "total_usd")
    }
    frame = lines.select(
        "month", "team", "model",
        pl.when(pl.col("for_month") == pl.col("month")).then(pl.lit("usage")).otherwise(pl.lit("adjustment")).alias("line_type"),
        "for_month", "requests", "prompt_tokens", "completion_tokens",
        pl.col("gpu_hours").round(6), pl.col("energy_kwh").round(6),
        *usd.values(), "budget_usd", "budget_used_pct",
    )  # fmt: skip
    return frame.with_columns(defuse(c) for c in ("month", "team", "model", "for_month")).sort(
        "line_type", "for_month", "team", "model", descending=[True, False, False, False]
    )


def write_csv(frame: pl.DataFrame) -> str:
    """The frame as CSV text."""
    return frame.write_csv(float_scientific=False)
