"""The instance registry's cost with a month of heartbeats: aggregated from the events, or kept.

Before ``lifetimes`` was kept at ingest, every registry answer (``GET /v1/instances``), every
scrape of ``infermeter_billing_live_instances`` and every month's allocation windows aggregated
the raw ``instance_events``: 2,880 heartbeats a pod a day. This builds a ledger file of schema
version 6 (before the ``lifetimes`` table) holding a month of events for ``--pods`` pods (a
heartbeat every 30 s; a fifth of the pods restarted under their own name on day 10, as a
StatefulSet's would be), in time order as ingest appends them, and times:

- *before*: the queries the registry and the metric ran then (kept below, verbatim), on the raw
  events;
- the migration to the current schema (filling ``lifetimes`` from the events and samples);
- the first ingest of a round of heartbeats (one per pod), which prunes the heartbeats older
  than the retention, then a steady round;
- *after*: the same answers through ``billing.registry.lifetimes`` and ``billing.registry.live_instances``, on the
  ``lifetimes`` table;
- the fold that keeps each lifetime's latest sample (``billing.lifetimes.sample_fold_sql``) on a
  collector's batch (one scrape of 8 GPUs a pod), next to that batch's ``gpu_slots`` rollup:
  what it adds to the collector's ingest path.

Each query runs ``--repeat`` times; reported are the median and best milliseconds, the rows
answered, and the ledger's raw event rows and file size before and after.

    .venv/bin/python -m bench.lifetimes_registry                 # 100 pods, 30 days, ~4-7 min
    .venv/bin/python -m bench.lifetimes_registry --pods 20 --days 3 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import orjson
import polars as pl

from billing import ingest_sql, lifetimes, registry
from billing.ledger import Ledger
from billing.schema import MIGRATIONS, new_field_sql
from infermeter.records import KINDS

DAY = 86_400
HEARTBEAT = 30.0
# 2026-10-01 00:00:00 UTC
MONTH_START = 1790812800.0
TEAMS = ["search"]

# The queries as the registry and the live-instance metric ran them before migration 7
# (billing/lifetimes.py at that time), on the raw events.
_LATEST = (
    "replica",
    "model",
    "node",
    "gpu_model",
    "gpu_count",
    "gpus",
    "namespace",
    "pod_uid",
    "engine_metrics_url",
)
_COLUMNS = (
    "instance",
    "replica",
    "model",
    "node",
    "gpu_model",
    "gpu_count",
    "gpus",
    "namespace",
    "pod_uid",
    "engine_metrics_url",
    "started_at",
    "last_seen",
    "stopped_at",
    "state",
)


def before_sql(now: float, state: str, limit: int | None = None) -> tuple[str, dict[str, Any]]:
    """The registry's query before ``lifetimes`` was kept (state ``live`` or ``all``)."""
    params: dict[str, Any] = {"since": now - 3 * HEARTBEAT}
    where = (
        '(instance, started_at) IN (SELECT instance, started_at FROM instance_events WHERE "timestamp" > $since)'
        if state == "live"
        else ""
    )
    latest = ", ".join(f'arg_max({c}, "timestamp") AS {c}' for c in _LATEST)
    sql = f"""
SELECT {", ".join(_COLUMNS)} FROM (
    SELECT *, CASE WHEN stopped_at IS NOT NULL THEN 'stopped'
        WHEN last_seen > $since THEN 'live' ELSE 'lost' END AS state
    FROM (
        SELECT instance, started_at, {latest},
            max("timestamp") AS last_seen,
            min("timestamp") FILTER (WHERE event = 'stop') AS stopped_at
        FROM instance_events {"WHERE " + where if where else ""}
        GROUP BY instance, started_at
    )
)
{"WHERE state = 'live'" if state == "live" else ""}
ORDER BY replica, instance, started_at"""
    if limit is not None:
        sql += "\nLIMIT $limit"
        params["limit"] = limit
    return sql, params


def before_counts_sql(now: float) -> tuple[str, dict[str, Any]]:
    """The live-instance metric's query before ``lifetimes`` was kept."""
    sql, params = before_sql(now, "live")
    return f"SELECT replica, model, count(*) FROM ({sql}) GROUP BY ALL ORDER BY ALL", params


def restart_time(days: int) -> float:
    """When every fifth pod was stopped and came back under its own name."""
    return MONTH_START + min(10, days / 3) * DAY


