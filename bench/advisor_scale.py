"""The efficiency advisor on a month of N usage records: how long ``infermeter advise`` takes.

The ledger is ``bench.billing_scale``'s month (20 teams, 16 replicas of 4 H100s, request times
spread over the month, GPUs sampled every 10 s), plus what the advisor reads beyond it: an
engine sample per replica every 10 s, and a prompt-head digest on every usage record (a third
of the requests share one of 40 system prompts, the rest are distinct). The measurement is
``billing.efficiency.store.read_report`` for the month, as the API and the command run it:
every figure (groups, instances, teams per hour) and every recommendation.

    .venv/bin/python -m bench.advisor_scale --records 3000000
    .venv/bin/python -m bench.advisor_scale --records 3000000 --dir var/advisor-bench --reuse
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from bench.billing_scale import (
    MONTH,
    REPLICAS,
    SECONDS,
    START,
    TEAMS,
    bench_config,
    generate,
    timed,
)
from billing.efficiency.store import read_report
from billing.ledger import Ledger


def add_advisor_inputs(ledger: Ledger) -> None:
    """Engine samples every 10 s per replica, and a prompt-head digest on every usage record."""
    con = ledger._con  # the benchmark is the one writer here
    replicas = "[" + ", ".join(f"'{r}'" for r in REPLICAS) + "]"
    con.execute(f"""
        INSERT INTO engine_samples (sample_id, replica, model, "timestamp", requests_running,
            requests_waiting, kv_cache_usage, prompt_tokens_total, generation_tokens_total,
            prefix_cache_queries_total, prefix_cache_hits_total, preemptions_total, ingested_at)
        SELECT 'eng-' || r || '-' || k, {replicas}[r + 1], ['chat-large', 'chat-small'][1 + (r % 2)::INT],
            {START} + (k + 1) * 10.0, 4 + hash(r * 31 + k) % 40, 0, 0.4, k * 900.0, k * 300.0,
            k * 900.0, k * 100.0, k // 360, {START + SECONDS}
        FROM range(16) a(r), range({SECONDS // 10}) c(k)
    """)
    con.execute("""
        UPDATE usage SET prefix_share = 0.6, prefix_digest = CASE WHEN hash(request_id) % 3 = 0
            THEN 'shared-' || (hash(request_id) % 40) ELSE 'own-' || request_id END
    """)
    con.execute("CHECKPOINT")


def main() -> int:
    """Generate (or reuse) the month's ledger, then time the month's report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3_000_000)
    parser.add_argument("--memory-limit", default="4GB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: temp)")
    parser.add_argument("--reuse", action="store_true", help="keep the ledger already in --dir")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="infermeter-advisor-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    _, config = bench_config(work / "ledger.duckdb", args.memory_limit, 39601)
    try:
        ledger = Ledger.open(
            work / "ledger.duckdb",
            TEAMS,
            {"chat-small": 0.5, "chat-large": 1.5},
            memory_limit=args.memory_limit,
        )
        if not args.reuse:
            t = time.perf_counter()
            generate(ledger, args.records)
            add_advisor_inputs(ledger)
            print(
                f"generate   {args.records:,} records + engine samples: {time.perf_counter() - t:.1f} s"
            )

        def report() -> int:
            with ledger.reader() as cursor:
                return len(read_report(cursor, config, MONTH, START + SECONDS).recommendations)

        med, low, found = timed(report, args.repeat)
        with ledger.reader() as cur:
            row = cur.execute(
                "SELECT (SELECT count(*) FROM usage), (SELECT count(*) FROM engine_samples)"
            ).fetchone()
        usage, engine = row if row else (0, 0)
        print(
            f"advise {MONTH}: median {med:.2f} s (min {low:.2f}) over {usage:,} usage records and "
            f"{engine:,} engine samples; {found} recommendations"
        )
        ledger.close()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"peak RSS of this process: {rss:.0f} MB (DuckDB memory_limit {args.memory_limit})")
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
