"""Instance lifetimes: when each engine instance of a dynamic fleet ran, from what it announced.

An instance's sidecar ships ``start``, a ``heartbeat`` every ``sidecar.heartbeat_seconds`` and
``stop`` once drained (``infermeter.records.InstanceEvent``), and every event repeats the
instance's ``started_at``. One lifetime is one (instance, started_at): a pod name that comes back
(a StatefulSet's ``vllm-0`` restarted) is a new lifetime. A lifetime runs from ``started_at`` to
its ``stop`` event, or to its last event when it never stopped: an instance that was killed, or
whose node vanished, is closed where it was last heard of, never left open. Its state:

``stopped``  it said ``stop``
``live``     it did not, and its last event is younger than ``LIVE_HEARTBEATS`` heartbeats
``lost``     it did not, and has been silent longer than that

The builders are pure (SQL and parameters); ``billing.ledger`` runs them.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from billing.schema import SLOT_SECONDS
from infermeter.config import Config

__all__ = [
    "COLUMNS",
    "DEFAULT_HEARTBEAT_SECONDS",
    "LIVE_HEARTBEATS",
    "State",
    "heartbeat_seconds",
    "lifetimes_sql",
    "live_counts_sql",
    "slot_windows_sql",
]

DEFAULT_HEARTBEAT_SECONDS: Final = 30.0
# Heartbeats an instance may miss (a slow shipper, a billing restart) and still count as live.
LIVE_HEARTBEATS: Final = 3
COLUMNS: Final = (
    "instance", "replica", "model", "node", "gpu_model", "gpu_count", "gpus", "namespace",
    "pod_uid", "engine_metrics_url", "started_at", "last_seen", "stopped_at", "state",
)  # fmt: skip

State = Literal["live", "stopped", "lost"]

# What an instance says of itself may change between events (a metrics URL learned late): the
# latest event's word is kept.
_LATEST = ("replica", "model", "node", "gpu_model", "gpu_count", "gpus", "namespace", "pod_uid",
           "engine_metrics_url")  # fmt: skip


def heartbeat_seconds(config: Config) -> float:
    """How often sidecars heartbeat (``sidecar.heartbeat_seconds``)."""
    return float(config.sidecar.heartbeat_seconds)


def live_counts_sql(
    now: float, heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS
) -> tuple[str, dict[str, Any]]:
    """Live instances per replica group and model (replica, model, instances)."""
    sql, params = lifetimes_sql(now, heartbeat_seconds, "live")
    return (
        f"SELECT replica, model, count(*) AS instances FROM ({sql}) GROUP BY ALL ORDER BY ALL",
        params,
    )


def lifetimes_sql(
    now: float,
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
    state: Literal["live", "all"] = "all",
    replica: str | None = None,
    limit: int | None = None,
) -> tuple[str, dict[str, Any]]:
    """Every lifetime (``COLUMNS``), or the live ones, optionally of one replica group.

    Ordered by group, instance and start; at most ``limit`` rows. For ``live`` only instances
    with an event in the last ``LIVE_HEARTBEATS`` heartbeats are aggregated, so the registry's
    usual question reads the recent end of the table, not every heartbeat ever kept.
    """
    live_seconds = LIVE_HEARTBEATS * heartbeat_seconds
    params: dict[str, Any] = {"since": float(now) - live_seconds}
    where = []
    if state == "live":
        where.append(
            '(instance, started_at) IN (SELECT instance, started_at FROM instance_events WHERE "timestamp" > $since)'
        )
    if replica is not None:
        where.append("replica = $replica")
        params["replica"] = replica
    latest = ", ".join(f'arg_max({c}, "timestamp") AS {c}' for c in _LATEST)
    sql = f"""
SELECT {", ".join(COLUMNS)} FROM (
    SELECT *, CASE WHEN stopped_at IS NOT NULL THEN 'stopped'
        WHEN last_seen > $since THEN 'live' ELSE 'lost' END AS state
    FROM (
        SELECT instance, started_at, {latest},
            max("timestamp") AS last_seen,
            min("timestamp") FILTER (WHERE event = 'stop') AS stopped_at
        FROM instance_events {"WHERE " + " AND ".join(where) if where else ""}
        GROUP BY instance, started_at
    )
)
{"WHERE state = 'live'" if state == "live" else ""}
ORDER BY replica, instance, started_at"""
    if limit is not None:
        sql += "\nLIMIT $limit"
        params["limit"] = int(limit)
    return sql, params


def slot_windows_sql(lo: int, hi: int) -> str:
    """The lifetimes as whole slots (instance, replica, first_slot, last_slot), for allocation.

    Every lifetime of an instance seen in slots ``lo``..``hi`` (any month's: an instance with a
    lifetime only elsewhere is still known, and its time here lies outside it). A lifetime ends
    at its stop event or its last event, whichever came first.
    """
    end = 'coalesce(min("timestamp") FILTER (WHERE event = \'stop\'), max("timestamp"))'
    return f"""(
SELECT instance, arg_max(replica, "timestamp") AS replica,
    CAST(floor(started_at / {SLOT_SECONDS}) AS BIGINT) AS first_slot,
    CAST(floor({end} / {SLOT_SECONDS}) AS BIGINT) AS last_slot
FROM instance_events
WHERE instance IN (SELECT DISTINCT instance FROM gpu_slots WHERE slot >= {int(lo)} AND slot < {int(hi)})
GROUP BY instance, started_at)"""
