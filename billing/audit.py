"""The audit trail in the ledger: appended in the transaction of the change, read by the admin.

Only ``append_sql`` writes to ``audit_events``, and only inserts, once per ``event_id``: a
shipped event sent again adds nothing. No function here (and no route) updates or deletes a row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any, Final

import duckdb

from infermeter.audit import AuditEvent

__all__ = ["COLUMNS", "append", "read"]

COLUMNS: Final = tuple(f.name for f in fields(AuditEvent))
_NAMES: Final = ", ".join(COLUMNS)
# The most events one read returns; a longer trail is read by ranges (``from``, ``to``).
MAX_READ: Final = 10_000


def append(cur: duckdb.DuckDBPyConnection, events: Iterable[AuditEvent], now: float) -> int:
    """Keep ``events`` not kept yet (by id), inside the caller's transaction; how many were new."""
    rows = [[getattr(e, c) for c in COLUMNS] + [now] for e in events]
    if not rows:
        return 0
    before = _count(cur)
    cur.execute("CREATE OR REPLACE TEMP TABLE _audit_in AS SELECT * FROM audit_events WITH NO DATA")
    cur.executemany(f"INSERT INTO _audit_in VALUES ({', '.join('?' * (len(COLUMNS) + 1))})", rows)
    cur.execute(
        "INSERT INTO audit_events SELECT * FROM (SELECT * FROM _audit_in "
        "QUALIFY row_number() OVER (PARTITION BY event_id) = 1) ANTI JOIN audit_events USING (event_id)"
    )
    cur.execute("DROP TABLE _audit_in")
    return _count(cur) - before


def _count(cur: duckdb.DuckDBPyConnection) -> int:
    row = cur.execute("SELECT count(*) FROM audit_events").fetchone()
    return int(row[0]) if row else 0


def read(
    cur: duckdb.DuckDBPyConnection,
    start: float,
    end: float,
    actions: Sequence[str] = (),
    limit: int = MAX_READ,
) -> list[dict[str, Any]]:
    """The events of ``start``..``end`` (of ``actions`` when given), oldest first."""
    where = "occurred_at >= ? AND occurred_at < ?"
    params: list[Any] = [start, end]
    if actions:
        where += f" AND action IN ({', '.join('?' * len(actions))})"
        params += list(actions)
    found = cur.execute(
        f"SELECT {_NAMES} FROM audit_events WHERE {where} ORDER BY occurred_at, event_id LIMIT ?",
        [*params, min(limit, MAX_READ)],
    ).fetchall()
    return [dict(zip(COLUMNS, row, strict=True)) for row in found]
