"""Statements from the ledger: the glue between the DuckDB edge and the pure allocation.

Every read goes through a module that builds its SQL and runs it in the ledger's transactions:
the month's allocation (``billing.allocation_runs``), the closed months and their frozen lines
(``billing.closing``), the invoices (``billing.invoice_store``), the reconciliation
(``billing.reconciled``) and the quarantine (``billing.quarantine``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import polars as pl

from billing import allocation_runs, closed_hours, closing, invoice_store, quarantine, reconciled
from billing.allocation import Policy
from billing.bases import pool_frame
from billing.cache import cache_rows, month_cached_tokens
from billing.ledger import Ledger, LedgerError
from billing.pricebook import price_book
from billing.rounding import cents
from billing.statement import (
    adjustment_lines,
    cents_lines,
    instance_lines,
    merged,
    team_totals,
    unreconciled_of,
)
from infermeter.config import Config
from infermeter.months import check_month, month_bounds, month_of
from infermeter.statement import Statement

__all__ = ["Chargeback", "Spend", "policy_from_config", "spend_of"]


def policy_from_config(config: Config) -> Policy:
    """The allocation policy the configuration describes."""
    b = config.billing
    return Policy(
        prices=price_book(config.prices),
        allocation=b.allocation,
        prompt_weight=b.token_weights.prompt,
        completion_weight=b.token_weights.completion,
        cached_prompt_weight=b.token_weights.cached_prompt,
        platform_account=b.platform_account,
        idle={r.id: (r.idle_policy, r.owner_team) for r in config.replicas},
        replica_model={r.id: r.model for r in config.replicas},
    )


@dataclass(frozen=True, slots=True)
class _Month:
    """One month computed from the ledger: lines (cents) on ``basis``, and what explains them."""

    lines: pl.DataFrame
    fleet_cents: int
    basis: str
    usage_lines: pl.DataFrame | None
    pools: pl.DataFrame
    unreconciled: pl.DataFrame | None = None
    # The lines per instance, from the same allocation (``allocation.Allocation.instances``).
    parts: pl.DataFrame | None = None


@dataclass(frozen=True, slots=True)
class Spend:
    """A team's month so far: spent, budget, and a straight-line forecast to month end."""

    team: str
    month: str
    spent_usd: float
    budget_usd: float
    forecast_usd: float


