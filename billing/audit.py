"""The audit trail in the ledger: appended in the transaction of the change, read by the admin.

Only ``append`` writes to ``audit_events``, and only inserts, once per ``event_id``: a shipped
event sent again adds nothing. The events go in as one Arrow table in one ``INSERT ... SELECT``,
not row by row: the caller holds the ledger's writer lock, and every other writer waits for it
(50,000 rows one by one held it for 34 s). No function here (and no route) updates or deletes a
row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any, Final

import duckdb
import pyarrow as pa

from infermeter.audit import AuditEvent

__all__ = ["COLUMNS", "append", "read"]

COLUMNS: Final = tuple(f.name for f in fields(AuditEvent))
_NAMES: Final = ", ".join(COLUMNS)
# The most events one read of the routes returns; they say where a longer trail reads on.
MAX_READ: Final = 10_000
_SCHEMA: Final = pa.schema(
    [(c, pa.float64() if c == "occurred_at" else pa.string()) for c in COLUMNS]
)


def append(cur: duckdb.DuckDBPyConnection, events: Iterable[AuditEvent], now: float) -> int:
    """Keep ``events`` not kept yet (by id), inside the caller's transaction; how many were new."""
    found = list(events)
    if not found:
        return 0
    batch = pa.table({c: [getattr(e, c) for e in found] for c in COLUMNS}, schema=_SCHEMA)
    cur.register("_audit_in", batch)
    try:
        row = cur.execute(
            f"INSERT INTO audit_events ({_NAMES}, kept_at) SELECT {_NAMES}, $now FROM ("
            "SELECT * FROM _audit_in QUALIFY row_number() OVER (PARTITION BY event_id) = 1"
            ") ANTI JOIN audit_events USING (event_id)",
            {"now": now},
        ).fetchone()
    finally:
        cur.unregister("_audit_in")
    return int(row[0]) if row else 0


def read(
    cur: duckdb.DuckDBPyConnection,
    start: float,
    end: float,
    actions: Sequence[str] = (),
    limit: int = MAX_READ,
    after: str | None = None,
) -> list[dict[str, Any]]:
    """The events of ``start``..``end`` (of ``actions`` when given), oldest first, at most
    ``limit`` (the routes read ``MAX_READ`` and one more, to know whether there are more).
    ``after``: an event id; events at ``start`` itself are
    then those ordered after it (``event_id``), so that a read continued from the last event
    of the one before (its ``occurred_at`` and id) gives every event once."""
    where = "occurred_at >= ? AND occurred_at < ?"
    params: list[Any] = [start, end]
    if after is not None:
        where += " AND (occurred_at > ? OR event_id > ?)"
        params += [start, after]
    if actions:
        where += f" AND action IN ({', '.join('?' * len(actions))})"
        params += list(actions)
    found = cur.execute(
        f"SELECT {_NAMES} FROM audit_events WHERE {where} ORDER BY occurred_at, event_id LIMIT ?",
        [*params, limit],
    ).fetchall()
    return [dict(zip(COLUMNS, row, strict=True)) for row in found]
