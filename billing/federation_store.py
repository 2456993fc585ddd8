"""The ledger's side of federation: a cluster's closed months read out, and the central's copy
of every cluster's (``federated_lines``, ``federated_months``, ``federated_clusters``, and the
months' hours in ``federated_cost_hours``, ``federated_usage_hours``,
``federated_reconciled_hours``).

A (cluster, month) is replaced in one transaction, lines, hours and month together, so a reader
sees either the old copy or the new one, never a mix; a failed pull writes only the cluster's
state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import orjson
import polars as pl

from billing import closing, federation
from billing.closed_hours import KINDS
from billing.federation import FEDERATED_SCHEMA, ClusterState, MonthPayload, month_payload
from billing.ledger import Ledger
from infermeter.statement import LINE_SCHEMA

log = logging.getLogger("infermeter.billing")

__all__ = [
    "MonthDigests",
    "closed_months",
    "federated_hours",
    "federated_month",
    "held_digests",
    "mark_failed",
    "mark_pulled",
    "payload_of",
    "replace_month",
]

_LINE_COLUMNS = ", ".join(LINE_SCHEMA)
# The central's table of each kind of hour: the cluster's own, with ``federated`` for ``closed``.
_FEDERATED_HOURS = {k: t.replace("closed_", "federated_") for k, (_, t) in KINDS.items()}


class MonthDigests:
    """The digest and total of each closed month listed, kept while it stays closed as it was.

    A month's digest covers its hours (``billing.closed_hours``), some megabytes to read and
    hash, and a central lists every closed month each round: a month closed at the same time
    (``closed_at``) is the same frozen content, so it is hashed once per process. Shared by the
    route's threads, hence the lock.
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[float, str, int]] = {}
        self._lock = threading.Lock()

    def get(self, month: str, closed_at: float) -> tuple[str, int] | None:
        """The digest and total kept of ``month`` closed at ``closed_at``, if any."""
        with self._lock:
            held = self._held.get(month)
        return None if held is None or held[0] != closed_at else (held[1], held[2])

    def keep(self, month: str, closed_at: float, digest: str, total_cents: int) -> None:
        """Keep ``month``'s digest and total, as closed at ``closed_at``."""
        with self._lock:
            self._held[month] = (closed_at, digest, total_cents)


def closed_months(
    ledger: Ledger, cluster: str, digests: MonthDigests | None = None
) -> list[dict[str, object]]:
    """Every closed month of this cluster's ledger with its digest and total, oldest first;
    ``digests`` keeps them between listings."""
    digests = MonthDigests() if digests is None else digests
    out: list[dict[str, object]] = []
    for m in closing.months(ledger):
        if not m["closed"]:
            continue
        month, closed_at = str(m["month"]), float(m["closed_at"])
        held = digests.get(month, closed_at)
        if held is None:
            p = payload_of(ledger, cluster, month)
            held = (p.digest, p.total_cents)
            digests.keep(month, closed_at, *held)
        out.append(
            {"month": month, "digest": held[0], "total_cents": held[1], "closed_at": closed_at}
        )
    return out


def payload_of(
    ledger: Ledger, cluster: str, month: str, prices: dict[str, Any] | None = None
) -> MonthPayload:
    """A closed month of this cluster's ledger as the federation route serves it, with the
    cluster's price book ``prices``.

    A month with more hours of a kind than a central takes (``federation.MAX_HOUR_ROWS``) is
    served without its hours, as a cluster of an earlier version would serve it: its lines
    still reach the central, rather than the whole month being refused at every pull.
    """
    basis, pools = closing.issued_basis(ledger, month)
    lines = closing.issued_lines(ledger, month=month)
    frames = closing.issued_hours(ledger, month, [t for _, t in KINDS.values()])
    hours = None if frames is None else dict(zip(KINDS, frames, strict=True))
    if hours is not None and any(f.height > federation.MAX_HOUR_ROWS for f in hours.values()):
        sizes = ", ".join(f"{k} {f.height}" for k, f in hours.items())
        log.warning(
            "billing: federation: month %s is served without its hours (%s rows; a central "
            "takes at most %d of a kind)",
            month,
            sizes,
            federation.MAX_HOUR_ROWS,
        )
        hours = None
    return month_payload(cluster, month, basis, pools, lines, prices, hours)


def held_digests(ledger: Ledger, cluster: str) -> dict[str, str]:
    """The digest of each month the central holds of ``cluster``."""
    with ledger.reader() as cur:
        rows = cur.execute(
            "SELECT month, digest FROM federated_months WHERE cluster = ?", [cluster]
        ).fetchall()
    return {str(m): str(d) for m, d in rows}


