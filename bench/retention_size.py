"""The ledger's bytes per usage record before and after retention, on a generated month.

A month of N usage records with its GPU and engine samples (``bench.billing_scale.generate``),
the month closed as finance closes it, then retention run as of 40 days after the month's end
(``billing.archive.retain``, raw_days 35). Printed per stage: the ledger file's size, the bytes
its used blocks hold (``PRAGMA database_size``: DuckDB reuses freed blocks but does not shrink
the file), both per usage record of the month, and the archive's bytes. The last stage rewrites
the file through a backup and a restore (``billing.backup``), which is what gives the space back.

    .venv/bin/python -m bench.retention_size --records 2000000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.billing_scale import MONTH, SECONDS, START, bench_config, generate
from billing import archive, backup
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.serve import open_ledger
from infermeter.config import Config


def _used_bytes(ledger: Ledger) -> int:
    with ledger.reader() as cur:
        row = cur.execute("SELECT block_size * used_blocks FROM pragma_database_size()").fetchone()
    return int(row[0]) if row else 0


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _row(stage: str, path: Path, used: int, records: int, archived: int) -> None:
    size = path.stat().st_size
    print(
        f"| {stage} | {size / 2**20:,.0f} MiB | {size / records:,.1f} | "
        f"{used / records:,.1f} | {archived / 2**20:,.0f} MiB |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--memory-limit", default="2GB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="retention-") as tmp:
        work = Path(tmp)
        _, config = bench_config(work / "ledger.duckdb", args.memory_limit, 0)
        print(f"{args.records:,} usage records in {MONTH}\n")
        print("| stage | file | file B/record | used B/record | archive |")
        print("|---|---:|---:|---:|---:|")
        ledger = _fill(config, work, args.records)
        _row("generated, closed", work / "ledger.duckdb", _used_bytes(ledger), args.records, 0)
        t = time.perf_counter()
        report = archive.retain(ledger, work / "archive", 35, now=START + SECONDS + 40 * 86_400)
        seconds = time.perf_counter() - t
        ledger.close()  # a checkpoint: the deleted rows' blocks are freed
        ledger = open_ledger(config, str(work / "ledger.duckdb"))
        archived = _tree_bytes(work / "archive")
        _row("after retention", work / "ledger.duckdb", _used_bytes(ledger), args.records, archived)
        backup.backup(ledger, work / "backup")
        ledger.close()
        backup.restore(work / "backup", work / "compact.duckdb")
        compact = open_ledger(config, str(work / "compact.duckdb"))
        _row(
            "rewritten (backup + restore)",
            work / "compact.duckdb",
            _used_bytes(compact),
            args.records,
            archived,
        )
        compact.close()
        moved = ", ".join(f"{k} {v:,}" for k, v in report.moved.items())
        print(f"\nretention: {seconds:.1f} s, moved {moved}")
    return 0


def _fill(config: Config, work: Path, records: int) -> Ledger:
    ledger = open_ledger(config, str(work / "ledger.duckdb"))
    generate(ledger, records)
    Chargeback(ledger, config).close(MONTH, now=START + SECONDS + 86_400)
    ledger._con.execute("CHECKPOINT")  # the benchmark is the one writer here
    return ledger


if __name__ == "__main__":
    raise SystemExit(main())
