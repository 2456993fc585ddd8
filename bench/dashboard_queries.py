"""How long the dashboards' queries take on the rollups of a 100M-request month.

The dashboards read only rollups, so their cost follows the rollups' size, not the request
count. This fills a fresh ledger file's rollup tables directly with SQL at the size one month of
100M requests produces (defaults: 16 replicas of 4 models, 20 teams, 43,200 minutes):

- ``usage_slots``: replicas x teams x minutes rows (13.8M), ~7 requests each, and
  ``replica_slots`` (each replica's in-flight seconds per minute) from them;
- ``ttft_buckets``: models x teams x minutes x ``--buckets`` rows (12 distinct TTFT buckets a
  minute for ~29 requests per model and team: 41.5M rows);
- ``gpu_slots``: 64 GPUs, 4 per replica on 8 nodes: replicas x minutes rows (0.7M);
- ``engine_samples``: one sample per replica every 10 s (4.1M rows).

Rows go in day by day in time order, as ingest writes them, so DuckDB's per-row-group min/max
lets a short range skip the rest of the month. Each query of ``billing.queries`` then runs
``--repeats`` times for each range of the dashboard's time-range picker (the newest 1 h, 24 h,
7 d, and the whole month), through a reader cursor as the query API runs it, including turning
the rows into the JSON the API answers with. Reported: rows returned, p50 and p95 milliseconds.
``--pages`` also times each page's data fetch as its callback makes it: the page's queries sent
at once over HTTP to the billing API (served on loopback by uvicorn), answers turned into frames.
``--statement`` times the month's statement, which the teams and chargeback pages ask for.

    .venv/bin/python -m bench.dashboard_queries                    # full month, ~3-6 min
    .venv/bin/python -m bench.dashboard_queries --days 3 --repeats 5
    .venv/bin/python -m bench.dashboard_queries --db ledger.duckdb --keep --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn

from billing import queries
from billing.api import create_app
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.rollups import Rollups
from dashboards.client import BillingClient
from dashboards.data import fetch_queries
from infermeter.config import Config, hash_key
from infermeter.months import month_of
from infermeter.serving import free_port

REPLICAS = 16
MODELS = 4
TEAMS = 20
GPUS_PER_REPLICA = 4
MINUTES_PER_DAY = 1440
# The month ends at a whole day; the ranges are the newest part of it, as "now" would be.
ADMIN_KEY = "bench-admin"
TEAM_KEY = "bench-team-0"
# The key and queries each page's callback sends at once (dashboards/pages).
PAGES = {
    "fleet (admin)": (
        ADMIN_KEY,
        ("ttft", "throughput", "team_usage", "engine", "gpus", "replicas"),
    ),
    "fleet (team)": (TEAM_KEY, ("ttft", "throughput", "team_usage")),
    "sla (admin)": (ADMIN_KEY, ("sla", "worst_hours")),
    "sla (team)": (TEAM_KEY, ("sla", "worst_hours")),
}


def fill(ledger: Ledger, days: int, buckets: int, end_slot: int) -> dict[str, int]:
    """Fill the rollups for ``days`` days ending at ``end_slot``; returns rows per table."""
    start = end_slot - days * MINUTES_PER_DAY
    with ledger.reader() as cur:
        for day in range(days):
            lo, hi = start + day * MINUTES_PER_DAY, start + (day + 1) * MINUTES_PER_DAY
            cur.execute("BEGIN TRANSACTION")
            cur.execute(
                _USAGE, {"lo": lo, "hi": hi, "replicas": REPLICAS, "teams": TEAMS, "models": MODELS}
            )
            # Each replica's in-flight seconds per minute, as ingest keeps them for allocation.
            cur.execute(
                "INSERT INTO replica_slots SELECT replica, instance, slot, sum(inflight_seconds) "
                "FROM usage_slots WHERE slot >= $lo AND slot < $hi GROUP BY ALL ORDER BY slot",
                {"lo": lo, "hi": hi},
            )
            cur.execute(
                _TTFT, {"lo": lo, "hi": hi, "models": MODELS, "teams": TEAMS, "buckets": buckets}
            )
            cur.execute(_GPU, {"lo": lo, "hi": hi, "replicas": REPLICAS, "gpus": GPUS_PER_REPLICA})
            cur.execute(
                _ENGINE, {"lo": lo * 60, "hi": hi * 60, "replicas": REPLICAS, "models": MODELS}
            )
            cur.execute("COMMIT")
        cur.execute("CHECKPOINT")
        counts = {}
        for table in (
            "usage_slots",
            "replica_slots",
            "ttft_buckets",
            "gpu_slots",
            "engine_samples",
        ):
            row = cur.execute(f"SELECT count(*) FROM {table}").fetchone()
            counts[table] = int(row[0]) if row else 0
    return counts


_USAGE = """
INSERT INTO usage_slots
SELECT 'replica-' || r, 'replica-' || r, 'team-' || t, 'model-' || (r % $models), s,
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
SELECT 'node-' || (r // 2), 'H100', 'replica-' || r, 'replica-' || r, s, 60.0 * $gpus, 60.0 * $gpus * 450,
    0.0, 60.0 * $gpus * (0.3 + (hash(r, s) % 60) / 100.0), 60.0 * $gpus * 450, 6 * $gpus, 0
FROM range($lo, $hi) a(s), range($replicas) b(r)
ORDER BY s
"""
_ENGINE = """
INSERT INTO engine_samples
SELECT 'e-' || r || '-' || ts, 'replica-' || r, 'model-' || (r % $models), ts::DOUBLE,
    20 + hash(r, ts) % 40, hash(ts, r) % 12, (hash(r, ts) % 100) / 100.0, 0, 0, 0, 0, 0, ts, NULL
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
    parser.add_argument(
        "--statement", action="store_true", help="also time the month's statement (chargeback)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.db or Path(tmp) / "bench.duckdb"
        fresh = not (args.keep and path.exists())
        if fresh and path.exists():
            path.unlink()
        ledger = Ledger.open(
            path, [f"team-{t}" for t in range(TEAMS)], {}, memory_limit="4GB", threads=args.threads
        )
        try:
            t0 = time.perf_counter()
            # The data ends at today's midnight (UTC), so the service's clock sees it as recent.
            args.end_slot = int(time.time() // 86400) * MINUTES_PER_DAY
            if fresh:
                counts = fill(ledger, args.days, args.buckets, args.end_slot)
            else:
                counts = {}
                with ledger.reader() as cur:
                    row = cur.execute("SELECT max(slot) + 1 FROM usage_slots").fetchone()
                args.end_slot = int(row[0]) if row and row[0] is not None else args.end_slot
            fill_s = time.perf_counter() - t0
            rollups = Rollups(ledger, settle_seconds=0)
            t0 = time.perf_counter()
            if not args.minutes_only:
                rollups.refresh(time.time())
            build_s = time.perf_counter() - t0
            results = _run_all(ledger, args, rollups.coverage())
            if args.statement:
                results.append(_time_statement(ledger, args.end_slot, max(1, args.repeats // 5)))
        finally:
            ledger.close()
        if args.pages:
            results += _time_pages(path, args)
    report = {
        "rows": counts,
        "fill_seconds": round(fill_s, 1),
        "rollup_build_seconds": round(build_s, 1),
        "results": results,
    }
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


def _run_all(
    ledger: Ledger, args: argparse.Namespace, coverage: dict[tuple[str, int], tuple[int, int]]
) -> list[dict[str, Any]]:
    end = args.end_slot * 60
    results = []
    for label, span in _ranges(args).items():
        params = queries.params_from(end - span, end, coverage=coverage)
        for name in queries.QUERIES:
            rows, times = time_query(ledger, name, params, args.repeats)
            results.append(
                {
                    "query": name,
                    "range": label,
                    "step": params.step,
                    "rows": rows,
                    "p50_ms": statistics.median(times),
                    "p95_ms": _p(times, 0.95),
                }
            )
    return results


def _serve(path: str, port: int) -> None:
    """The billing service over the bench ledger, in its own process as in production."""
    config = bench_config()
    ledger = Ledger.open(path, [t.name for t in config.teams], {}, memory_limit="4GB")
    try:
        uvicorn.run(
            create_app(config, ledger),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
    finally:
        ledger.close()


def _time_pages(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each page's data fetch as its callback makes it: concurrent HTTP calls to billing."""
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(str(path), port))
    server.start()
    client = BillingClient(f"http://127.0.0.1:{port}")
    end = args.end_slot * 60
    results = []
    try:
        wait_ready(f"http://127.0.0.1:{port}/healthz", server)
        for label, span in _ranges(args).items():
            for page, (key, names) in PAGES.items():
                fetch_queries(client, key, names, end - span, end)  # warm the connections
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    fetch_queries(client, key, names, end - span, end)
                    times.append((time.perf_counter() - t0) * 1000)
                results.append(
                    {
                        "query": f"page: {page}",
                        "range": label,
                        "step": 0,
                        "rows": 0,
                        "p50_ms": statistics.median(times),
                        "p95_ms": _p(times, 0.95),
                    }
                )
        results += _time_statement_pages(client, args.repeats)
    finally:
        client.close()
        if server.pid is not None:
            os.kill(server.pid, signal.SIGINT)
        server.join(60)
    return results


def _time_statement_pages(client: BillingClient, repeats: int) -> list[dict[str, Any]]:
    """The summary row and teams page (spend and statement at once), and the chargeback page.

    Both read billing's statement cache (``/v1/spend``, the statement query and the CSV), which
    lives no longer than one dashboard refresh; the first load, which computes the month's
    statement, is reported on its own line.
    """
    month = month_of(time.time())
    results = []
    for key, who in ((ADMIN_KEY, "admin"), (TEAM_KEY, "team")):
        pages = {
            "teams": (lambda k=key: client.spend(k), lambda k=key: client.statement(k, month)),
            "chargeback": (
                lambda k=key: client.statement(k, month),
                lambda k=key: client.export(k, month, "csv"),
            ),
        }
        for page, calls in pages.items():
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(len(calls)) as pool:
                    for future in [pool.submit(call) for call in calls]:
                        future.result()
                times.append((time.perf_counter() - t0) * 1000)
            if page == "teams" and who == "admin":
                results.append(
                    {
                        "query": "statement, first request",
                        "range": month,
                        "step": 0,
                        "rows": 0,
                        "p50_ms": times[0],
                        "p95_ms": times[0],
                    }
                )
            results.append(
                {
                    "query": f"page: {page} ({who})",
                    "range": month,
                    "step": 0,
                    "rows": 0,
                    "p50_ms": statistics.median(times[1:]),
                    "p95_ms": _p(times[1:], 0.95),
                }
            )
    return results


def wait_ready(url: str, server: multiprocessing.process.BaseProcess, seconds: float = 300) -> None:
    """Until ``url`` answers; the service builds its coarse copies before it listens (a month of
    millions of records takes minutes)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not server.is_alive():
            raise RuntimeError("the billing service exited")
        try:
            httpx.get(url, timeout=1).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"the billing service did not start in {seconds:g} s")


def _ranges(args: argparse.Namespace) -> dict[str, int]:
    ranges = {"1h": 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
    return {label: span for label, span in ranges.items() if span <= args.days * 86400}


def bench_config() -> Config:
    """A configuration naming the bench fleet's teams, models and replicas, priced."""
    return Config.model_validate(
        {
            "teams": [
                {"name": f"team-{t}", "api_key_sha256": [hash_key(f"bench-team-{t}")]}
                for t in range(TEAMS)
            ],
            "models": [
                {"name": f"model-{m}", "approved_versions": [f"model-{m}"]} for m in range(MODELS)
            ],
            "replicas": [
                {
                    "id": f"replica-{r}",
                    "model": f"model-{r % MODELS}",
                    "node": f"node-{r // 2}",
                    "upstream_url": f"http://127.0.0.1:{20000 + r}",
                    "gpu_model": "H100",
                    "gpu_count": GPUS_PER_REPLICA,
                }
                for r in range(REPLICAS)
            ],
            "prices": {"usd_per_gpu_hour": {"H100": 3.9}, "usd_per_kwh": 0.14, "pue": 1.3},
            "admin_token_sha256": [hash_key(ADMIN_KEY)],
        }
    )


def _time_statement(ledger: Ledger, end_slot: int, repeats: int) -> dict[str, Any]:
    """The month's statement as the teams and chargeback pages ask billing for it."""
    chargeback = Chargeback(ledger, bench_config())
    month = month_of(end_slot * 60 - 1)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        chargeback.statement(month)
        times.append((time.perf_counter() - t0) * 1000)
    return {
        "query": "statement (chargeback)",
        "range": month,
        "step": 0,
        "rows": 0,
        "p50_ms": statistics.median(times),
        "p95_ms": _p(times, 0.95),
    }


if __name__ == "__main__":
    raise SystemExit(main())