class Chargeback:
    """Computes, closes and reports statements for one ledger and one configuration."""

    def __init__(self, ledger: Ledger, config: Config) -> None:
        self.ledger = ledger
        self.config = config
        self.policy = policy_from_config(config)

    def reconfigure(self, config: Config) -> None:
        """Price, split and budget by ``config`` from now on (a configuration reload)."""
        self.config, self.policy = config, policy_from_config(config)

    def _cents(self, month: str) -> _Month:
        """``month`` computed now: its lines in cents on the basis its invoices allow, both bases."""
        invoices = invoice_store.invoices(self.ledger, month)
        listed, scaled = allocation_runs.allocate_bases(
            self.ledger, self.policy, month, invoices, True
        )
        chosen = listed if scaled is None else scaled
        usage = None if scaled is None else cents_lines(month, merged(listed.lines))
        pools = pool_frame(self.policy.prices, month_bounds(month), listed, scaled, invoices)
        parts = chosen.instances
        return _Month(
            cents_lines(month, merged(chosen.lines)),
            cents(chosen.fleet_microcents),
            "list" if scaled is None else "allocation",
            usage,
            pools,
            None if listed.reconciled is None else unreconciled_of(listed.reconciled),
            None if parts is None else parts.with_columns(for_month=pl.lit(month)),
        )

    def unreconciled(self, month: str) -> pl.DataFrame:
        """``month``'s requests that no engine reading covers, per replica group and model.

        Read from the ledger each time, closed month or not: a reading that arrives late
        reconciles them. The hang-ups are not examined again here: allocation has just done it,
        and they do not change which requests no reading covers.
        """
        return unreconciled_of(reconciled.unreconciled_rows(self.ledger, *month_bounds(month)))

    def quarantined(self, month: str) -> pl.DataFrame:
        """``month``'s records kept in quarantine and billed to no one, per kind and reason.

        Read each time, closed month or not: what arrives late for a month shows on it.
        """
        return quarantine.quarantined(self.ledger, *month_bounds(month))

    def statement(self, month: str) -> Statement:
        """``month``'s statement: frozen if closed, computed from the ledger now if open."""
        check_month(month)
        closed, _ = closing.month_state(self.ledger, month)
        if closed:
            lines = closing.issued_lines(self.ledger, month=month)
            own = lines.filter(pl.col("for_month") == month)
            adjust = int(lines.filter(pl.col("for_month") != month)["total_cents"].sum())
            basis, pools = closing.issued_basis(self.ledger, month)
            usage = closing.issued_usage_lines(self.ledger, month=month)
            return Statement(
                month,
                True,
                lines,
                int(own["total_cents"].sum()),
                adjust,
                self.unreconciled(month),
                self.quarantined(month),
                basis=basis,
                usage_lines=None if usage is None or usage.equals(lines) else usage,
                pools=pools,
                cache=self._cache(month, own),
            )
        now = self._cents(month)
        adjustments = []
        usage_adjustments = []
        adjust_cents = 0
        parts = [now.parts]
        for earlier in closing.dirty_closed_months(self.ledger, before=month):
            again = self._cents(earlier)
            diff = adjustment_lines(
                month, earlier, again.lines, closing.issued_lines(self.ledger, for_month=earlier)
            )
            adjustments.append(diff)
            adjust_cents += int(diff["total_cents"].sum())
            parts.append(again.parts)
            usage_adjustments.append(self._usage_adjustment(month, earlier, again, diff))
        all_lines = pl.concat([now.lines, *adjustments]) if adjustments else now.lines
        usage_lines = now.usage_lines
        if usage_lines is not None or any(
            not u.equals(d) for u, d in zip(usage_adjustments, adjustments, strict=True)
        ):
            # The adjustments on the usage basis too, so that their rows in the files carry
            # their list cost (each is its billed cost on the list basis, or when the earlier
            # month was closed before its usage lines were kept).
            own = now.lines if usage_lines is None else usage_lines
            usage_lines = pl.concat([own, *usage_adjustments], how="vertical_relaxed")
        return Statement(
            month,
            False,
            all_lines,
            now.fleet_cents,
            adjust_cents,
            self.unreconciled(month) if now.unreconciled is None else now.unreconciled,
            self.quarantined(month),
            basis=now.basis,
            usage_lines=usage_lines,
            pools=now.pools,
            cache=self._cache(month, now.lines),
            instance_parts=_concat(parts),
        )

    def _usage_adjustment(
        self, month: str, earlier: str, again: _Month, billed: pl.DataFrame
    ) -> pl.DataFrame:
        """The adjustment of ``earlier`` on the usage basis: what it says now on that basis
        minus what was issued for it on that basis; ``billed`` (the adjustment as billed) when
        what was issued on that basis is not known (a month closed before it was kept)."""
        issued = closing.issued_usage_lines(self.ledger, for_month=earlier)
        if issued is None:
            return billed
        now = again.lines if again.usage_lines is None else again.usage_lines
        return adjustment_lines(month, earlier, now, issued)

    def _cache(self, month: str, lines: pl.DataFrame) -> pl.DataFrame:
        """``month``'s prompt-cache hits and savings per team and model (``billing.cache``)."""
        return cache_rows(lines, month_cached_tokens(self.ledger, month), self.policy)

    def by_instance(self, statement: Statement) -> Statement:
        """``statement`` with its lines split by the instances that made them (for the exports).

        An open month's statement carries the split from the allocation that made its lines
        (``Statement.instance_parts``), which is used as it is: the files of a statement cost no
        second allocation and read the same state of the ledger as its lines. A closed month's
        frozen lines are split as the ledger makes each month up now.
        """
        parts = statement.instance_parts
        if parts is None:
            months = sorted(set(statement.lines["for_month"].to_list()))
            parts = _concat(
                [
                    allocation_runs.by_instance(
                        self.ledger, self.policy, m, invoice_store.invoices(self.ledger, m)
                    ).with_columns(for_month=pl.lit(m))
                    for m in months
                ]
            )
        if parts is None or not statement.lines.height:
            return statement
        return replace(statement, lines=instance_lines(statement.lines, parts))

    def close(self, month: str, now: float | None = None) -> Statement:
        """Freeze ``month``'s statement; later records for it become adjustments."""
        now = time.time() if now is None else now
        if month_bounds(month)[1] > now:
            raise LedgerError(
                f"month {month} has not ended yet; it can be closed from {month_of(month_bounds(month)[1])}-01"
            )
        open_before = [
            m["month"]
            for m in closing.months(self.ledger)
            if not m["closed"] and m["month"] < month
        ]
        if open_before:
            raise LedgerError(f"close {', '.join(open_before)} first: months close in order")
        # The hourly rows frozen with the month read the ledger's cost rows: rebuilt first.
        allocation_runs.refresh_hours(self.ledger)
        statement = self.statement(month)
        if not statement.reconciles:
            raise LedgerError(f"month {month} does not reconcile; refusing to close it")
        adjusted = sorted(set(statement.lines["for_month"].to_list()) - {month})
        # Read beside the writer, kept in the closing transaction: ingest does not wait for it.
        with self.ledger.snapshot() as cur:
            hours = closed_hours.hour_frames(
                cur, self.policy, month, statement.lines, self.ledger.heartbeat_seconds
            )
        closing.freeze(
            self.ledger,
            month,
            statement.lines,
            adjusted,
            now,
            statement.basis,
            statement.pools,
            partial(closed_hours.write_hours, month=month, frames=hours),
            statement.usage_lines,
        )
        return self.statement(month)

    def spend(self, now: float | None = None) -> list[Spend]:
        """Month-to-date spend, budget and forecast per team, for the current month."""
        now = time.time() if now is None else now
        return spend_of(self.statement(month_of(now)), now, self.config)


def _concat(parts: Sequence[pl.DataFrame | None]) -> pl.DataFrame | None:
    """The months' lines per instance as one frame; None when any month's are missing or
    there are none."""
    if not parts or any(p is None for p in parts):
        return None
    return pl.concat([p for p in parts if p is not None], how="diagonal_relaxed")


def spend_of(statement: Statement, now: float, config: Config) -> list[Spend]:
    """Each team's spend in ``statement`` (its month so far at ``now``), with a straight-line forecast."""
    start, end = month_bounds(statement.month)
    totals = team_totals(statement.lines, [t.name for t in config.teams])
    elapsed = max(now - start, 60.0) / (end - start)
    budgets = {t.name: t.budget_usd_per_month for t in config.teams}
    return [
        Spend(
            team,
            statement.month,
            cents / 100,
            budgets.get(team, 0.0),
            round(cents / 100 / min(1.0, elapsed), 2),
        )
        for team, cents in sorted(totals.items())
    ]
