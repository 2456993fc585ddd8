"""A month's allocation run on the ledger: the hourly cost rows it reads, priced and split.

The SQL is built by pure functions (``billing.allocation``, ``billing.hourly`` and, for the
month's rows, ``month_rows`` here); the runners take the ledger (``billing.keeper.Keeper``) and
run it in one of its transactions: an allocation in one snapshot (``Keeper.snapshot``), so its
lines add up to the fleet cost while batches keep arriving; a rebuild of the hourly rows in a
writing transaction per run of hours (``Keeper.writing``), so ingest waits for one run, never
for a whole backlog.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import duckdb
import polars as pl

from billing import allocation, bases, hourly, reconciliation_hours
from billing.allocation import Allocation, Policy
from billing.keeper import Keeper
from billing.lifetimes import slot_windows_sql
from billing.schema import SLOT_SECONDS
from infermeter.months import month_bounds

__all__ = [
    "allocate",
    "allocate_bases",
    "by_instance",
    "mark_all_hours_dirty",
    "month_rows",
    "refresh_hours",
    "stale_hours_sql",
]


def allocate(ledger: Keeper, policy: Policy, month: str) -> tuple[pl.DataFrame, int]:
    """``month``'s allocation lines (money in micro-cents) and fleet cost, from the rollups.

    Tokens the engines counted and no record carries are lines of their own, costed out of
    the idle capacity (``billing.reconciliation``). Read in one snapshot: the lines add up
    to the fleet cost while batches keep arriving.
    """
    claims = reconciliation_hours.claims(policy, *month_bounds(month))
    with ledger.snapshot() as cur:
        queries = _month_sql(cur, ledger.heartbeat_seconds, policy, month)
        return allocation.run(cur, queries, policy, claims)


def allocate_bases(
    ledger: Keeper,
    policy: Policy,
    month: str,
    invoices: Mapping[str, int],
    split_by_instance: bool = False,
) -> tuple[Allocation, Allocation | None]:
    """``month``'s allocation at list prices and, when ``invoices`` (pool -> cents) covers a
    pool, at the allocation basis (``billing.bases``): both read in one snapshot, so the
    scale is worked out from exactly the GPU time it then divides. With
    ``split_by_instance``, the basis the lines are on carries its lines per instance
    (``Allocation.instances``), from the same run."""
    claims = reconciliation_hours.claims(policy, *month_bounds(month))
    heartbeat = ledger.heartbeat_seconds
    with ledger.snapshot() as cur:
        listed = allocation.run_all(
            cur,
            _month_sql(cur, heartbeat, policy, month),
            policy,
            claims,
            split_by_instance and not invoices,
        )
        listed = replace(listed, reconciled=claims.reconciled)
        if not invoices:
            return listed, None
        scaled_policy = bases.scaled_policy(policy, listed.pools, listed.commitments, invoices)
        scaled = allocation.run_all(
            cur,
            _month_sql(cur, heartbeat, scaled_policy, month),
            scaled_policy,
            claims,
            split_by_instance,
        )
        return listed, bases.with_unmeasured(scaled, listed, invoices, policy.platform_account)


def by_instance(
    ledger: Keeper, policy: Policy, month: str, invoices: Mapping[str, int] | None = None
) -> pl.DataFrame:
    """``month``'s lines per instance, in micro-cents (``billing.allocation.by_instance``),
    at the allocation basis when ``invoices`` covers a pool."""
    heartbeat = ledger.heartbeat_seconds
    with ledger.snapshot() as cur:
        queries = _month_sql(cur, heartbeat, policy, month)
        if invoices:
            use, held = allocation.pool_use(cur, queries, policy)
            policy = bases.scaled_policy(policy, use, held, invoices)
            queries = _month_sql(cur, heartbeat, policy, month)
        return allocation.by_instance(cur, queries, policy)


def mark_all_hours_dirty(ledger: Keeper) -> None:
    """Mark every hour with GPU time for a rebuild (after a change the marks cannot see)."""
    with ledger.writing() as cur:
        cur.execute(hourly.DIRTY_ALL)


def refresh_hours(ledger: Keeper) -> int:
    """Rebuild the hourly cost rows of the hours marked dirty; how many hours were rebuilt.

    A run of hours at a time, each in a transaction of its own (``writing``): ingest waits
    for one run, never for a whole backlog. A change of ``heartbeat_seconds`` moves every
    lifetime's end, so it marks every hour dirty first.
    """
    heartbeat = ledger.heartbeat_seconds
    with ledger.writing() as cur:
        built = cur.execute("SELECT heartbeat_seconds FROM hours_built").fetchall()
        if not built or float(built[0][0]) != heartbeat:
            cur.execute(hourly.DIRTY_ALL)
            cur.execute("DELETE FROM hours_built")
            cur.execute("INSERT INTO hours_built VALUES (?)", [heartbeat])
        dirty = [int(h) for (h,) in cur.execute("SELECT hour FROM hours_dirty").fetchall()]
    for first, after in hourly.runs(dirty, hourly.REBUILD_HOURS):
        with ledger.writing() as cur:
            span = f"hour >= {first} AND hour < {after}"
            cur.execute(f"DELETE FROM cost_hours WHERE {span}")
            cur.execute(f"DELETE FROM share_hours WHERE {span}")
            _build_hours(cur, heartbeat, first, after, "cost_hours", "share_hours")
            cur.execute(f"DELETE FROM hours_dirty WHERE {span}")
    return len(dirty)


def stale_hours_sql(month: str, current: bool) -> tuple[str, str]:
    """The query of ``month``'s hours to build afresh, and the predicate of kept rows to leave out.

    ``current``: the kept rows were built under the ledger's heartbeat, so only the hours still
    marked dirty are stale; otherwise (another heartbeat, or none built yet) every hour with
    GPU time is.
    """
    lo, hi = _slot_range(month)
    if current:
        h0, h1 = lo // hourly.HOUR_SLOTS, hi // hourly.HOUR_SLOTS
        stale = f"SELECT hour FROM hours_dirty WHERE hour >= {h0} AND hour < {h1}"
        return stale, "hour IN (SELECT hour FROM hours_dirty)"
    stale = f"SELECT DISTINCT slot // {hourly.HOUR_SLOTS} FROM gpu_slots WHERE slot >= {lo} AND slot < {hi}"
    return stale, "true"


def month_rows(month: str, fresh: str, costs: str, shares: str) -> hourly.HourRows:
    """``month``'s hourly rows: the kept ones but where ``fresh`` holds, and ``costs`` and
    ``shares`` (the hours built afresh) instead."""
    lo, hi = _slot_range(month)
    h0, h1 = lo // hourly.HOUR_SLOTS, hi // hourly.HOUR_SLOTS
    in_month = f"hour >= {h0} AND hour < {h1}"
    return hourly.HourRows(
        f"(SELECT * FROM cost_hours WHERE {in_month} AND NOT {fresh} UNION ALL BY NAME SELECT * FROM {costs})",
        f"(SELECT * FROM share_hours WHERE {in_month} AND NOT {fresh} UNION ALL BY NAME SELECT * FROM {shares})",
        "alloc_keys",
        f"(SELECT * FROM alloc_hours WHERE {in_month})",
    )


def _month_sql(
    cur: duckdb.DuckDBPyConnection, heartbeat: float, policy: Policy, month: str
) -> allocation.AllocationSql:
    """``month``'s allocation queries over its hourly cost rows (``billing.hourly``).

    The clean hours' rows are the ledger's; the hours still marked dirty in this snapshot
    (a batch committed since the last rebuild) are built here, into temp tables, from the
    same rollups, so a statement never reads a stale hour.
    """
    built = cur.execute("SELECT heartbeat_seconds FROM hours_built").fetchall()
    stale, fresh = stale_hours_sql(month, bool(built) and float(built[0][0]) == heartbeat)
    dirty = [int(h) for (h,) in cur.execute(stale).fetchall()]
    cur.execute("CREATE OR REPLACE TEMP TABLE _fresh_costs AS SELECT * FROM cost_hours LIMIT 0")
    cur.execute("CREATE OR REPLACE TEMP TABLE _fresh_shares AS SELECT * FROM share_hours LIMIT 0")
    for first, after in hourly.runs(dirty, hourly.REBUILD_HOURS):
        _build_hours(cur, heartbeat, first, after, "_fresh_costs", "_fresh_shares")
    rows = month_rows(month, fresh, "_fresh_costs", "_fresh_shares")
    return allocation.priced_sql_of(policy, rows, period=month_bounds(month))


def _build_hours(
    cur: duckdb.DuckDBPyConnection,
    heartbeat: float,
    first: int,
    after: int,
    costs: str,
    shares: str,
) -> None:
    """Append the hourly cost rows of hours ``first``..``after`` to ``costs`` and ``shares``."""
    lo, hi = first * hourly.HOUR_SLOTS, after * hourly.HOUR_SLOTS
    within = f"slot >= {lo} AND slot < {hi}"
    # Materialised once: the rebuild reads the windows for every GPU row.
    windows = slot_windows_sql(lo, hi, heartbeat)
    cur.execute(f"CREATE OR REPLACE TEMP TABLE _lifetimes AS SELECT * FROM {windows}")
    # No lifetime in the range (a fleet of fixed replicas): nothing to bound, and the check
    # of every GPU minute against them is skipped.
    known = bool(cur.execute("SELECT 1 FROM _lifetimes LIMIT 1").fetchall())
    cur.execute(
        hourly.minutes_sql(
            f"(SELECT * FROM gpu_slots WHERE {within})",
            f"(SELECT replica, instance, slot, inflight_seconds AS occupied FROM replica_slots WHERE {within})",
            "alloc_units",
            "_lifetimes" if known else None,
            (lo, hi),
        )
    )
    cur.execute(f"INSERT INTO {costs} BY NAME {hourly.cost_rows_sql()}")
    slots = f"(SELECT * FROM alloc_slots WHERE {within})"
    cur.execute(f"INSERT INTO {shares} BY NAME {hourly.share_rows_sql(slots, (lo, hi))}")


def _slot_range(month: str) -> tuple[int, int]:
    start, end = month_bounds(month)
    return int(start // SLOT_SECONDS), int(end // SLOT_SECONDS)
