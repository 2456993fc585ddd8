"""How long the dashboards' queries take on the rollups of a 100M-request month.

The dashboards read only rollups, so their cost follows the rollups' size, not the request
count. This fills a fresh ledger file's rollup tables directly with SQL at the size one month of
100M requests produces (defaults: 16 replicas of 4 models, 20 teams, 43,200 minutes):

- ``usage_slots``: replicas x teams x minutes rows (13.8M), ~7 requests each;
- ``ttft_buckets``: models x teams x minutes x ``--buckets`` rows (12 distinct TTFT buckets a
  minute for ~29 requests per model and team: 41.5M rows);
- ``gpu_slots``: 64 GPUs, 4 per replica on 8 nodes: replicas x minutes rows (0.7M);
- ``engine_samples``: one sample per replica every 10 s (4.1M rows).

Rows go in day by day in time order, as ingest writes them, so DuckDB's per-row-group min/max
lets a short range skip the rest of the month. Each query of ``billing.queries`` then runs
``--repeats`` times for each range of the dashboard's time-range picker (the newest 1 h, 24 h,
7 d, and the whole month), through a reader cursor as the query API runs it, including turning
the rows into the JSON the API answers with. Reported: rows returned, p50 and p95 milliseconds.
``--pages`` also times each page's sequence of queries (what one refresh of the page asks).

    .venv/bin/python -m bench.dashboard_queries                    # full month, ~3-6 min
    .venv/bin/python -m bench.dashboard_queries --days 3 --repeats 5
    .venv/bin/python -m bench.dashboard_queries --db ledger.duckdb --keep --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from billing import queries
from billing.ledger import Ledger
from billing.query_api import Rollups

REPLICAS = 16
MODELS = 4
TEAMS = 20
GPUS_PER_REPLICA = 4
MINUTES_PER_DAY = 1440
# The month ends at a whole day; the ranges are the newest part of it, as "now" would be.
END_SLOT = 29_500_000
PAGES = {
    "fleet (admin)": ("ttft", "throughput", "team_usage", "engine", "gpus", "replicas"),
    "sla": ("sla", "worst_hours"),
}


def fill(ledger: Ledger, days: int, buckets: int) -> dict[str, int]:
    """Fill the rollups for ``days`` days ending at END_SLOT; returns rows per table."""
    start = END_SLOT - days * MINUTES_PER_DAY
    with ledger.reader() as cur:
        for day in range(days):
            lo, hi = start + day * MINUTES_PER_DAY, start + (day + 1) * MINUTES_PER_DAY
            cur.execute("BEGIN TRANSACTION")
            cur.execute(_USAGE, {"lo": lo, "hi": hi, "replicas": REPLICAS, "teams": TEAMS,
                                 "models": MODELS})  # fmt: skip
            cur.execute(_TTFT, {"lo": lo, "hi": hi, "models": MODELS, "teams": TEAMS,
                                "buckets": buckets})  # fmt: skip
            cur.execute(_GPU, {"lo": lo, "hi": hi, "replicas": REPLICAS, "gpus": GPUS_PER_REPLICA})
            cur.execute(_ENGINE, {"lo": lo * 60, "hi": hi * 60, "replicas": REPLICAS,
                                  "models": MODELS})  # fmt: skip
            cur.execute("COMMIT")
        cur.execute("CHECKPOINT")
        counts = {}
        for table in ("usage_slots", "ttft_buckets", "gpu_slots", "engine_samples"):
            row = cur.execute(f"SELECT count(*) FROM {table}").fetchone()
            counts[table] = int(row[0]) if row else 0
    return counts


_USAGE = """
INSERT INTO usage_slots
SELECT 'replica-' || r, 'team-' || t, 'model-' || (r % $models), s,
    30.0 + (hash(r, t, s) % 30), n, CASE WHEN hash(s, t) % 97 = 0 THEN 1 ELSE 0 END,
    n * 900, n * 200, n * 250, n * 0.35, n, n - CASE WHEN hash(r, s) % 11 = 0 THEN 1 ELSE 0 END, n * 8.0
FROM (SELECT s, r, t, 1 + CAST(hash(r, t, s) % 13 AS BIGINT) AS n
      FROM range($lo, $hi) a(s), range($replicas) b(r), range($teams) c(t))
ORDER BY s
"""
_TTFT = """
INSERT INTO ttft_buckets
SELECT 'model-' || m, 'team-' || t, s, CAST(170 + b * 2 + (hash(m, t, s) % 3) AS SMALLINT),
    1 + CAST(hash(m, t, s, b) % 4 AS BIGINT)
