"""The month's reconciliation kept per hour, so a statement reads it instead of working it out.

Reconciling a month (``billing.reconciliation.reconcile``) places every edge record in its
engine window and looks at every hang-up: at 20M records a month that was half a statement's
time, every time. The result for an hour does not change once nothing that reaches it arrives, so
the ledger keeps the month's rows (``reconciliation_hours``) and its hang-up tails per team
(``reconciliation_tails``), and ``reconciliation_built`` says up to which hour they hold
(``clean_before``).

What an hour's rows depend on reaches forward, not back: a window starts at its instance's
previous reading, a stream placed at its first token counts in the windows up to its end, an
instance's records after its last reading become unreconciled once the fleet has been read
``PENDING_SECONDS`` later, and a hang-up's tail is read between the readings around it. So a
batch makes a *suffix* of each month stale, from the earliest hour it can reach:

- usage records: the hour before the earliest one received (a record overlapping a hang-up's
  interval began before the interval's end, which is in the tail's hour);
- engine readings: the hour before each reading instance's previous reading (its records after
  it are placed, or waited for, anew) and before the fleet's newest reading ahead of the batch,
  less ``PENDING_SECONDS`` (the instances whose records the batch can make stale); or before the
  first token of a stream across one of those readings, if earlier.

The marks are set in the batch's transaction (``mark_usage_sql``, ``mark_samples_sql``). A
statement reads the kept hours and works out the stale suffix in its own snapshot
(``month_reconciliation``); the upkeep loop keeps it (``refresh``). The suffix is reconciled over
a range starting early enough that each of its windows has the previous reading the whole month
gives it (``restart_hour``), so its rows are the whole month's, to the token. SQL built by pure
functions; the ledger runs it.
"""

from __future__ import annotations

from typing import Final

import duckdb
import polars as pl

from billing.allocation import Policy
from billing.hangups import NO_TAILS
from billing.ingest_sql import BILLABLE, FIRST_TOKEN_SQL
from billing.keeper import Keeper
from billing.reconciliation import (
    LOOKBACK_SECONDS,
    claim_rows,
    hours,
    reconcile,
    tail_lines,
    unattributed_sql,
)
from billing.schema import HOUR_SECONDS
from billing.unreconciled import PENDING_SECONDS
from infermeter.months import month_bounds

__all__ = [
    "Claims",
    "claims",
    "mark_samples_sql",
    "mark_usage_sql",
    "month_reconciliation",
    "refresh",
    "restart_hour",
]

H: Final = HOUR_SECONDS
_BACK: Final = LOOKBACK_SECONDS // HOUR_SECONDS
_ORDER: Final = "ORDER BY t, replica, instance"


def _mark(hour: str) -> str:
    """SQL moving every month's ``clean_before`` back to the hour ``hour`` (a scalar query; NULL:
    nothing to mark) when it falls before the month's end."""
    return f"""
UPDATE reconciliation_built SET clean_before = least(clean_before, greatest(first_hour, d.hour))
FROM (SELECT ({hour}) AS hour) d
WHERE d.hour IS NOT NULL AND reconciliation_built.end_hour > d.hour"""


def mark_usage_sql() -> str:
    """SQL marking the months' kept reconciliation stale from the ``fresh`` usage records on."""
    earliest = f"least(received_at, {FIRST_TOKEN_SQL})"
    return _mark(
        f"SELECT CAST(floor(min({earliest}) / {H}) AS BIGINT) - 1 FROM fresh "
        f"WHERE status IN {BILLABLE}"
    )


def mark_samples_sql() -> str:
    """SQL marking the months' kept reconciliation stale from the ``fresh`` engine readings on.

    The readings that can change: each reading instance's last one before the batch (its
    records after it wait, or are placed, anew; with none, the batch's first is its first, and
    the records across it count differently), and every instance's last one from ``PENDING_SECONDS``
    before the fleet's newest before the batch (the batch can make them stale). The rows that
    change are those of the records after such a reading, or across it: from the earlier of the
    reading and the first token of a kept edge record that ends after it (a summed record lies
    in one hour). Run before the readings reach ``engine_hours``, whose windows are then the
    ones the kept rows were made from.
    """
    return _mark(f"""
WITH f AS (SELECT coalesce(instance, replica) AS i, min("timestamp") AS ts FROM fresh GROUP BY 1),
previous AS (
    SELECT coalesce(max(e.last_ts), min(f.ts)) AS r
    FROM f LEFT JOIN engine_hours e ON e.instance = f.i AND e.hour < floor(f.ts / {H})
    GROUP BY f.i
),
since AS (
    SELECT least(
        (SELECT min(r) FROM previous),
        (SELECT max(last_ts) FROM engine_hours
         WHERE hour < (SELECT floor(min(ts) / {H}) FROM f)) - {PENDING_SECONDS}
    ) AS r
)
SELECT CAST(floor(least(
    (SELECT r FROM since),
    (SELECT min(first_token_at) FROM usage_edges WHERE finished_at > (SELECT r FROM since))
) / {H}) AS BIGINT) - 1""")


