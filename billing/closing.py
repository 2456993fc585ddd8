"""Months as the ledger keeps them: which have data, which are closed, and what was frozen.

A month is closed by freezing its statement lines, basis and node pools in one writing
transaction (``freeze``); a record that arrives for it later marks it dirty (ingest does that),
and the next open month's statement carries the difference as adjustments. The SQL is written
here and run through the ledger's transactions (``billing.keeper.Keeper``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import duckdb
import orjson
import polars as pl

from billing.keeper import Keeper, LedgerError
from infermeter.months import month_of
from infermeter.statement import POOL_SCHEMA, empty_pools

__all__ = [
    "dirty_closed_months",
    "freeze",
    "issued_basis",
    "issued_hours",
    "issued_lines",
    "issued_lines_sql",
    "issued_usage_lines",
    "latest_month",
    "month_state",
    "months",
]

# The frozen lines' columns, in the order ``statement_lines`` keeps them.
_LINE_COLUMNS: Final = (
    "month, for_month, team, model, requests, prompt_tokens, completion_tokens, gpu_hours, "
    "energy_kwh, compute_cents, energy_cents, idle_cents, total_cents"
)


def months(ledger: Keeper) -> list[dict[str, Any]]:
    """Every month the ledger has data for, with whether it is closed."""
    with ledger.reader() as cur:
        rows = cur.execute("SELECT month, closed_at, dirty FROM months ORDER BY month").fetchall()
    return [
        {"month": m, "closed": c is not None, "closed_at": c, "late_records": d} for m, c, d in rows
    ]


def month_state(ledger: Keeper, month: str) -> tuple[bool, bool]:
    """(closed, has late records) for ``month``; an unknown month is open and clean."""
    with ledger.reader() as cur:
        row = cur.execute("SELECT closed_at, dirty FROM months WHERE month = ?", [month]).fetchone()
    return (False, False) if row is None else (row[0] is not None, bool(row[1]))


def dirty_closed_months(ledger: Keeper, before: str) -> list[str]:
    """Closed months before ``before`` that received records after they were closed."""
    with ledger.reader() as cur:
        rows = cur.execute(
            "SELECT month FROM months WHERE closed_at IS NOT NULL AND dirty AND month < ? ORDER BY month",
            [before],
        ).fetchall()
    return [r[0] for r in rows]


def latest_month(ledger: Keeper) -> str:
    """The newest month with data, or the current month."""
    with ledger.reader() as cur:
        row = cur.execute("SELECT max(month) FROM months").fetchone()
    return row[0] if row and row[0] else month_of(time.time())


def issued_lines_sql(month: str | None, for_month: str | None) -> tuple[str, list[str]]:
    """The query of frozen lines on ``month``'s statement and/or charging ``for_month``."""
    where, params = [], []
    if month is not None:
        where.append("month = ?")
        params.append(month)
    if for_month is not None:
        where.append("for_month = ?")
        params.append(for_month)
    sql = "SELECT * FROM statement_lines" + (" WHERE " + " AND ".join(where) if where else "")
    return sql + " ORDER BY month, for_month, team, model", params


def issued_lines(
    ledger: Keeper, month: str | None = None, for_month: str | None = None
) -> pl.DataFrame:
    """Frozen statement lines, by the statement they are on and/or the month they charge."""
    sql, params = issued_lines_sql(month, for_month)
    with ledger.reader() as cur:
        frame: pl.DataFrame = cur.sql(sql, params=params).pl()
    return frame


def issued_usage_lines(
    ledger: Keeper, month: str | None = None, for_month: str | None = None
) -> pl.DataFrame | None:
    """Frozen lines on the usage basis, as ``issued_lines`` selects them; None when a month they
    are read for (``for_month``, else ``month``) was closed before they were kept: then what
    was issued on that basis is not known.

    Months close in order, so a month whose own usage lines were kept has every adjustment
    issued for it on that basis kept too."""
    sql, params = issued_lines_sql(month, for_month)
    sql = sql.replace("FROM statement_lines", "FROM statement_usage_lines", 1)
    which = for_month if for_month is not None else month
    with ledger.reader() as cur:
        kept = cur.execute(
            "SELECT 1 FROM statement_usage_months WHERE month = ?", [which]
        ).fetchall()
        if not kept:
            return None
        frame: pl.DataFrame = cur.sql(sql, params=params).pl()
    return frame


def issued_basis(ledger: Keeper, month: str) -> tuple[str, pl.DataFrame]:
    """A closed month's basis and node pools, as frozen with it (``list`` and none if it was
    closed before bases were kept)."""
    with ledger.reader() as cur:
        row = cur.execute(
            "SELECT basis, pools FROM statement_bases WHERE month = ?", [month]
        ).fetchone()
    if row is None:
        return "list", empty_pools()
    rows = orjson.loads(row[1])
    return str(row[0]), pl.DataFrame(rows, schema=POOL_SCHEMA) if rows else empty_pools()


def freeze(
    ledger: Keeper,
    month: str,
    lines: pl.DataFrame,
    adjusted: Sequence[str],
    now: float,
    basis: str = "list",
    pools: pl.DataFrame | None = None,
    hours: Callable[[duckdb.DuckDBPyConnection], None] | None = None,
    usage_lines: pl.DataFrame | None = None,
) -> None:
    """Close ``month``: store its statement lines, basis, node pools and lines on the usage
    basis (``usage_lines``; None: the statement lines, as on the list basis), and clear the
    late flag of ``adjusted``, in one transaction (``LedgerError`` when it is closed already).

    ``hours`` writes the month's hourly rows on the same cursor (``billing.closed_hours``), so
    a month is never closed without them nor they kept for a month left open.
    """
    frozen = orjson.dumps([] if pools is None else pools.to_dicts()).decode()
    with ledger.writing() as cur:
        row = cur.execute("SELECT closed_at FROM months WHERE month = ?", [month]).fetchone()
        if row is not None and row[0] is not None:
            raise LedgerError(f"month {month} is already closed")
        cur.execute("INSERT INTO months (month) VALUES (?) ON CONFLICT DO NOTHING", [month])
        for table, frame in (
            ("statement_lines", lines),
            ("statement_usage_lines", lines if usage_lines is None else usage_lines),
        ):
            cur.register("_lines", frame)
            try:
                cur.execute(f"INSERT INTO {table} SELECT {_LINE_COLUMNS} FROM _lines")
            finally:
                cur.unregister("_lines")
        cur.execute("INSERT INTO statement_usage_months VALUES (?)", [month])
        cur.execute("INSERT INTO statement_bases VALUES (?, ?, ?)", [month, basis, frozen])
        if hours is not None:
            hours(cur)
        cur.execute("UPDATE months SET closed_at = ?, dirty = false WHERE month = ?", [now, month])
        if adjusted:
            cur.execute(
                "UPDATE months SET dirty = false WHERE list_contains(?, month)", [list(adjusted)]
            )


def issued_hours(ledger: Keeper, month: str, tables: Sequence[str]) -> list[pl.DataFrame] | None:
    """A closed month's hourly rows in each of ``tables`` (``billing.closed_hours.KINDS``), in
    a stable order; None for a month closed without them (before they were kept)."""
    with ledger.reader() as cur:
        if not cur.execute("SELECT 1 FROM closed_hour_months WHERE month = ?", [month]).fetchall():
            return None
        return [
            cur.sql(f"SELECT * FROM {t} WHERE month = ? ORDER BY ALL", params=[month]).pl()
            for t in tables
        ]