def started(p: int, days: int) -> float:
    """When pod ``p``'s current lifetime started."""
    return restart_time(days) + 120.0 if p % 5 == 0 else MONTH_START + p * 7.0


def old_ledger(path: Path, pods: int, days: int) -> float:
    """Write a version-6 ledger with ``days`` of events for ``pods`` pods; returns its end."""
    end = MONTH_START + days * DAY
    restart = restart_time(days)
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER, applied_at DOUBLE)")
    for version, migration in enumerate(MIGRATIONS[:6], start=1):
        con.execute(migration)
        con.execute("INSERT INTO schema_version VALUES (?, 0)", [version])
    for kind in KINDS.values():
        columns = [
            r[0]
            for r in con.execute(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [kind.table]
            ).fetchall()
        ]
        for statement in new_field_sql(kind, columns):
            con.execute(statement)
    # Lifetimes: (pod, start, end, stopped). Every fifth pod stopped at ``restart`` and came back
    # two minutes later under its own name; the others ran all along.
    con.execute(
        """
CREATE TEMP TABLE lives AS
SELECT p, $m + p * 7.0 AS s, CASE WHEN p % 5 = 0 THEN $r ELSE $e END AS e, p % 5 = 0 AS stopped
FROM range($pods) t(p)
UNION ALL
SELECT p, $r + 120.0, $e, false FROM range($pods) t(p) WHERE p % 5 = 0""",
        {"m": MONTH_START, "r": restart, "e": end, "pods": pods},
    )
    con.execute(
        f"""
INSERT INTO instance_events
SELECT printf('%013d/pod-%03d/%s', CAST(round(t * 1000) AS BIGINT), p, kind), printf('pod-%03d', p),
    'g', 'chat-small', kind, t, s, printf('node-%02d', p // 8), 'L40S', 8,
    'GPU-' || p || '-0,GPU-' || p || '-1', 'llm', 'uid-' || p || '-' || CAST(s AS BIGINT),
    printf('http://10.0.%d.%d:19000/engine/metrics', p // 250, p % 250), t
FROM (
    SELECT p, s, s AS t, 'start' AS kind FROM lives
    UNION ALL
    SELECT p, s, s + k * {HEARTBEAT}, 'heartbeat' FROM lives,
        range(1, CAST(ceil((e - s) / {HEARTBEAT}) AS BIGINT)) r(k)
    UNION ALL
    SELECT p, s, e, 'stop' FROM lives WHERE stopped
)
ORDER BY t"""
    )
    con.close()
    return end


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, int]:
    """(median ms, best ms, rows) of ``repeat`` calls."""
    times, rows = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000)
        rows = len(out)
    return statistics.median(times), min(times), rows


def raw_rows(path: Path) -> int:
    con = duckdb.connect(str(path), read_only=True)
    try:
        row = con.execute("SELECT count(*) FROM instance_events").fetchone()
    finally:
        con.close()
    return int(row[0]) if row else 0


def heartbeats(pods: int, days: int, now: float) -> bytes:
    """One heartbeat from each pod's current lifetime at ``now``, as one batch."""
    records = [
        {
            "event_id": f"{round(now * 1000):013d}/pod-{p:03d}/heartbeat",
            "instance": f"pod-{p:03d}",
            "replica": "g",
            "model": "chat-small",
            "event": "heartbeat",
            "timestamp": now,
            "started_at": started(p, days),
            "node": f"node-{p // 8:02d}",
            "gpu_model": "L40S",
            "gpu_count": 8,
        }
        for p in range(pods)
    ]
    return orjson.dumps({"instances": records})


def gpu_batch(pods: int, now: float, tag: str) -> bytes:
    """One scrape of 8 GPUs per pod at ``now``."""
    records = [
        {
            "sample_id": f"{round(now * 1000):013d}/{tag}/{p}/{g}",
            "node": f"node-{p // 8:02d}",
            "gpu": str(g),
            "uuid": f"GPU-{p}-{g}",
            "gpu_model": "L40S",
            "replica": "g",
            "model": "chat-small",
            "timestamp": now,
            "interval_seconds": 10.0,
            "utilization": 0.5,
            "power_watts": 300.0,
            "energy_joules": 3000.0,
            "memory_used_mib": 1000.0,
            "memory_free_mib": 1000.0,
            "instance": f"pod-{p:03d}",
        }
        for p in range(pods)
        for g in range(8)
    ]
    return orjson.dumps({"gpu_samples": records})


