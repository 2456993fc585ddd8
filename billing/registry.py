"""The instance registry read from the ledger: each engine's lifetime, and the live ones counted.

``billing.lifetimes`` builds the SQL (pure); this runs it through the ledger's reader, with what
the ledger knows of its own start (``Ledger.restart``) and, when the live instances are bounded
by the configuration, what the autoscaler asked for lately (``billing.fleet.asked_sql``).
"""

from __future__ import annotations

from typing import Any, Literal

import duckdb

from billing.fleet import asked_sql
from billing.ledger import Ledger
from billing.lifetimes import (
    COLUMNS,
    DEFAULT_HEARTBEAT_SECONDS,
    GroupCaps,
    LiveBound,
    lifetimes_sql,
    live_counts_sql,
)

__all__ = ["lifetimes", "live_instances"]


def live_instances(
    ledger: Ledger,
    now: float,
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
    bound: LiveBound | None = None,
) -> list[tuple[str, str, int]]:
    """(replica group, model, live instances), for /metrics; within ``bound`` when given."""
    with ledger.reader() as cur:
        caps = _caps(cur, bound, now)
        sql, params = live_counts_sql(now, heartbeat_seconds, ledger.restart, caps)
        return [(str(r), str(m), int(n)) for r, m, n in cur.execute(sql, params).fetchall()]


def lifetimes(
    ledger: Ledger,
    now: float,
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
    state: Literal["live", "all"] = "all",
    replica: str | None = None,
    limit: int | None = None,
    bound: LiveBound | None = None,
) -> list[dict[str, Any]]:
    """Instance lifetimes as ``billing.lifetimes`` defines them, one dict per lifetime.

    ``bound``: the live ones are at most what the configuration allows (``LiveBound``).
    """
    with ledger.reader() as cur:
        caps = _caps(cur, bound, now) if state == "live" else None
        sql, params = lifetimes_sql(
            now, heartbeat_seconds, state, replica, limit, ledger.restart, caps
        )
        rows = cur.execute(sql, params).fetchall()
    return [dict(zip(COLUMNS, row, strict=True)) for row in rows]


def _caps(cur: duckdb.DuckDBPyConnection, bound: LiveBound | None, now: float) -> GroupCaps | None:
    """``bound``'s caps, given what the autoscaler asked for lately; None without a bound."""
    if bound is None:
        return None
    sql, params = asked_sql(now - bound.asked_seconds)
    return bound.caps({str(m): int(n) for m, n in cur.execute(sql, params).fetchall()})