FROM range($lo, $hi) a(s), range($models) x(m), range($teams) c(t), range($buckets) d(b)
ORDER BY s
"""
_GPU = """
INSERT INTO gpu_slots
SELECT 'node-' || (r // 2), 'H100', 'replica-' || r, s, 60.0 * $gpus, 60.0 * $gpus * 450,
    0.0, 60.0 * $gpus * (0.3 + (hash(r, s) % 60) / 100.0), 60.0 * $gpus * 450, 6 * $gpus, 0
FROM range($lo, $hi) a(s), range($replicas) b(r)
ORDER BY s
"""
_ENGINE = """
INSERT INTO engine_samples
SELECT 'e-' || r || '-' || ts, 'replica-' || r, 'model-' || (r % $models), ts::DOUBLE,
    20 + hash(r, ts) % 40, hash(ts, r) % 12, (hash(r, ts) % 100) / 100.0, 0, 0, 0, 0, 0, ts
FROM range($lo, $hi, 10) a(ts), range($replicas) b(r)
ORDER BY ts
"""


def time_query(
    ledger: Ledger, name: str, params: queries.QueryParams, repeats: int
) -> tuple[int, list[float]]:
    """Rows returned and wall milliseconds of each run (query, rows, JSON as the API does)."""
    times, rows = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        with ledger.reader() as cur:
            frame = queries.run(cur, name, params)
        orjson.dumps({"columns": frame.columns, "rows": frame.rows()})
        times.append((time.perf_counter() - t0) * 1000)
        rows = frame.height
    return rows, times


def _p(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, help="ledger file to create (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep an existing --db as it is")
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument(
        "--buckets", type=int, default=12, help="TTFT buckets per model, team, minute"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: all)")
    parser.add_argument(
        "--pages", action="store_true", help="also time each page's queries together"
    )
    parser.add_argument(
        "--minutes-only", action="store_true", help="no coarse copies (for comparison)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.db or Path(tmp) / "bench.duckdb"
        fresh = not (args.keep and path.exists())
        if fresh and path.exists():
            path.unlink()
        ledger = Ledger.open(path, [f"team-{t}" for t in range(TEAMS)], {}, memory_limit="4GB",
                             threads=args.threads)  # fmt: skip
        try:
            t0 = time.perf_counter()
            counts = fill(ledger, args.days, args.buckets) if fresh else {}
            fill_s = time.perf_counter() - t0
            rollups = Rollups(ledger, settle_seconds=0)
            t0 = time.perf_counter()
            if not args.minutes_only:
                rollups.refresh(END_SLOT * 60)
            build_s = time.perf_counter() - t0
            results = _run_all(ledger, args, rollups.coverage())
        finally:
            ledger.close()
    report = {"rows": counts, "fill_seconds": round(fill_s, 1),
              "rollup_build_seconds": round(build_s, 1), "results": results}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"rollup rows: {counts} (filled in {fill_s:.0f} s)")
        print(f"coarse copies (5 min, 1 h) built in {build_s:.1f} s")
        print(f"{'query':<22}{'range':>7}{'step':>7}{'rows':>8}{'p50 ms':>9}{'p95 ms':>9}")
        for r in results:
            print(
                f"{r['query']:<22}{r['range']:>7}{r['step']:>7}{r['rows']:>8}{r['p50_ms']:>9.1f}{r['p95_ms']:>9.1f}"
            )
    return 0


def _run_all(ledger: Ledger, args: argparse.Namespace,
             coverage: dict[tuple[str, int], tuple[int, int]]) -> list[dict[str, Any]]:  # fmt: skip
    end = END_SLOT * 60
    ranges = {"1h": 3600, "24h": 86400, "7d": 7 * 86400, "30d": args.days * 86400}
    results = []
    for label, span in ranges.items():
        if span > args.days * 86400:
            continue
        params = queries.params_from(end - span, end, coverage=coverage)
        for name in queries.QUERIES:
            rows, times = time_query(ledger, name, params, args.repeats)
            results.append({"query": name, "range": label, "step": params.step, "rows": rows,
                            "p50_ms": statistics.median(times), "p95_ms": _p(times, 0.95)})  # fmt: skip
        if args.pages:
            for page, names in PAGES.items():
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    for name in names:
                        time_query(ledger, name, params, 1)
                    times.append((time.perf_counter() - t0) * 1000)
                results.append({"query": f"page: {page}", "range": label, "step": params.step, "rows": 0,
                                "p50_ms": statistics.median(times), "p95_ms": _p(times, 0.95)})  # fmt: skip
    return results


if __name__ == "__main__":
    raise SystemExit(main())
