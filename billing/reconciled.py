"""Reconciliation read from the ledger: the engines' counters against the records.

``billing.reconciliation`` builds the SQL (pure functions, and the temp tables it reads); this
runs it through the ledger's reader, for /metrics, the statement's unreconciled requests and
the tests that hold the reconciliation to its definition.
"""

from __future__ import annotations

import polars as pl

from billing import reconciliation
from billing.keeper import Keeper

__all__ = ["reconciled", "unreconciled_rows"]


def reconciled(ledger: Keeper, start: float, end: float) -> pl.DataFrame:
    """Engine counters against the ledger per instance, for the hours ``start``..``end`` touches.

    One row per instance and hour, as ``billing.reconciliation.reconciliation_sql`` says.
    """
    with ledger.reader() as cur:
        table = reconciliation.reconcile(cur, *reconciliation.hours(start, end))
        frame: pl.DataFrame = cur.sql(f"SELECT * FROM {table}").pl()
    return frame


def unreconciled_rows(ledger: Keeper, start: float, end: float) -> pl.DataFrame:
    """The reconciliation's rows for ``start``..``end`` without examining hang-ups again (what
    the statement's unreconciled requests are counted from)."""
    with ledger.reader() as cur:
        table = reconciliation.reconcile(cur, *reconciliation.hours(start, end), tails=False)
        frame: pl.DataFrame = cur.sql(f"SELECT * FROM {table}").pl()
    return frame