def restart_hour(con: duckdb.DuckDBPyConnection, first: int, end: int, stale: int) -> int:
    """The first hour of a reconciliation whose rows from ``stale`` on are those of the whole
    range ``first``..``end``.

    The range read starts ``LOOKBACK_SECONDS`` before its first hour: far enough when it starts
    at or before the last window before ``stale`` of every instance read at ``stale`` or later
    (or just after the range: whether an instance is read again decides if its records wait).
    Then each window from ``stale`` on has the same previous reading, the same records and the
    same fleet's newest reading as in the whole range. When no instance is read from ``stale``
    on, the whole range.
    """
    if stale <= first:
        return first
    row = con.execute(
        f"""
SELECT count(*), min(prev) FROM (
    SELECT instance, max(hour) FILTER (WHERE hour < $stale) AS prev, max(hour) AS last
    FROM engine_hours WHERE hour >= $first - {_BACK} AND hour < $end + {_BACK}
    GROUP BY instance
) WHERE last >= $stale""",
        {"first": first, "end": end, "stale": stale},
    ).fetchone()
    read, earliest = (0, None) if row is None else row
    if not read:
        return first
    start = stale - 1 if earliest is None else min(stale - 1, int(earliest))
    return max(first, start)


def _kept(first: int, clean: int, table: str, hour: str) -> str:
    return f"SELECT * FROM {table} WHERE {hour} >= {first} AND {hour} < {clean}"


def month_reconciliation(
    con: duckdb.DuckDBPyConnection, first: int, end: int, *, keep: bool = False
) -> bool:
    """Leave the reconciliation of the hours ``first``..``end`` (a month's) in temp tables
    ``_reconciliation`` and ``_hangups``, as ``reconcile`` leaves them: the kept hours, and the
    stale suffix reconciled here. With ``keep`` (in a writing transaction), the suffix is kept
    too. Whether anything was reconciled."""
    built = con.execute(
        "SELECT clean_before FROM reconciliation_built WHERE first_hour = ? AND end_hour = ?",
        [first, end],
    ).fetchall()
    clean = int(built[0][0]) if built else first
    if clean < end:
        reconcile(con, restart_hour(con, first, end, clean), end)
        since = f"t >= {clean * H}"
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE _fresh_rows AS SELECT * FROM _reconciliation WHERE {since}"
        )
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE _fresh_tails AS SELECT * FROM _hangups WHERE hour >= {clean}"
        )
    else:
        con.execute(
            "CREATE OR REPLACE TEMP TABLE _fresh_rows AS SELECT * FROM reconciliation_hours LIMIT 0"
        )
        con.execute(f"CREATE OR REPLACE TEMP TABLE _fresh_tails AS {NO_TAILS}")
    if keep and clean < end:
        con.execute(f"DELETE FROM reconciliation_hours WHERE t >= {clean * H} AND t < {end * H}")
        con.execute(f"DELETE FROM reconciliation_tails WHERE hour >= {clean} AND hour < {end}")
        con.execute("INSERT INTO reconciliation_hours SELECT * FROM _fresh_rows")
        con.execute("INSERT INTO reconciliation_tails SELECT * FROM _fresh_tails")
        con.execute(
            "INSERT OR REPLACE INTO reconciliation_built VALUES (?, ?, ?)", [first, end, end]
        )
    rows = _kept(first * H, clean * H, "reconciliation_hours", "t")
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE _reconciliation AS "
        f"SELECT * FROM ({rows} UNION ALL SELECT * FROM _fresh_rows) {_ORDER}"
    )
    tails = _kept(first, clean, "reconciliation_tails", "hour")
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE _hangups AS {tails} UNION ALL SELECT * FROM _fresh_tails"
    )
    return clean < end


def refresh(ledger: Keeper) -> int:
    """Keep the reconciliation of the months a statement can recompute (open, or closed and
    reopened by late records) up to date; how many had a stale suffix.

    A month at a time, each in a transaction of its own: ingest waits for one month's suffix,
    never for a backlog.
    """
    with ledger.reader() as cur:
        months = [
            str(m)
            for (m,) in cur.execute(
                "SELECT month FROM months WHERE closed_at IS NULL OR dirty ORDER BY month"
            ).fetchall()
        ]
    done = 0
    for month in months:
        start, stop = month_bounds(month)
        with ledger.writing() as cur:
            done += month_reconciliation(cur, *hours(start, stop), keep=True)
    return done


class Claims:
    """The claims of the hours in ``start``..``end``, for ``allocation.run`` on a ledger.

    Called with the connection ``allocation.run`` gives: reads the month's kept reconciliation
    and reconciles its stale hours (``month_reconciliation``) once, then prices it against that allocation's ``_slots``; the
    hang-up tails come along as lines of tokens. Called again on the same connection (the
    second allocation of a month with an invoice), it prices the same reconciliation against the
    new ``_slots``. ``reconciled``: the reconciliation's rows, once it ran, so a statement's
    unreconciled requests come from the same pass (``billing.unreconciled``), not a second one.
    """

    def __init__(self, policy: Policy, start: float, end: float) -> None:
        self.policy, self.start, self.end = policy, start, end
        self.reconciled: pl.DataFrame | None = None
        self._on: duckdb.DuckDBPyConnection | None = None

    def __call__(self, con: duckdb.DuckDBPyConnection) -> tuple[pl.DataFrame, pl.DataFrame]:
        if self._on is not con:
            month_reconciliation(con, *hours(self.start, self.end))
            self.reconciled = con.sql("SELECT * FROM _reconciliation").pl()
            self._on = con
        hourly = con.sql(unattributed_sql(self.policy, "_reconciliation")).pl()
        tails = con.sql(
            "SELECT team, model, sum(prompt_tokens) AS prompt_tokens, "
            "sum(completion_tokens) AS completion_tokens FROM _hangups GROUP BY ALL"
        ).pl()
        return claim_rows(hourly, self.policy), tail_lines(tails)


def claims(policy: Policy, start: float, end: float) -> Claims:
    """``Claims`` of the hours in ``start``..``end`` under ``policy``."""
    return Claims(policy, start, end)
