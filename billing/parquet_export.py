"""The ledger's tables written to Parquet, whole or by month, for engines that read files.

``infermeter billing export`` and the admin's export route write what the ledger holds as it is
at one moment; the SQL (``COPY``) is built here and run through the ledger's reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from billing.keeper import Keeper, LedgerError
from infermeter.records import KINDS

__all__ = ["copy_sql", "export_parquet", "export_table", "table_names"]

# A raw table's time column, for partitioning its Parquet export by month.
_TIME_COLUMNS: Final = {k.table: f'"{k.time_field}"' for k in KINDS.values()}


def table_names(ledger: Keeper) -> list[str]:
    """The ledger's own tables (not temporary ones)."""
    with ledger.reader() as cur:
        rows = cur.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' AND NOT temporary "
            "ORDER BY table_name"
        ).fetchall()
    return [r[0] for r in rows]


def copy_sql(table: str, out: Path, partitioned: bool) -> tuple[str, Path]:
    """The ``COPY`` of ``table`` to Parquet under ``out``, and the path it writes.

    With ``partitioned``, a raw table is written Hive-style by month (``usage/month=2026-11/...``).
    """
    time_col = _TIME_COLUMNS.get(table)
    if partitioned and time_col:
        target = out / table
        month = f"strftime(make_timestamp(CAST({time_col} * 1000000 AS BIGINT)), '%Y-%m')"
        sql = (
            f"COPY (SELECT *, {month} AS month FROM {table}) TO '{_sql_path(target)}' "
            "(FORMAT parquet, PARTITION_BY (month), OVERWRITE_OR_IGNORE)"
        )
        return sql, target
    target = out / f"{table}.parquet"
    return f"COPY {table} TO '{_sql_path(target)}' (FORMAT parquet)", target


def export_table(
    ledger: Keeper, table: str, directory: str | Path, partitioned: bool = False
) -> Path:
    """Write ``table`` to Parquet under ``directory``; returns the path written.

    With ``partitioned``, raw tables are written Hive-style by month, so an engine reading
    object storage opens only the months it needs.
    """
    if table not in table_names(ledger):
        raise LedgerError(f"no table {table!r} in the ledger")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    sql, target = copy_sql(table, out, partitioned)
    with ledger.reader() as cur:
        cur.execute(sql)
    return target


def export_parquet(ledger: Keeper, directory: str | Path, partitioned: bool = False) -> list[Path]:
    """Write every table to Parquet under ``directory``; returns the paths written."""
    return [export_table(ledger, t, directory, partitioned) for t in table_names(ledger)]


def _sql_path(path: Path) -> str:
    return str(path).replace("'", "''")
