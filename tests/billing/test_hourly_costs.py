"""Hourly cost rows: the statement read from them is today's per-minute statement, cent for cent.

The oracle is the allocation as it was before hourly rows (``minute_allocation``): the same
rollups priced and split minute by minute at the time of the statement. The ledgers are a
simulated fleet's two days (``fleet_month``: a dynamic group whose pods come and go, a fixed
replica, engine counters) and random requests of every length on a fixed replica and two pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import polars as pl
import pytest
import yaml

from billing import allocation_runs, bases, reconciliation_hours
from billing.allocation import Allocation, Policy, run_all
from billing.chargeback import policy_from_config
from billing.ledger import Ledger
from billing.rounding import cents
from billing.serve import rebuild_hours
from billing.statement import cents_lines, merged
from infermeter.config import Config
from tests.billing.conftest import OCT, batch, gpu_samples, usage
from tests.billing.fleet_month import Group, Month, Stream, month_config, run
from tests.billing.minute_allocation import minute_claims, minute_month_sql
from tests.billing.test_statement_rollups import random_records, random_samples
from tests.conftest import config_ledger

MONTH = "2026-10"
PEAK_HOURS = range(8, 20)
HOUR = 3600.0
NOW = OCT + 40 * 86400


def _with_pools(config: Config) -> Config:
    """``config`` with its nodes in a pool whose price changes on 2 Oct 05:00 and a commitment."""
    data = config.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["prices"]["pools"] = [
        {
            "name": "rack",
            "node_pattern": "*",
            "prices": [
                {
                    "from": "2026-10-01",
                    "category": "committed",
                    "usd_per_gpu_hour": 2.0,
                    "committed_gpus": 2,
                },
                {
                    "from": "2026-10-02T05:00:00Z",
                    "category": "on_demand",
                    "usd_per_gpu_hour": 3.5,
                    "usd_per_kwh": 0.0,
                },
            ],
        }
    ]
    return Config.model_validate(data)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Config, Ledger]]:
    """Two simulated days of a fleet with pods that come and go, in a ledger."""
    config = month_config()
    ledger = config_ledger(config)
    month = Month(
        (
            Group("large-0", tuple(2 if h in PEAK_HOURS else 1 for h in range(24)), dynamic=True),
            Group("small-0"),
        ),
        (
            Stream(
                "search",
                "chat-large",
                tuple(40.0 if h in PEAK_HOURS else 4.0 for h in range(24)),
                400,
                200,
            ),
            Stream("assistant", "chat-small", (12.0,) * 24, 300, 150),
            Stream("search", "chat-small", (3.0,) * 24, 1200, 600),
        ),
        days=2,
    )
    run(config, month, ledger)
    yield config, ledger
    ledger.close()


def _oracle(ledger: Ledger, policy: Policy, invoices: dict[str, int] | None = None) -> Allocation:
    """The month allocated minute by minute, as before hourly rows (the basis the invoices allow)."""
    claims = minute_claims(policy, MONTH)
    with ledger.snapshot() as cur:
        sql = minute_month_sql(cur, policy, MONTH, ledger.heartbeat_seconds)
        listed = run_all(cur, sql, policy, claims)
        if not invoices:
            return listed
        scaled_policy = bases.scaled_policy(policy, listed.pools, listed.commitments, invoices)
        sql = minute_month_sql(cur, scaled_policy, MONTH, ledger.heartbeat_seconds)
        scaled = run_all(cur, sql, scaled_policy, claims)
        return bases.with_unmeasured(scaled, listed, invoices, policy.platform_account)


def _hourly(ledger: Ledger, policy: Policy, invoices: dict[str, int] | None = None) -> Allocation:
    listed, scaled = allocation_runs.allocate_bases(ledger, policy, MONTH, invoices or {})
    return listed if scaled is None else scaled


def _same_cents(got: Allocation, want: Allocation) -> None:
    assert cents(got.fleet_microcents) == cents(want.fleet_microcents)
    got_lines = cents_lines(MONTH, merged(got.lines))
    want_lines = cents_lines(MONTH, merged(want.lines))
    assert got_lines.height > 0
    assert got_lines.equals(want_lines), (got_lines, want_lines)


def _policies(config: Config) -> dict[str, Policy]:
    base = policy_from_config(config)
    return {
        "in_flight": base,
        "tokens": replace(base, allocation="tokens"),
        "requests": replace(base, allocation="requests"),
        "pools": policy_from_config(_with_pools(config)),
    }


@pytest.mark.parametrize("rule", ["in_flight", "tokens", "requests", "pools"])
def test_the_statement_from_hourly_rows_is_the_minute_statement_cent_for_cent(
    fleet: tuple[Config, Ledger], rule: str
) -> None:
    """Each split rule, and a price book whose rate changes mid-month, give the same cents
    whether the hours are built in the statement's snapshot or read from the ledger's rows."""
    config, ledger = fleet
    policy = _policies(config)[rule]
    want = _oracle(ledger, policy)
    allocation_runs.mark_all_hours_dirty(ledger)
    _same_cents(_hourly(ledger, policy), want)  # every hour built on the fly
    assert allocation_runs.refresh_hours(ledger) > 24
    _same_cents(_hourly(ledger, policy), want)  # every hour read from cost_hours
    reconciliation_hours.refresh(ledger)
    _same_cents(_hourly(ledger, policy), want)  # and the reconciliation from its kept hours


def test_an_invoice_basis_from_hourly_rows_is_the_minute_one(fleet: tuple[Config, Ledger]) -> None:
    """An invoice 7 % above list scales the hourly rows' prices as it scaled every minute's."""
    config, ledger = fleet
    policy = policy_from_config(config)
    listed = _hourly(ledger, policy)
    pools = {str(p): round(c * 1.07 * 100) for p, c in _pool_costs(listed).items()}
    allocation_runs.refresh_hours(ledger)
    _same_cents(_hourly(ledger, policy, pools), _oracle(ledger, policy, pools))


def test_rows_of_another_heartbeat_are_never_read(config: Config) -> None:
    """A pod whose sidecar went silent at 02:00 while its GPU stayed busy until 04:00 ends a
    heartbeat after its last one: opened with another heartbeat, the ledger's statement is the
    per-minute one under it before any rebuild, and after it."""
    ledger = config_ledger(config, heartbeat_seconds=600.0)
    policy = policy_from_config(config)
    pod: dict[str, Any] = {
        "instance": "small-0-q",
        "replica": "small-0",
        "model": "chat-small",
        "node": "node-b",
        "gpu_model": "L40S",
        "gpu_count": 1,
        "gpus": "0",
        "started_at": OCT + HOUR,
    }
    events = [
        {**pod, "event_id": "q-start", "event": "start", "timestamp": OCT + HOUR},
        {**pod, "event_id": "q-beat", "event": "heartbeat", "timestamp": OCT + 2 * HOUR},
    ]
    ledger.ingest(batch("instances", events), now=NOW)
    samples = gpu_samples("small-0", OCT + HOUR, 3 * HOUR, every=60.0)
    for sample in samples:
        sample["instance"] = "small-0-q"
    ledger.ingest(batch("gpu_samples", samples), now=NOW)
    work = [usage("search", OCT + HOUR + 60 * m, 50.0, instance="small-0-q") for m in range(58)]
    ledger.ingest(batch("usage", work), now=NOW)
    allocation_runs.refresh_hours(ledger)
    ten_minutes = _hourly(ledger, policy)
    ledger.heartbeat_seconds = 60.0
    want = _oracle(ledger, policy)
    assert cents(want.fleet_microcents) == cents(ten_minutes.fleet_microcents)
    assert not cents_lines(MONTH, merged(want.lines)).equals(
        cents_lines(MONTH, merged(ten_minutes.lines))
    )  # nine minutes moved from the pod to unallocated
    _same_cents(_hourly(ledger, policy), want)
    allocation_runs.refresh_hours(ledger)
    _same_cents(_hourly(ledger, policy), want)
    ledger.close()


def _pool_costs(allocation: Allocation) -> dict[str, float]:
    use = allocation.pools.group_by("pool").agg(pl.col("compute_usd").sum())
    return dict(zip(use["pool"].to_list(), use["compute_usd"].to_list(), strict=True))


@pytest.fixture
def random_ledger(config: Config) -> Iterator[Ledger]:
    """Random requests of any length on a fixed replica and two pods, their GPUs every minute."""
    ledger = config_ledger(config)
    rng = random.Random(11)
    records = random_records(rng, 6)
    for part in range(0, len(records), 37):
        ledger.ingest(batch("usage", records[part : part + 37]), now=NOW)
    for instance in (None, "small-0-a", "small-0-b"):
        ledger.ingest(batch("engine_samples", random_samples(rng, 6, instance)), now=NOW)
    for gpu, instance in enumerate(("small-0", "small-0-a", "small-0-b")):
        samples = gpu_samples("small-0", OCT - HOUR, 8 * HOUR, every=60.0, gpu=str(gpu))
        for s in samples:
            s["instance"] = instance
        ledger.ingest(batch("gpu_samples", samples), now=NOW)
    yield ledger
    ledger.close()


def _dirty(ledger: Ledger) -> list[int]:
    with ledger.reader() as cur:
        return [
            int(h) for (h,) in cur.execute("SELECT hour FROM hours_dirty ORDER BY 1").fetchall()
        ]


def test_a_late_record_reopens_only_its_hour(config: Config, random_ledger: Ledger) -> None:
    """After a rebuild, a record for 03:10 marks hour 3 alone; the rebuild of that hour gives
    the statement that building every hour again gives."""
    ledger = random_ledger
    policy = policy_from_config(config)
    allocation_runs.refresh_hours(ledger)
    assert _dirty(ledger) == []
    late = usage("search", OCT + 3 * HOUR + 600, 20.0, replica="small-0", instance="small-0-a")
    ledger.ingest(batch("usage", [late]), now=NOW)
    assert _dirty(ledger) == [int(OCT // HOUR) + 3]
    stale = _hourly(ledger, policy)  # the dirty hour built in the snapshot
    assert allocation_runs.refresh_hours(ledger) == 1
    incremental = _hourly(ledger, policy)
    allocation_runs.mark_all_hours_dirty(ledger)
    allocation_runs.refresh_hours(ledger)
    _same_cents(incremental, _hourly(ledger, policy))
    _same_cents(stale, incremental)
    _same_cents(incremental, _oracle(ledger, policy))


def test_gpu_samples_mark_the_hours_their_intervals_cover(random_ledger: Ledger) -> None:
    """A sample at 05:00:05 covering the 10 s before it marks hours 4 and 5."""
    ledger = random_ledger
    allocation_runs.refresh_hours(ledger)
    sample = gpu_samples("small-0", OCT + 5 * HOUR - 5, 10.0, every=10.0)
    ledger.ingest(batch("gpu_samples", sample), now=NOW)
    first = int(OCT // HOUR)
    assert _dirty(ledger) == [first + 4, first + 5]


def test_a_lifetime_that_moves_its_end_dirties_the_hours_between(config: Config) -> None:
    """A pod announced at 01:30 and heard until 02:10, then stopped at 04:20: hours 2..4 only."""
    ledger = config_ledger(config)
    start = OCT + HOUR + 1800
    pod: dict[str, Any] = {
        "instance": "small-0-z",
        "replica": "small-0",
        "model": "chat-small",
        "node": "node-a",
        "gpu_model": "H100",
        "gpu_count": 1,
        "gpus": "0",
        "started_at": start,
    }
    events = [
        {**pod, "event_id": "z-start", "event": "start", "timestamp": start},
        {**pod, "event_id": "z-beat", "event": "heartbeat", "timestamp": OCT + 2 * HOUR + 600},
    ]
    ledger.ingest(batch("instances", events), now=NOW)
    allocation_runs.refresh_hours(ledger)
    stop = {**pod, "event_id": "z-stop", "event": "stop", "timestamp": OCT + 4 * HOUR + 1200}
    ledger.ingest(batch("instances", [stop]), now=NOW)
    first = int(OCT // HOUR)
    assert _dirty(ledger) == [first + 2, first + 3, first + 4]
    ledger.close()


def test_a_new_heartbeat_setting_rebuilds_every_hour(config: Config, random_ledger: Ledger) -> None:
    """Lifetimes end by the heartbeat, so a ledger opened with another one rebuilds all hours."""
    ledger = random_ledger
    policy = policy_from_config(config)
    allocation_runs.refresh_hours(ledger)
    assert allocation_runs.refresh_hours(ledger) == 0
    ledger.heartbeat_seconds = ledger.heartbeat_seconds * 2
    before = _hourly(ledger, policy)  # the rows of the old heartbeat are not read
    assert allocation_runs.refresh_hours(ledger) >= 8
    _same_cents(before, _hourly(ledger, policy))


def test_rows_follow_hours_and_keys_not_requests(config: Config) -> None:
    """Ten times the requests in the same hours and teams leave the number of rows as it was."""
    counts = []
    for per_minute in (1, 10):
        ledger = config_ledger(config)
        records = [
            usage(team, OCT + m * 60 + k, 30.0, replica="small-0")
            for m in range(180)
            for k in range(per_minute)
            for team in ("search", "assistant")
        ]
        ledger.ingest(batch("usage", records), now=NOW)
        ledger.ingest(batch("gpu_samples", gpu_samples("small-0", OCT, 3 * HOUR)), now=NOW)
        allocation_runs.refresh_hours(ledger)
        with ledger.reader() as cur:
            counts.append(
                tuple(
                    int(cur.execute(f"SELECT count(*) FROM {t}").fetchone()[0])  # type: ignore[index]
                    for t in ("cost_hours", "share_hours")
                )
            )
        ledger.close()
    assert counts[0] == counts[1]
    assert counts[0][1] <= 3 * 2 * 2  # hours x teams x models at most


def test_a_price_from_within_an_hour_is_refused_naming_it() -> None:
    """Prices change on whole hours: 12:30 is refused with the value and the reason."""
    data = yaml.safe_load(month_config().model_dump_json(by_alias=True, exclude_none=True))
    data["prices"]["pools"] = [
        {
            "name": "rack",
            "nodes": ["n1"],
            "prices": [{"from": "2026-10-02T12:30:00Z", "usd_per_gpu_hour": 2.0}],
        }
    ]
    with pytest.raises(ValueError, match=r"2026-10-02T12:30:00Z.*whole hour"):
        Config.model_validate(data)


async def test_billing_rebuilds_the_marked_hours_in_the_background(random_ledger: Ledger) -> None:
    """The service's task rebuilds what ingest marked without any statement asking."""
    ledger = random_ledger
    assert len(_dirty(ledger)) >= 8
    task = asyncio.create_task(rebuild_hours(ledger, interval=0.05))
    try:
        for _ in range(200):
            await asyncio.sleep(0.05)
            if not _dirty(ledger):
                break
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert _dirty(ledger) == []
    with ledger.reader() as cur:
        rows = cur.execute("SELECT count(*) FROM cost_hours").fetchone()
    assert rows is not None
    assert rows[0] > 0
