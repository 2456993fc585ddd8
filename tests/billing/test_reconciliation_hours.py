"""The month's reconciliation kept per hour: whatever arrives late and in whatever order, the kept
hours plus the stale suffix are the whole month reconciled afresh, to the token."""

from __future__ import annotations

import random
from typing import Any

import polars as pl
import pytest

from billing import reconciliation_hours
from billing.ledger import Ledger
from billing.reconciliation import hours, reconcile
from infermeter.months import month_bounds
from tests.billing.conftest import OCT, batch, usage
from tests.billing.test_statement_rollups import random_records, random_samples

HOUR = 3600.0
NOW = OCT + 60 * 86400
MONTH = hours(*month_bounds("2026-10"))
FIRST = MONTH[0]


def _frames(ledger: Ledger, kept: bool) -> tuple[pl.DataFrame, pl.DataFrame]:
    """October's reconciliation rows and hang-up tails: from the kept hours (``kept``) or the
    whole month reconciled afresh."""
    with ledger.snapshot() as cur:
        if kept:
            reconciliation_hours.month_reconciliation(cur, *MONTH)
        else:
            reconcile(cur, *MONTH)
        rows = cur.sql("SELECT * FROM _reconciliation ORDER BY ALL").pl()
        tails = cur.sql("SELECT * FROM _hangups ORDER BY ALL").pl()
    return rows, tails


def _same(ledger: Ledger, when: str) -> None:
    got, want = _frames(ledger, kept=True), _frames(ledger, kept=False)
    assert got[0].equals(want[0]), (when, got[0], want[0])
    assert got[1].equals(want[1]), (when, got[1], want[1])


def _clean_before(ledger: Ledger) -> int | None:
    with ledger.reader() as cur:
        row = cur.execute(
            "SELECT clean_before FROM reconciliation_built WHERE first_hour = ?", [FIRST]
        ).fetchone()
    return None if row is None else int(row[0])


