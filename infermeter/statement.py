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
    "BASES",
    "CACHE_SCHEMA",
    "CENT_COLUMNS",
    "COUNT_COLUMNS",
    "LINE_SCHEMA",
    "POOL_SCHEMA",
    "QUARANTINED_SCHEMA",
    "UNRECONCILED_SCHEMA",
    "Statement",
    "empty_cache",
    "empty_lines",
    "empty_pools",
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
    "month": pl.String,
    "for_month": pl.String,
    "team": pl.String,
    "model": pl.String,
    "requests": pl.Int64,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "gpu_hours": pl.Float64,
    "energy_kwh": pl.Float64,
    "compute_cents": pl.Int64,
    "energy_cents": pl.Int64,
    "idle_cents": pl.Int64,
    "total_cents": pl.Int64,
}
# Requests and tokens (prompt tokens once per choice, as vLLM counts them) per replica group and
# model that no engine reading covers.
UNRECONCILED_SCHEMA: Final = {
    "replica": pl.String,
    "model": pl.String,
    "requests": pl.Int64,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
}


# Records billing kept in quarantine and billed to no one, per kind and reason category.
QUARANTINED_SCHEMA: Final = {"kind": pl.String, "reason": pl.String, "records": pl.Int64}
# What each node pool cost in the month (``billing.pricebook``): at the price book's list
# prices (the usage basis), what its commitments paid for and left unused, and, when an invoice
# was imported for it (``billing.invoices``), the invoiced amount the allocation basis scales to.
POOL_SCHEMA: Final = {
    "pool": pl.String,
    "category": pl.String,
    "gpu_hours": pl.Float64,
    "energy_kwh": pl.Float64,
    "list_cents": pl.Int64,
    "committed_gpu_hours": pl.Float64,
    "committed_cents": pl.Int64,
    "unused_commitment_cents": pl.Int64,
    "commitment_utilization": pl.Float64,
    "invoice_cents": pl.Int64,
    "allocation_cents": pl.Int64,
    "difference_cents": pl.Int64,
    "explanation": pl.String,
}
# Prompt caching per team and model: prompt tokens served from vLLM's prefix cache and what the
# team paid less for them than for uncached prompt tokens (``billing.token_weights``).
CACHE_SCHEMA: Final = {
    "team": pl.String,
    "model": pl.String,
    "prompt_tokens": pl.Int64,
    "cached_prompt_tokens": pl.Int64,
    "cache_savings_cents": pl.Int64,
}
# The bases a statement's lines can be on: the price book's list prices, or scaled per pool to
# the imported invoices (teams + idle + unused commitment == invoice, to the cent).
BASES: Final = ("list", "allocation")


def empty_unreconciled() -> pl.DataFrame:
    """No unreconciled requests."""
    return pl.DataFrame(schema=UNRECONCILED_SCHEMA)


def empty_quarantined() -> pl.DataFrame:
    """No quarantined records."""
    return pl.DataFrame(schema=QUARANTINED_SCHEMA)


def empty_pools() -> pl.DataFrame:
    """No node pools."""
    return pl.DataFrame(schema=POOL_SCHEMA)


def empty_cache() -> pl.DataFrame:
    """No prompt caching."""
    return pl.DataFrame(schema=CACHE_SCHEMA)


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

    ``basis``: ``list`` when the lines are at the price book's prices; ``allocation`` when at
    least one node pool's cost was scaled to its imported invoice. ``usage_lines``: the same
    lines at list prices (the usage basis), when the basis is ``allocation``; None otherwise.
    ``pools`` (``POOL_SCHEMA``): each node pool's cost on both bases, its commitment and its
    invoice. ``cache`` (``CACHE_SCHEMA``): each team's prompt-cache hits and savings.

    ``instance_parts``: what each instance contributed to each (for_month, team, model) line,
    from the allocation that made the lines (money in micro-cents), when it was computed with
    them; billing splits the lines by instance for the exports from these, so a statement and
    its files come from one allocation. None for a closed month (its lines were frozen; the
    split is worked out when asked) and for a statement read back from JSON.
    """

    month: str
    closed: bool
    lines: pl.DataFrame  # LINE_SCHEMA columns
    fleet_cents: int
    adjustment_cents: int
    unreconciled: pl.DataFrame = field(default_factory=empty_unreconciled)
    quarantined: pl.DataFrame = field(default_factory=empty_quarantined)
    basis: str = "list"
    usage_lines: pl.DataFrame | None = None
    pools: pl.DataFrame = field(default_factory=empty_pools)
    cache: pl.DataFrame = field(default_factory=empty_cache)
    instance_parts: pl.DataFrame | None = None

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
    usage = (
        None
        if statement.usage_lines is None
        else statement.usage_lines.filter(pl.col("team") == team)
    )
    cache = statement.cache.filter(pl.col("team") == team)
    parts = statement.instance_parts
    return Statement(
        statement.month,
        statement.closed,
        lines,
        total,
        0,
        basis=statement.basis,
        usage_lines=usage,
        cache=cache,
        instance_parts=None if parts is None else parts.filter(pl.col("team") == team),
    )


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
    model), ``quarantined`` (a row per kind and reason: records kept and billed to no one) and
    ``pools`` (each node pool's cost, commitment and invoice). Everyone gets the basis, the
    usage-basis lines when they differ, and the prompt-cache savings of the lines they see.
    """
    mine = for_team(statement, team)
    lines = mine.lines
    body: dict[str, Any] = {
        "month": statement.month,
        "closed": statement.closed,
        "basis": statement.basis,
        "lines": lines.to_dicts(),
        "total_cents": int(lines["total_cents"].sum()) if lines.height else 0,
        "cache": mine.cache.to_dicts(),
    }
    if mine.usage_lines is not None:
        body["usage_lines"] = mine.usage_lines.to_dicts()
    if team is None:
        body |= {
            "fleet_cents": statement.fleet_cents,
            "adjustment_cents": statement.adjustment_cents,
            "reconciles": statement.reconciles,
            "unreconciled": statement.unreconciled.to_dicts(),
            "quarantined": statement.quarantined.to_dicts(),
            "pools": statement.pools.to_dicts(),
        }
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
    usage = body.get("usage_lines")
    pools = body.get("pools") or []
    cache = body.get("cache") or []
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
        basis=str(body.get("basis", "list")),
        usage_lines=None if usage is None else _frame(usage, LINE_SCHEMA),
        pools=_frame(pools, POOL_SCHEMA),
        cache=_frame(cache, CACHE_SCHEMA),
    )


def _frame(rows: list[dict[str, Any]], schema: Mapping[str, Any]) -> pl.DataFrame:
    """``rows`` as a frame of ``schema``, empty rows or not."""
    return pl.DataFrame(rows, schema=dict(schema)) if rows else pl.DataFrame(schema=dict(schema))