def run(work: Path, pods: int, days: int, repeat: int) -> dict[str, Any]:
    path = work / "ledger.duckdb"
    t0 = time.perf_counter()
    end = old_ledger(path, pods, days)
    out: dict[str, Any] = {"pods": pods, "days": days, "generate_s": time.perf_counter() - t0}
    out["raw_rows_before"] = raw_rows(path)
    out["file_mb_before"] = path.stat().st_size / 2**20
    now = end + 10
    con = duckdb.connect(str(path))

    def query(sql: str, params: dict[str, Any]) -> Callable[[], list[Any]]:
        return lambda: con.execute(sql, params).fetchall()

    try:
        for name, (sql, params) in {
            "registry live": before_sql(now, "live"),
            "registry all (limit 1000)": before_sql(now, "all", 1000),
            "live counts (metric)": before_counts_sql(now),
        }.items():
            out[f"before: {name}"] = timed(query(sql, params), repeat)
    finally:
        con.close()

    t0 = time.perf_counter()
    ledger = Ledger.open(path, TEAMS, {})
    out["migration_s"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        ledger.ingest(heartbeats(pods, days, now), now=now)
        out["first ingest (prunes) ms"] = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        ledger.ingest(heartbeats(pods, days, now + HEARTBEAT), now=now + HEARTBEAT)
        out["next round ingest ms"] = (time.perf_counter() - t0) * 1000
        later = now + HEARTBEAT + 1
        for name, fn in {
            "registry live": lambda: registry.lifetimes(ledger, later, HEARTBEAT, "live"),
            "registry all (limit 1000)": lambda: registry.lifetimes(
                ledger, later, HEARTBEAT, "all", None, 1000
            ),
            "live counts (metric)": lambda: registry.live_instances(ledger, later, HEARTBEAT),
        }.items():
            out[f"after: {name}"] = timed(fn, repeat)
    finally:
        ledger.close()
    out["raw_rows_after"] = raw_rows(path)
    out["file_mb_after"] = path.stat().st_size / 2**20
    out.update(sample_fold_cost(path, pods, later, repeat))
    return out


def sample_fold_cost(path: Path, pods: int, now: float, repeat: int) -> dict[str, Any]:
    """The fold of a collector's batch into ``lifetimes``, next to its ``gpu_slots`` rollup.

    Both statements run in an ingest-like transaction over one scrape of every pod's 8 GPUs
    (as ``fresh``), which is then rolled back; median and best milliseconds of ``repeat``.
    """
    con = duckdb.connect(str(path))
    times: dict[str, list[float]] = {"fold into lifetimes": [], "gpu_slots rollup": []}
    statements = {
        "fold into lifetimes": lifetimes.sample_fold_sql("gpu_samples"),
        "gpu_slots rollup": ingest_sql.gpu_rollup_sql(),
    }
    try:
        for k in range(repeat):
            frame = pl.DataFrame(orjson.loads(gpu_batch(pods, now + k, "fold"))["gpu_samples"])
            frame = frame.with_columns(gap=pl.lit(False), xid_errors=pl.lit(0))
            con.execute("BEGIN TRANSACTION")
            con.register("_batch", frame)
            con.execute("CREATE OR REPLACE TEMP VIEW fresh AS SELECT * FROM _batch")
            for name, sql in statements.items():
                t0 = time.perf_counter()
                con.execute(sql)
                times[name].append((time.perf_counter() - t0) * 1000)
            con.execute("ROLLBACK")
            con.unregister("_batch")
    finally:
        con.close()
    return {
        f"{name}, batch of {pods * 8} GPU samples": (statistics.median(t), min(t))
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(work, args.pods, args.days, args.repeat)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        if isinstance(value, tuple) and len(value) == 3:
            print(f"{key:<48} median {value[0]:9.2f} ms  best {value[1]:9.2f} ms  rows {value[2]}")
        elif isinstance(value, tuple):
            print(f"{key:<48} median {value[0]:9.2f} ms  best {value[1]:9.2f} ms")
        elif isinstance(value, float):
            print(f"{key:<48} {value:,.2f}")
        else:
            print(f"{key:<48} {value:,}")


if __name__ == "__main__":
    main()
