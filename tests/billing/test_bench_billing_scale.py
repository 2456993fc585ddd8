"""``bench.billing_scale`` at a small size: the figures in docs/benchmarks.md come from a bench
that still generates a month that reconciles and still gets every batch it sends accepted."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import yaml

from bench.billing_scale import MONTH, TEAMS, bench_config, generate, ingest_rate
from billing import allocation_runs
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from infermeter.serving import free_port


def test_the_generated_month_has_its_records_engine_windows_and_hourly_rows(
    tmp_path: Path,
) -> None:
    """20,000 generated requests: all in the statement, reconciled against engine windows."""
    _, config = bench_config(tmp_path / "ledger.duckdb", "1GB", free_port())
    ledger = Ledger.open(tmp_path / "ledger.duckdb", TEAMS, {"chat-small": 0.5, "chat-large": 1.5})
    try:
        generate(ledger, 20_000)
        assert allocation_runs.refresh_hours(ledger) > 700
        statement = Chargeback(ledger, config).statement(MONTH)
        with ledger.reader() as cur:
            windows = cur.execute("SELECT count(*) FROM engine_hours").fetchone()
    finally:
        ledger.close()
    assert statement.reconciles
    assert windows is not None
    assert windows[0] > 0
    assert int(statement.lines.filter(~pl.col("model").str.contains(r"\("))["requests"].sum()) == (
        20_000
    )


def test_every_batch_the_ingest_bench_sends_is_accepted(tmp_path: Path) -> None:
    """Four Arrow batches of 500 records from two clients: each POST answered 200 (the bench
    raises on any other), at some rate, as the shippers' Arrow conversion takes them."""
    port = free_port()
    data, _ = bench_config(tmp_path / "ledger.duckdb", "1GB", port)
    path = tmp_path / "infermeter.yaml"
    path.write_text(yaml.safe_dump(data))
    result = ingest_rate(path, port, 500, 2, 4)
    assert result["records_per_s"] > 0
    assert result["encode_cpu_us"] > 0
