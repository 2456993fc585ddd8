"""The statement's rollups: kept at ingest, exact under repeats and late records, backfilled once."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest

from billing import closing, ingest_sql, queries, reconciled
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.reconciliation import hour_runs, reconcile, reconciliation_sql
from billing.schema import LATEST_VERSION, MIGRATIONS
from infermeter.config import Config
from tests.billing.conftest import OCT, batch, gpu_samples, usage
from tests.conftest import config_ledger

HOUR = 3600.0
_ids = itertools.count()
_V6_TABLES = (
    "engine_hours",
    "alloc_units",
    "alloc_keys",
    "alloc_slots",
    "alloc_hours",
    "usage_hours",
    "usage_edges",
)


def _tables_after(version: int) -> list[str]:
    """The tables that the migrations after ``version`` create."""
    con = duckdb.connect()
    made = []
    for number, migration in enumerate(MIGRATIONS, start=1):
        before = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        con.execute(migration)
        after = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        if number > version:
            made.extend(sorted(after - before))
    con.close()
    return made


def random_records(rng: random.Random, hours: int) -> list[dict[str, Any]]:
    """Requests on a fixed replica and on two pods, of any length, some failing, first-tokenless
    or of several choices."""
    out = []
    for _ in range(rng.randint(50, 300)):
        start = OCT + rng.uniform(0, hours * HOUR)
        seconds = rng.choice([0.0, rng.uniform(0, 30), rng.uniform(0, 200), rng.uniform(0, 5000)])
        placement = rng.choice([{}, {"instance": "small-0-a"}, {"instance": "small-0-b"}])
        first = start + rng.uniform(0, seconds) if rng.random() < 0.85 else None
        status = rng.choice(["ok", "ok", "ok", "client_aborted", "upstream_error", "rejected"])
        tokens = {"prompt_tokens": rng.randint(0, 900), "completion_tokens": rng.randint(0, 900)}
        tokens["cached_prompt_tokens"] = rng.randint(0, tokens["prompt_tokens"])
        team = rng.choice(["search", "assistant"])
        choices = rng.choice([1, 1, 1, 2, 3])
        out.append(
            usage(
                team,
                start,
                seconds,
                first_token_at=first,
                status=status,
                choices=choices,
                **tokens,
                **placement,
            )
        )
    return out


def random_samples(rng: random.Random, hours: int, instance: str | None) -> list[dict[str, Any]]:
    """An engine's counters read at uneven times: every few seconds, minutes, or after a gap."""
    out, t, prompt, completion = [], OCT + rng.uniform(-2 * HOUR, HOUR), 0.0, 0.0
    every = rng.choice([15.0, 30.0, 60.0, 100.0, 600.0, 1700.0])
    while t < OCT + hours * HOUR:
        prompt, completion = prompt + rng.randint(0, 5000), completion + rng.randint(0, 5000)
        out.append(
            {
                "sample_id": f"eng-{next(_ids)}",
                "replica": "small-0",
                "model": "chat-small",
                "timestamp": t,
                "requests_running": float(rng.choice([0, 0, 1, 2])),
                "requests_waiting": 0.0,
                "kv_cache_usage": 0.0,
                "prompt_tokens_total": prompt,
                "generation_tokens_total": completion,
                "instance": instance,
            }
        )
        t += rng.uniform(0.5, 1.5) * every if rng.random() < 0.995 else rng.uniform(0, 3 * HOUR)
    return out


def keep(ledger: Ledger, kind: str, records: list[dict[str, Any]], rng: random.Random) -> None:
    """``records`` in random batches, each batch sent twice half the time (a shipper's retry)."""
    rng.shuffle(records)
    now = OCT + 60 * 86400
    while records:
        part, records = records[: rng.randint(1, 40)], records[40:]
        for _ in range(rng.choice([1, 2])):
            ledger.ingest(batch(kind, part), now=now)


def raw_reconciliation(ledger: Ledger, first_hour: int, end_hour: int) -> pl.DataFrame:
    """The reconciliation read from every raw record, as the rollups must reproduce it."""
    sql, values = reconciliation_sql(first_hour, end_hour)
    with ledger.reader() as cur:
        frame: pl.DataFrame = cur.sql(sql, params=values).pl()
    return frame