def replace_month(ledger: Ledger, payload: MonthPayload, now: float) -> None:
    """Keep ``payload`` as the central's copy of its (cluster, month), replacing the old one."""
    lines = pl.DataFrame(payload.lines, schema=LINE_SCHEMA).with_columns(
        pl.lit(payload.cluster).alias("cluster"), pl.lit(payload.digest).alias("digest")
    )
    key = [payload.cluster, payload.month]
    with ledger.writing() as cur:
        cur.execute("DELETE FROM federated_lines WHERE cluster = ? AND month = ?", key)
        cur.execute("DELETE FROM federated_months WHERE cluster = ? AND month = ?", key)
        cur.register("_federated", lines.to_arrow())
        cur.execute(
            f"INSERT INTO federated_lines (cluster, {_LINE_COLUMNS}, digest) "
            f"SELECT cluster, {_LINE_COLUMNS}, digest FROM _federated"
        )
        cur.unregister("_federated")
        for kind, table in _FEDERATED_HOURS.items():
            cur.execute(f"DELETE FROM {table} WHERE cluster = ? AND month = ?", key)
            rows = (payload.hours or {}).get(kind)
            if rows:
                schema = dict(KINDS[kind][0])
                frame = pl.DataFrame(rows, schema=schema).with_columns(
                    pl.lit(payload.cluster).alias("cluster")
                )
                cur.register("_federated_hours", frame.to_arrow())
                cur.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _federated_hours")
                cur.unregister("_federated_hours")
        cur.execute(
            "INSERT INTO federated_months (cluster, month, digest, basis, pools, total_cents, "
            "pulled_at, prices, hourly) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                *key,
                payload.digest,
                payload.basis,
                orjson.dumps(payload.pools).decode(),
                payload.total_cents,
                now,
                None if payload.prices is None else orjson.dumps(payload.prices).decode(),
                payload.hours is not None,
            ],
        )


def mark_pulled(ledger: Ledger, cluster: str, now: float) -> None:
    """``cluster`` was pulled whole at ``now``: it is no longer stale."""
    with ledger.writing() as cur:
        cur.execute(
            "INSERT OR REPLACE INTO federated_clusters VALUES (?, ?, NULL, NULL)", [cluster, now]
        )


def mark_failed(ledger: Ledger, cluster: str, now: float, error: str) -> None:
    """A pull of ``cluster`` failed at ``now``: stale since its first failure after a success."""
    with ledger.writing() as cur:
        cur.execute(
            "INSERT INTO federated_clusters VALUES (?, NULL, ?, ?) ON CONFLICT (cluster) DO UPDATE "
            "SET failing_since = coalesce(federated_clusters.failing_since, excluded.failing_since), "
            "error = excluded.error",
            [cluster, now, error[:500]],
        )


def federated_month(
    ledger: Ledger, month: str, clusters: Sequence[str], started_at: float
) -> tuple[pl.DataFrame, list[ClusterState]]:
    """The lines of ``month`` held of the configured ``clusters``, and each cluster's state.

    A cluster never pulled nor failed yet is stale since ``started_at`` (the central's start).
    """
    with ledger.reader() as cur:
        lines = pl.DataFrame(
            cur.execute(
                f"SELECT cluster, {_LINE_COLUMNS} FROM federated_lines WHERE month = ?", [month]
            ).fetchall(),
            schema=FEDERATED_SCHEMA,
            orient="row",
        )
        held = {
            r[0]: r[1:]
            for r in cur.execute(
                "SELECT cluster, total_cents, basis, pools, prices, hourly FROM federated_months "
                "WHERE month = ?",
                [month],
            ).fetchall()
        }
        status = {
            r[0]: r[1:]
            for r in cur.execute(
                "SELECT cluster, pulled_at, failing_since, error FROM federated_clusters"
            ).fetchall()
        }
    states = []
    for name in clusters:
        pulled_at, failing_since, error = status.get(name, (None, started_at, None))
        total, basis, pools, prices, hourly = held.get(name, (None, None, None, None, False))
        states.append(
            ClusterState(
                name,
                pulled_at,
                failing_since,
                error,
                total,
                basis,
                orjson.loads(pools) if pools else None,
                orjson.loads(prices) if prices else None,
                bool(hourly),
            )
        )
    return lines.filter(pl.col("cluster").is_in(list(clusters))), states


def federated_hours(ledger: Ledger, month: str, clusters: Sequence[str]) -> dict[str, pl.DataFrame]:
    """Each kind of hour of ``month`` held of ``clusters``, with its cluster."""
    out = {}
    with ledger.reader() as cur:
        for kind, table in _FEDERATED_HOURS.items():
            columns = ", ".join(f'"{c}"' for c in KINDS[kind][0])
            out[kind] = pl.DataFrame(
                cur.execute(
                    f"SELECT cluster, {columns} FROM {table} "
                    "WHERE month = ? AND list_contains(?, cluster)",
                    [month, list(clusters)],
                ).fetchall(),
                schema={"cluster": pl.String, **KINDS[kind][0]},
                orient="row",
            )
    return out
