"""The query side outside the ledger: its SQL builders on a scratch database, its runners on any
keeper of the ledger's three transactions (``billing.keeper.Keeper``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pytest

from billing import allocation_runs, closing, parquet_export
from billing.keeper import LedgerError
from billing.ledger import Ledger, connect
from tests.billing.conftest import OCT

OCT_HOUR = int(OCT // 3600)


class ScratchKeeper:
    """The ledger's transactions over one scratch connection: what the runners may rely on."""

    heartbeat_seconds = 30.0

    def __init__(self) -> None:
        self.con = connect()
        self.writes = 0

    @contextmanager
    def reader(self) -> Iterator[duckdb.DuckDBPyConnection]:
        cursor = self.con.cursor()
        try:
            yield cursor
        finally:
            cursor.close()

    snapshot = reader

    @contextmanager
    def writing(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self.reader() as cursor:
            cursor.execute("BEGIN TRANSACTION")
            try:
                yield cursor
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")
            self.writes += 1


@pytest.fixture
def keeper() -> ScratchKeeper:
    keeper = ScratchKeeper()
    keeper.con.execute(
        "CREATE TABLE months (month VARCHAR PRIMARY KEY, closed_at DOUBLE, dirty BOOLEAN DEFAULT false)"
    )
    keeper.con.execute("CREATE TABLE statement_bases (month VARCHAR, basis VARCHAR, pools VARCHAR)")
    keeper.con.execute(
        "CREATE TABLE statement_lines (month VARCHAR, for_month VARCHAR, team VARCHAR, "
        "model VARCHAR, requests BIGINT, prompt_tokens BIGINT, completion_tokens BIGINT, "
        "gpu_hours DOUBLE, energy_kwh DOUBLE, compute_cents BIGINT, energy_cents BIGINT, "
        "idle_cents BIGINT, total_cents BIGINT)"
    )
    keeper.con.execute("CREATE TABLE statement_usage_lines AS SELECT * FROM statement_lines")
    keeper.con.execute("CREATE TABLE statement_usage_months (month VARCHAR PRIMARY KEY)")
    return keeper


def test_a_month_is_frozen_once_through_the_keepers_writing_transaction(
    ledger: Ledger, keeper: ScratchKeeper
) -> None:
    """freeze writes in one writing transaction, and refuses a month already closed."""
    lines = closing.issued_lines(ledger, month="2026-10").head(0)
    closing.freeze(keeper, "2026-10", lines, [], now=OCT + 40 * 86400)
    assert keeper.writes == 1
    assert closing.month_state(keeper, "2026-10") == (True, False)
    with pytest.raises(LedgerError, match="already closed"):
        closing.freeze(keeper, "2026-10", lines, [], now=OCT + 41 * 86400)
    assert keeper.writes == 1
    assert closing.issued_basis(keeper, "2026-10")[0] == "list"
    # Its lines on the usage basis are kept in the same transaction (here, on the list basis,
    # the statement lines themselves).
    assert closing.issued_usage_lines(keeper, month="2026-10") is not None


@pytest.mark.parametrize(
    ("month", "for_month", "where"),
    [
        ("2026-11", None, "WHERE month = ?"),
        (None, "2026-10", "WHERE for_month = ?"),
        ("2026-11", "2026-10", "WHERE month = ? AND for_month = ?"),
        (None, None, "ORDER BY"),
    ],
)
def test_issued_lines_are_asked_for_by_statement_and_month_charged(
    month: str | None, for_month: str | None, where: str
) -> None:
    """The frozen lines' query filters by what is given, with placeholders, and orders them."""
    sql, params = closing.issued_lines_sql(month, for_month)
    assert f"statement_lines {where}" in sql
    assert params == [p for p in (month, for_month) if p is not None]


def test_stale_hours_are_the_dirty_ones_when_the_rows_are_current(keeper: ScratchKeeper) -> None:
    """Rows built under the ledger's heartbeat: only the month's dirty hours are rebuilt."""
    keeper.con.execute("CREATE TABLE hours_dirty (hour BIGINT)")
    keeper.con.execute("CREATE TABLE gpu_slots (slot BIGINT)")
    keeper.con.execute(
        "INSERT INTO hours_dirty VALUES (?), (?)", [OCT_HOUR + 5, OCT_HOUR - 1]
    )  # the second is September's
    keeper.con.execute("INSERT INTO gpu_slots VALUES (?)", [(OCT_HOUR + 7) * 60])
    current, _ = allocation_runs.stale_hours_sql("2026-10", current=True)
    every, fresh = allocation_runs.stale_hours_sql("2026-10", current=False)
    assert keeper.con.execute(current).fetchall() == [(OCT_HOUR + 5,)]
    assert keeper.con.execute(every).fetchall() == [(OCT_HOUR + 7,)]
    assert fresh == "true"


def test_a_raw_table_is_copied_by_month_and_a_rollup_whole(tmp_path: Path) -> None:
    """Raw tables go Hive-style under their name; others to one file named after the table."""
    raw, raw_target = parquet_export.copy_sql("usage", tmp_path, partitioned=True)
    whole, whole_target = parquet_export.copy_sql("months", tmp_path, partitioned=True)
    assert raw_target == tmp_path / "usage"
    assert "PARTITION_BY (month)" in raw
    assert whole_target == tmp_path / "months.parquet"
    assert "PARTITION_BY" not in whole


def test_the_ledger_is_a_keeper(ledger: Ledger) -> None:
    """The runners take the ledger itself: its months are read through its own reader."""
    assert closing.months(ledger) == []
    assert {"months", "statement_lines", "usage"} <= set(parquet_export.table_names(ledger))