def _batches(rng: random.Random, hours_: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """Random records and uneven engine reads of three instances, cut into batches and shuffled,
    so that records and readings arrive late, out of order, and across the month's start."""
    out: list[tuple[str, list[dict[str, Any]]]] = []
    parts: list[tuple[str, list[dict[str, Any]]]] = [("usage", random_records(rng, hours_))]
    parts += [
        ("engine_samples", random_samples(rng, hours_, i)) for i in (None, "small-0-a", "small-0-b")
    ]
    for kind, records in parts:
        if kind == "usage":
            rng.shuffle(records)
        while records:
            size = rng.randint(1, 60)
            out.append((kind, records[:size]))
            records = records[size:]
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_kept_hours_are_the_month_reconciled_afresh(ledger: Ledger, seed: int) -> None:
    """After each batch, with the upkeep run at random moments, the kept hours and the stale
    suffix give exactly the rows and tails of reconciling the whole month again."""
    rng = random.Random(seed)
    kept = 0
    for n, (kind, records) in enumerate(_batches(rng, 6)):
        ledger.ingest(batch(kind, records), now=NOW)
        if rng.random() < 0.4:
            kept += reconciliation_hours.refresh(ledger)
        if n % 3 == 0:
            _same(ledger, f"batch {n}")
    reconciliation_hours.refresh(ledger)
    assert kept > 0
    _same(ledger, "at the end")
    assert _clean_before(ledger) == MONTH[1]


def _reading(t: float, k: int, instance: str | None = None, running: float = 1.0) -> dict[str, Any]:
    """The engine of replica small-0 (or its pod ``instance``) read at ``t``, its ``k``-th reading."""
    return {
        "sample_id": f"{instance or 'small-0'}-{k}",
        "replica": "small-0",
        "instance": instance,
        "model": "chat-small",
        "timestamp": t,
        "requests_running": running,
        "requests_waiting": 0.0,
        "kv_cache_usage": 0.0,
        "prompt_tokens_total": 100.0 * k,
        "generation_tokens_total": 50.0 * k,
    }


def _steady_ledger(ledger: Ledger) -> None:
    """Six hours of requests on replica small-0, its engine read every 30 s, all kept."""
    samples = [_reading(OCT + 30.0 * k, k) for k in range(6 * 120)]
    ledger.ingest(batch("engine_samples", samples), now=NOW)
    records = [usage("search", OCT + 60.0 * m, 20.0) for m in range(6 * 60 - 1)]
    ledger.ingest(batch("usage", records), now=NOW)
    reconciliation_hours.refresh(ledger)


def test_a_late_record_reopens_the_month_from_the_hour_before_it(ledger: Ledger) -> None:
    """A record received at 03:10 makes the hours from 02:00 stale, and no earlier one."""
    _steady_ledger(ledger)
    assert _clean_before(ledger) == MONTH[1]
    ledger.ingest(batch("usage", [usage("assistant", OCT + 3 * HOUR + 600, 30.0)]), now=NOW)
    assert _clean_before(ledger) == FIRST + 2
    _same(ledger, "stale from 02:00")
    assert reconciliation_hours.refresh(ledger) == 1
    assert _clean_before(ledger) == MONTH[1]
    _same(ledger, "kept again")


def test_a_reading_reopens_the_month_from_the_one_before_it(ledger: Ledger) -> None:
    """The engine's next reading at 06:00:30 reopens from the hour before its previous reading
    (05:59:30) less the wait for a stale instance: the hours from 04:00, and no earlier one."""
    _steady_ledger(ledger)
    reading = _reading(OCT + 6 * HOUR + 30, 721)
    ledger.ingest(batch("engine_samples", [reading]), now=NOW)
    assert _clean_before(ledger) == FIRST + 4
    _same(ledger, "after the reading")


def test_a_stream_across_the_last_reading_reopens_from_its_first_token(ledger: Ledger) -> None:
    """A 3-hour stream kept whole that ends after the engine's last reading: the reading after it
    reopens the month from the hour before the stream's first token, as its tokens move from
    unreconciled into the new window."""
    _steady_ledger(ledger)
    long = usage("search", OCT + 3 * HOUR + 100, 3 * HOUR, completion_tokens=9000)
    ledger.ingest(batch("usage", [long]), now=NOW)
    reconciliation_hours.refresh(ledger)
    later = _reading(OCT + 6 * HOUR + 1800, 800, running=0.0)
    ledger.ingest(batch("engine_samples", [later]), now=NOW)
    assert _clean_before(ledger) == FIRST + 2
    _same(ledger, "after the reading")


def test_a_reading_after_a_silence_makes_a_gone_instances_records_unreconciled(
    ledger: Ledger,
) -> None:
    """Pod a is read until 03:55 and serves until 03:59; then nothing is read until a new pod's
    first reading at 06:00. Pod a's last records waited for its next reading; now the fleet has
    been read long after it, they are unreconciled, in hour 3: the reading reopens the month from
    there, though neither pod was read in hours 4 and 5."""
    readings = [_reading(OCT + 60.0 * m, m, "small-0-a", 0.0) for m in range(3 * 60 + 56)]
    ledger.ingest(batch("engine_samples", readings), now=NOW)
    served = [usage("search", OCT + 60.0 * m, 20.0, instance="small-0-a") for m in range(240)]
    ledger.ingest(batch("usage", served), now=NOW)
    reconciliation_hours.refresh(ledger)
    before, _ = _frames(ledger, kept=True)
    assert before["unreconciled_requests"].sum() == 0  # waiting for pod a's next reading
    ledger.ingest(batch("engine_samples", [_reading(OCT + 6 * HOUR, 1, "small-0-c", 0.0)]), now=NOW)
    assert _clean_before(ledger) == FIRST + 2
    _same(ledger, "after the new pod's reading")
    after, _ = _frames(ledger, kept=True)
    assert after["unreconciled_requests"].sum() == 5  # 03:55 to 03:59