@pytest.mark.parametrize("seed", range(20))
def test_rollups_reconcile_exactly_as_the_raw_records(ledger: Ledger, seed: int) -> None:
    """For random records and uneven engine reads, the rollups give the raw records' rows."""
    rng = random.Random(seed)
    hours = 6
    keep(ledger, "usage", random_records(rng, hours), rng)
    for instance in (None, "small-0-a", "small-0-b"):
        keep(ledger, "engine_samples", random_samples(rng, hours, instance), rng)
    first = int(OCT // HOUR)
    for lo, hi in ((first, first + hours), (first + 2, first + 4), (first + 5, first + 6)):
        got = reconciled.reconciled(ledger, lo * HOUR, hi * HOUR)
        assert got.equals(raw_reconciliation(ledger, lo, hi)), (lo, hi)


@pytest.mark.parametrize("seed", range(4))
def test_the_query_apis_reconciliation_is_the_raw_records_one(ledger: Ledger, seed: int) -> None:
    """The reconciliation query the dashboards ask for reads the rollups, and gives the raw
    records' rows, for a range and for one model."""
    rng = random.Random(100 + seed)
    keep(ledger, "usage", random_records(rng, 5), rng)
    for instance in (None, "small-0-a"):
        keep(ledger, "engine_samples", random_samples(rng, 5, instance), rng)
    first = int(OCT // HOUR)
    with ledger.reader() as cur:
        got = queries.run(cur, "reconciliation", queries.params_from(OCT + HOUR, OCT + 4 * HOUR))
        one = queries.run(
            cur,
            "reconciliation",
            queries.params_from(OCT, OCT + 5 * HOUR, model="chat-small"),
        )
    assert got.height > 0
    assert got.equals(raw_reconciliation(ledger, first + 1, first + 4))
    sql, values = reconciliation_sql(first, first + 5, model="chat-small")
    with ledger.reader() as cur:
        assert one.equals(cur.sql(sql, params=values).pl())


def test_reconciliation_reads_raw_records_only_of_hours_read_early(ledger: Ledger) -> None:
    """An engine read every 15 s needs no raw record but its first hour's; one read hourly needs them all."""
    rng = random.Random(7)
    keep(ledger, "usage", random_records(rng, 4), rng)
    steady = [
        {
            "sample_id": f"eng-{next(_ids)}",
            "replica": "small-0",
            "model": "chat-small",
            "timestamp": OCT + 15.0 * k,
            "requests_running": 0.0,
            "requests_waiting": 0.0,
            "kv_cache_usage": 0.0,
            "prompt_tokens_total": 10.0 * k,
            "generation_tokens_total": 5.0 * k,
        }
        for k in range(4 * 240)
    ]
    ledger.ingest(batch("engine_samples", steady), now=OCT + 60 * 86400)
    first = int(OCT // HOUR)
    with ledger.reader() as cur:
        reconcile(cur, first, first + 4)
        unsummed = cur.execute("SELECT instance, hour FROM _unsummed").fetchall()
    assert unsummed == [("small-0", first)]
    assert reconciled.reconciled(ledger, OCT, OCT + 4 * HOUR).equals(
        raw_reconciliation(ledger, first, first + 4)
    )


def test_hour_runs_merge_consecutive_hours() -> None:
    """Hours become [first, after-last) runs, repeats and order ignored."""
    assert hour_runs([5, 3, 4, 9, 4]) == [(3, 6), (9, 10)]
    assert hour_runs([]) == []


def rebuilt(ledger: Ledger) -> dict[str, list[tuple[Any, ...]]]:
    """The statement rollups as they should be: recomputed from the raw rows and usage_slots."""
    with ledger.reader() as cur:
        cur.execute("CREATE OR REPLACE TEMP VIEW fresh AS SELECT * FROM usage")
        tp = ingest_sql.FIRST_TOKEN_SQL
        return {
            "usage_hours": cur.execute(f"""
                SELECT coalesce(instance, replica), {ingest_sql.token_hour_sql()}, max(replica),
                    max(model), count(*), sum(prompt_tokens * choices), sum(completion_tokens)
                FROM fresh WHERE status IN {ingest_sql.BILLABLE} AND {ingest_sql.summed_sql()}
                GROUP BY ALL ORDER BY ALL""").fetchall(),
            "usage_edges": cur.execute(f"""
                SELECT coalesce(instance, replica), replica, model, {tp}, finished_at,
                    prompt_tokens * choices, completion_tokens
                FROM fresh WHERE status IN {ingest_sql.BILLABLE} AND NOT ({ingest_sql.summed_sql()})
                ORDER BY ALL""").fetchall(),
            "usage_hangups": cur.execute(f"""
                SELECT request_id, coalesce(instance, replica), replica, team, model, received_at,
                    {tp}, finished_at, prompt_tokens * choices, completion_tokens, choices
                FROM fresh WHERE status = 'client_aborted' ORDER BY ALL""").fetchall(),
            "alloc": cur.execute("""
                SELECT replica, instance, team, model, slot, inflight_seconds FROM usage_slots
                ORDER BY ALL""").fetchall(),
            "alloc_hours": cur.execute("""
                SELECT replica, instance, team, model, slot // 60, sum(requests), sum(prompt_tokens),
                    sum(completion_tokens), sum(cached_prompt_tokens)
                FROM usage_slots GROUP BY ALL ORDER BY ALL""").fetchall(),
        }


def kept(ledger: Ledger) -> dict[str, list[tuple[Any, ...]]]:
    """The statement rollups as the ledger holds them, keys replaced by their names."""
    with ledger.reader() as cur:
        return {
            "usage_hours": cur.execute("SELECT * FROM usage_hours ORDER BY ALL").fetchall(),
            "usage_edges": cur.execute("SELECT * FROM usage_edges ORDER BY ALL").fetchall(),
            "usage_hangups": cur.execute("SELECT * FROM usage_hangups ORDER BY ALL").fetchall(),
            "alloc": cur.execute("""
                SELECT k.replica, k.instance, k.team, k.model, s.slot, s.inflight_seconds
                FROM alloc_slots s JOIN alloc_keys k USING ("key")
                JOIN alloc_units u ON u.unit = k.unit AND u.unit = s.unit
                    AND (u.replica, u.instance) = (k.replica, k.instance)
                ORDER BY ALL""").fetchall(),
            "alloc_hours": cur.execute("""
                SELECT k.replica, k.instance, k.team, k.model, h.hour, h.requests, h.prompt_tokens,
                    h.completion_tokens, h.cached_prompt_tokens
                FROM alloc_hours h JOIN alloc_keys k USING ("key") ORDER BY ALL""").fetchall(),
        }


def test_repeats_and_late_records_keep_the_rollups_exact(ledger: Ledger, config: Config) -> None:
    """Batches sent twice and records for a closed month leave every rollup as the raw rows say."""
    rng = random.Random(3)
    keep(ledger, "usage", random_records(rng, 5), rng)
    ledger.ingest(batch("gpu_samples", gpu_samples(seconds=5 * HOUR)), now=OCT + 60 * 86400)
    chargeback = Chargeback(ledger, config)
    chargeback.close("2026-10", now=OCT + 60 * 86400)
    late = random_records(rng, 5)
    keep(ledger, "usage", late, rng)
    keep(ledger, "usage", late[:10], rng)  # resent after they were kept
    assert kept(ledger) == rebuilt(ledger)
    assert closing.month_state(ledger, "2026-10") == (True, True)


def test_an_older_ledger_is_backfilled_once(tmp_path: Path, config: Config) -> None:
    """A ledger from before the statement rollups gets them from its raw rows, and the same statement."""
    path = tmp_path / "ledger.duckdb"
    ledger = config_ledger(config, path)
    rng = random.Random(11)
    keep(ledger, "usage", random_records(rng, 3), rng)
    keep(ledger, "engine_samples", random_samples(rng, 3, None), rng)
    ledger.ingest(batch("gpu_samples", gpu_samples(seconds=3 * HOUR)), now=OCT + 60 * 86400)
    before = Chargeback(ledger, config).statement("2026-10").lines
    expected = kept(ledger)
    with ledger.reader() as cur:
        engine = cur.execute("SELECT * FROM engine_hours ORDER BY ALL").fetchall()
    assert engine
    # What a ledger of schema version 5 holds: no statement rollups (nor later migrations' tables).
    with ledger.reader() as cur:
        for table in (*_V6_TABLES, *_tables_after(6)):
            cur.execute(f"DROP TABLE {table}")
        cur.execute("DELETE FROM schema_version WHERE version >= 6")
    ledger.close()
    ledger = config_ledger(config, path)
    try:
        assert kept(ledger) == expected
        with ledger.reader() as cur:
            assert cur.execute("SELECT * FROM engine_hours ORDER BY ALL").fetchall() == engine
        assert Chargeback(ledger, config).statement("2026-10").lines.equals(before)
        with ledger.reader() as cur:
            versions = cur.execute(
                "SELECT count(*) FROM schema_version WHERE version = ?", [LATEST_VERSION]
            ).fetchone()
        assert versions == (1,)
    finally:
        ledger.close()
    ledger = config_ledger(config, path)  # opened again: nothing is added twice
    try:
        assert kept(ledger) == expected
    finally:
        ledger.close()
