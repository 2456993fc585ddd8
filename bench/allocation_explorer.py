"""The allocation explorer's query time (``GET /v1/allocation``) on a month of N usage records.

The month is ``bench.billing_scale``'s (20 teams, 16 replicas of 4 H100s on 4 nodes, 2 models,
engine counters that leave every instance-hour a small unattributed remainder), written straight
into a ledger file. The billing service then runs in its own process, as in production, and the
explorer page's request is timed over HTTP from a client, JSON decoding included:

``first``  the month's first request, which builds its cells (the statement, its split by
           instance, the hourly profiles), reported once;
``query``  every window (the whole month, its last 7 days, its last day) x grouping (one key,
           two keys, a filtered drill-down) x caller (the admin, a team key), ``--repeats``
           times each, p50 and p95 in milliseconds;
``watched`` the month by team once a second for ``--watch`` seconds, as a page left open asks:
           a month's cells are rebuilt in the background once they are a minute old, so this
           includes the rebuilds' load on the machine (p50, p95 and the slowest).

    .venv/bin/python -m bench.allocation_explorer --records 20000000
    .venv/bin/python -m bench.allocation_explorer --db month.duckdb --keep   # reuse a filled file
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from bench.billing_scale import START, TEAMS, bench_config, generate
from bench.dashboard_queries import wait_ready
from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config, hash_key
from infermeter.serving import free_port

ADMIN_KEY = "im-demo-admin"
TEAM_KEY = "bench-team-00"
MONTH_END = START + 31 * 86400
WINDOWS = {
    "month": (START, MONTH_END),
    "last 7 days": (MONTH_END - 7 * 86400, MONTH_END),
    "last day": (MONTH_END - 86400, MONTH_END),
}
GROUPINGS: dict[str, dict[str, str]] = {
    "by team": {"by": "team"},
    "by team, model": {"by": "team,model"},
    "by instance, node": {"by": "instance,node"},
    "drill-down: team-03 by instance": {"by": "instance", "team": "team-03"},
}


def config_for(path: Path, ttl: float) -> Config:
    """``bench.billing_scale``'s configuration, with a key for team-00 and the lifetime ``ttl``."""
    data, _ = bench_config(path, "4GB", free_port())
    data["teams"][0]["api_key_sha256"] = [hash_key(TEAM_KEY)]
    data["billing"]["statement_ttl_seconds"] = ttl
    # One client asking as fast as it can is not the abuse the read limit is for.
    data["billing"].update(read_rate_per_second=1000.0, read_burst=1000)
    data["dashboard"] = {"refresh_seconds": ttl}
    return Config.model_validate(data)


def _serve(path: str, port: int, ttl: float) -> None:
    config = config_for(Path(path), ttl)
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


def _ask(client: httpx.Client, key: str, params: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    response = client.get(
        "/v1/allocation", params=params, headers={"authorization": f"Bearer {key}"}
    )
    response.raise_for_status()
    response.json()
    return (time.perf_counter() - t0) * 1000


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def measure(
    path: Path, repeats: int, ttl: float, watch: float
) -> Iterator[tuple[str, str, str, float, float]]:
    """(window, grouping, caller, p50 ms, p95 ms) rows, the first request's first, as measured."""
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(str(path), port, ttl)
    )
    server.start()
    try:
        wait_ready(f"http://127.0.0.1:{port}/healthz", server, seconds=600)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            first = _ask(client, ADMIN_KEY, {"from": START, "to": MONTH_END, "by": "team"})
            yield ("month", "first request (builds the cells)", "admin", first, first)
            for window, (lo, hi) in WINDOWS.items():
                for grouping, params in GROUPINGS.items():
                    for who, key in (("admin", ADMIN_KEY), ("team", TEAM_KEY)):
                        asked = {"from": lo, "to": hi, **params}
                        if who == "team" and "team" in asked:
                            continue  # a team drills into itself only
                        times = [_ask(client, key, asked) for _ in range(repeats)]
                        yield (window, grouping, who, statistics.median(times), _p95(times))
            watched = []
            asked = {"from": START, "to": MONTH_END, "by": "team"}
            until = time.monotonic() + watch
            while time.monotonic() < until:
                t0 = time.monotonic()
                watched.append(_ask(client, ADMIN_KEY, asked))
                time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
            label = f"watched {watch:.0f} s, one a second (slowest {max(watched):,.0f} ms)"
            yield ("month", label, "admin", statistics.median(watched), _p95(watched))
    finally:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGINT)
        server.join(60)


def _records(path: Path) -> int:
    import duckdb

    with duckdb.connect(str(path), read_only=True) as con:
        row = con.execute("SELECT count(*) FROM usage").fetchone()
    return int(row[0]) if row else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000_000)
    parser.add_argument("--db", type=Path, help="ledger file to fill (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="use an existing --db as it is")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ttl", type=float, default=10.0, help="statement lifetime, seconds")
    parser.add_argument(
        "--watch", type=float, default=180.0, help="seconds of one request a second"
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="explorer-bench-"))
    path = args.db or work / "ledger.duckdb"
    if not (args.keep and path.exists()):
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        config = config_for(path, args.ttl)
        ledger = Ledger.open(path, [t.name for t in config.teams], {}, memory_limit="4GB")
        try:
            generate(ledger, args.records)
        finally:
            ledger.close()
        print(
            f"filled {path}: {args.records:,} records in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
        )
    records = _records(path)
    print(f"{records:,} usage records, {len(TEAMS)} teams, statement lifetime {args.ttl:g} s")
    print("| window | request | caller | p50 ms | p95 ms |")
    print("|---|---|---|---:|---:|")
    for window, grouping, who, p50, p95 in measure(path, args.repeats, args.ttl, args.watch):
        print(f"| {window} | {grouping} | {who} | {p50:,.0f} | {p95:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
