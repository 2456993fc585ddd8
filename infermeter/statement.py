"""A month's statement as it leaves billing: the lines in cents, the totals, and its JSON.

Billing computes statements; the exporters (CSV, FOCUS) and the dashboards read them. This is
the data type they share, with the pure helpers they need, so neither has to import billing.
The JSON here is the body of billing's chargeback routes; ``statement_from_json`` reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import polars as pl

__all__ = [
    "CENT_COLUMNS",
    "COUNT_COLUMNS",
    "LINE_SCHEMA",
    "QUARANTINED_SCHEMA",
    "UNRECONCILED_SCHEMA",
    "Statement",
    "empty_lines",
    "empty_quarantined",
    "empty_unreconciled",
    "for_team",
    "statement_from_json",
    "statement_json",
    "with_budgets",
]

COUNT_COLUMNS: Final = ("requests", "prompt_tokens", "completion_tokens", "gpu_hours", "energy_kwh")
CENT_COLUMNS: Final = ("compute_cents", "energy_cents", "idle_cents", "total_cents")
LINE_SCHEMA: Final = {
    "month": pl.String, "for_month": pl.String, "team": pl.String, "model": pl.String,
    "requests": pl.Int64, "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64,
    "gpu_hours": pl.Float64, "energy_kwh": pl.Float64, "compute_cents": pl.Int64,
    "energy_cents": pl.Int64, "idle_cents": pl.Int64, "total_cents": pl.Int64,
}  # fmt: skip
# Requests and tokens (prompt tokens once per choice, as vLLM counts them) per replica group and
# model that no engine reading covers.
UNRECONCILED_SCHEMA: Final = {
    "replica": pl.String, "model": pl.String, "requests": pl.Int64, "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
}  # fmt: skip


# Records billing kept in quarantine and billed to no one, per kind and reason category.
QUARANTINED_SCHEMA: Final = {"kind": pl.String, "reason": pl.String, "records": pl.Int64}


def empty_unreconciled() -> pl.DataFrame:
    """No unreconciled requests."""
    return pl.DataFrame(schema=UNRECONCILED_SCHEMA)


def empty_quarantined() -> pl.DataFrame:
    """No quarantined records."""
    return pl.DataFrame(schema=QUARANTINED_SCHEMA)


@dataclass(frozen=True, slots=True)
class Statement:
    """One month's lines (cents) and the totals they must reconcile to.

    ``unreconciled`` (``UNRECONCILED_SCHEMA``): the month's billable requests that no engine
    reading covers (``billing.reconciliation``), per replica group and model. They are on the
    lines like any other, billed as their records say; this says that vLLM's counters did not
    check them, and is not added to anything.

    ``quarantined`` (``QUARANTINED_SCHEMA``): the month's records billing kept but will not bill
    (an untrusted writer, an unknown team, model or node, a broken seal), per kind and reason.
    They are on no line and in no total.
    """

    month: str
    closed: bool
    lines: pl.DataFrame  # LINE_SCHEMA columns
    fleet_cents: int
    adjustment_cents: int
    unreconciled: pl.DataFrame = field(default_factory=empty_unreconciled)
    quarantined: pl.DataFrame = field(default_factory=empty_quarantined)

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
    return pl.DataFrame(schema=LINE_SCHEMA)


def for_team(statement: Statement, team: str | None) -> Statement:
    """``statement`` as ``team`` may see it: its own lines only (None: every line).

    The team's view carries its own total as the fleet cost and no adjustments, so it
    reconciles by itself and says nothing about other teams (nor about the groups' unreconciled
    requests, which span every team).
    """
    if team is None:
        return statement
    lines = statement.lines.filter(pl.col("team") == team)
    total = int(lines["total_cents"].sum()) if lines.height else 0
    return Statement(statement.month, statement.closed, lines, total, 0)


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


def statement_json(statement: Statement, team: str | None) -> dict[str, Any]:
    """A statement as billing's chargeback API answers it: a team gets only its own lines.

    The admin's answer also carries the totals, ``unreconciled`` (a row per replica group and
    model) and ``quarantined`` (a row per kind and reason: records kept and billed to no one).
    """
    lines = statement.lines if team is None else statement.lines.filter(pl.col("team") == team)
    body: dict[str, Any] = {
        "month": statement.month,
        "closed": statement.closed,
        "lines": lines.to_dicts(),
        "total_cents": int(lines["total_cents"].sum()) if lines.height else 0,
    }
    if team is None:
        body |= {"fleet_cents": statement.fleet_cents, "adjustment_cents": statement.adjustment_cents,
                 "reconciles": statement.reconciles,
                 "unreconciled": statement.unreconciled.to_dicts(),
                 "quarantined": statement.quarantined.to_dicts()}  # fmt: skip
    return body


def statement_from_json(body: Mapping[str, Any]) -> Statement:
    """A ``Statement`` rebuilt from billing's JSON (``statement_json``).

    A team key's answer has no fleet total; the statement then carries its own total as the
    fleet cost and callers show the reconciliation only when ``fleet_cents`` was sent; nor does
    it carry ``unreconciled``.
    """
    lines = pl.DataFrame(body["lines"], schema=LINE_SCHEMA) if body["lines"] else empty_lines()
    total = int(body.get("total_cents", 0))
    missed = body.get("unreconciled") or []
    held = body.get("quarantined") or []
    return Statement(
        month=body["month"],
        closed=bool(body["closed"]),
        lines=lines,
        fleet_cents=int(body.get("fleet_cents", total)),
        adjustment_cents=int(body.get("adjustment_cents", 0)),
        unreconciled=pl.DataFrame(missed, schema=UNRECONCILED_SCHEMA)
        if missed
        else empty_unreconciled(),
        quarantined=pl.DataFrame(held, schema=QUARANTINED_SCHEMA) if held else empty_quarantined(),
    )
