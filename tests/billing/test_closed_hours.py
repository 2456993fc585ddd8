"""A closed month's hours: frozen with its statement, and adding up to it to the cent."""

from __future__ import annotations

import random

import polars as pl
import pytest

from billing import closed_hours, closing, reconciliation_hours
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.reconciliation import reconciliation_sql
from tests.billing.conftest import NOV, OCT, batch, gpu_samples, instance_event, usage
from tests.billing.test_statement_rollups import keep, random_records, random_samples

AFTER_OCT = NOV + 86400
DEC = NOV + 30 * 86400
TABLES = [table for _, table in closed_hours.KINDS.values()]


def _fill(ledger: Ledger, month_start: float) -> None:
    """Two hours of one GPU, a second GPU model in the second, and three teams' requests."""
    ledger.ingest(
        batch("gpu_samples", gpu_samples(start=month_start + 3600, seconds=7200)), now=DEC
    )
    ledger.ingest(
        batch(
            "gpu_samples",
            gpu_samples(start=month_start + 7200, seconds=1800, gpu_model="H100", gpu="1"),
        ),
        now=DEC,
    )
    records = [
        usage("search", month_start + 3700, 300),
        usage("assistant", month_start + 3800, 600),
        usage("search", month_start + 7300, 900),
        usage("research", month_start + 8000, 1200),
    ]
    ledger.ingest(batch("usage", records), now=DEC)


def test_closing_freezes_hourly_rows_that_add_up_to_the_statement(ledger, config):
    """Cost per hour and group, usage per hour, team and model, and reconciliation per hour are
    frozen at close; cost and each team's usage add up to the statement to the cent."""
    _fill(ledger, OCT)
    closed = Chargeback(ledger, config).close("2026-10", now=AFTER_OCT)
    hours = closing.issued_hours(ledger, "2026-10", TABLES)
    assert hours is not None
    cost, used, reconciled, _ = hours
    assert closed.total_cents > 0
    assert int(cost["total_cents"].sum()) == closed.total_cents
    first, after = closed_hours.month_hours("2026-10")
    assert set(cost["hour"]) <= set(range(first, after))
    assert cost["hour"].n_unique() >= 2
    assert {"L40S", "H100"} <= set(cost["gpu_model"])
    assert set(cost["month"]) == set(used["month"]) == {"2026-10"}
    line = closed.lines.group_by("team").agg(pl.col("total_cents").sum(), pl.col("requests").sum())
    per_team = used.group_by("team").agg(pl.col("total_cents").sum(), pl.col("requests").sum())
    for team in ("search", "assistant", "research"):
        want = line.filter(pl.col("team") == team).row(0, named=True)
        got = per_team.filter(pl.col("team") == team).row(0, named=True)
        assert (got["total_cents"], got["requests"]) == (want["total_cents"], want["requests"])
    assert used.filter(pl.col("team") == "search")["hour"].n_unique() == 2
    assert reconciled.height > 0
    assert set(reconciled["replica"]) == {"small-0"}


def test_the_hours_of_a_month_with_adjustments_carry_its_own_lines_only(ledger, config):
    """November's hourly cost adds up to its lines for November; October's late record is an
    adjustment charged to October, whose hours were frozen with it."""
    cb = Chargeback(ledger, config)
    _fill(ledger, OCT)
    cb.close("2026-10", now=AFTER_OCT)
    ledger.ingest(batch("usage", [usage("analytics", OCT + 4000, 900)]), now=AFTER_OCT)
    _fill(ledger, NOV)
    nov = cb.close("2026-11", now=DEC + 86400)
    assert nov.lines.filter(pl.col("for_month") == "2026-10").height > 0
    hours = closing.issued_hours(ledger, "2026-11", TABLES)
    assert hours is not None
    own = nov.lines.filter(pl.col("for_month") == "2026-11")["total_cents"].sum()
    assert int(hours[0]["total_cents"].sum()) == own
    assert "analytics" not in set(hours[1]["team"])


def test_lifetimes_are_frozen_per_hour_and_group(ledger, config):
    """Two pods of small-0: one from 01:30 stopping at 02:15, one from 02:00 that never says
    stop and was last heard at 03:30; per hour, how many were alive, started, stopped or ended
    without a stop, and their instance-hours within it."""
    h = OCT + 3600  # 01:00
    events = [
        instance_event("pod-a", "start", h + 1800, h + 1800),
        instance_event("pod-a", "stop", h + 4500, h + 1800),
        instance_event("pod-b", "start", h + 3600, h + 3600),
        instance_event("pod-b", "heartbeat", h + 9000, h + 3600),
    ]
    ledger.ingest(batch("instances", events), now=DEC)
    _fill(ledger, OCT)
    Chargeback(ledger, config).close("2026-10", now=AFTER_OCT)
    hours = closing.issued_hours(ledger, "2026-10", TABLES)
    assert hours is not None
    lived = hours[3].filter(pl.col("replica") == "small-0").sort("hour")
    first = int(h // 3600)
    got = [
        (r["hour"] - first, r["instances"], r["started"], r["stopped"], r["ended_without_stop"])
        for r in lived.iter_rows(named=True)
    ]
    assert got == [(0, 1, 1, 0, 0), (1, 2, 1, 1, 0), (2, 1, 0, 0, 1)]
    assert lived["instance_hours"].to_list() == pytest.approx([0.5, 1.25, 0.5])
    assert lived["gpu_hours"].to_list() == pytest.approx([0.5, 1.25, 0.5])


def test_a_month_closed_without_hours_has_none(ledger, config):
    """A month frozen before hourly rows were kept reads as None, not as an empty month."""
    _fill(ledger, OCT)
    statement = Chargeback(ledger, config).statement("2026-10")
    closing.freeze(ledger, "2026-10", statement.lines, [], AFTER_OCT)
    assert closing.issued_hours(ledger, "2026-10", TABLES) is None


def _cost_rows(usd: list[float]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "hour": list(range(len(usd))),
            "replica": ["r"] * len(usd),
            "gpu_model": ["L40S"] * len(usd),
            "gpu_hours": [1.0] * len(usd),
            "energy_kwh": [0.1] * len(usd),
            "usd": usd,
        },
        schema={
            "hour": pl.Int64,
            "replica": pl.String,
            "gpu_model": pl.String,
            "gpu_hours": pl.Float64,
            "energy_kwh": pl.Float64,
            "usd": pl.Float64,
        },
    )


@pytest.mark.parametrize(
    ("usd", "total", "cents"),
    [
        ([1.0, 1.0, 1.0], 100, [34, 33, 33]),
        ([3.0, 1.0], 7, [5, 2]),
        ([0.0, 2.0], 5, [0, 5]),
    ],
)
def test_the_month_total_is_split_over_hours_by_their_cost(
    usd: list[float], total: int, cents: list[int]
) -> None:
    """Each hour's cents are its share of the measured cost, and they add up to the total."""
    out = closed_hours.cost_cents(_cost_rows(usd), total, 0)
    assert out["total_cents"].to_list() == cents


@pytest.mark.parametrize("usd", [[0.0, 0.0], []])
def test_a_total_no_hour_was_priced_for_is_a_row_of_its_own(usd: list[float]) -> None:
    """Money with no priced hour (unused commitments) is kept in the month's first hour, as
    group and GPU model ''."""
    first = closed_hours.month_hours("2026-10")[0]
    out = closed_hours.cost_cents(_cost_rows(usd), 42, first)
    assert out["total_cents"].sum() == 42
    assert out.row(-1, named=True) == {
        "hour": first,
        "replica": "",
        "gpu_model": "",
        "gpu_hours": 0.0,
        "energy_kwh": 0.0,
        "total_cents": 42,
    }


def test_a_team_line_is_split_over_its_hours() -> None:
    """A line's total goes to its hours by priced share, by requests where none was priced."""
    rows = pl.DataFrame(
        {
            "hour": [0, 1, 0, 1],
            "team": ["a", "a", "b", "b"],
            "model": ["m"] * 4,
            "requests": [1, 1, 1, 3],
            "prompt_tokens": [0] * 4,
            "completion_tokens": [0] * 4,
            "gpu_hours": [0.0] * 4,
            "usd": [1.0, 3.0, 0.0, 0.0],
        }
    )
    lines = pl.DataFrame({"team": ["a", "b"], "model": ["m", "m"], "total_cents": [8, 12]})
    out = closed_hours.usage_cents(rows, lines)
    assert out["total_cents"].to_list() == [2, 3, 6, 9]


@pytest.mark.parametrize("upkeep", [False, True])
def test_the_frozen_reconciliation_is_the_raw_records_one(ledger, config, upkeep):
    """Random requests on a fixed replica and two pods (several choices, hang-ups, late and
    repeated batches) and uneven engine reads: the reconciliation frozen per hour, group and
    model is the one read from every raw record and reading, summed the same way, whether the
    month's reconciliation was kept by the upkeep or is all stale at the close."""
    rng = random.Random(5)
    keep(ledger, "usage", random_records(rng, 6), rng)
    for instance in (None, "small-0-a", "small-0-b"):
        keep(ledger, "engine_samples", random_samples(rng, 6, instance), rng)
    ledger.ingest(batch("gpu_samples", gpu_samples(start=OCT, seconds=6 * 3600)), now=DEC)
    if upkeep:
        assert reconciliation_hours.refresh(ledger) >= 1
        keep(ledger, "usage", random_records(rng, 6), rng)  # and a stale suffix again
    Chargeback(ledger, config).close("2026-10", now=AFTER_OCT)
    hours = closing.issued_hours(ledger, "2026-10", TABLES)
    assert hours is not None
    frozen = hours[2]
    first, after = closed_hours.month_hours("2026-10")
    sql, values = reconciliation_sql(first, after)
    with ledger.reader() as cur:
        raw = cur.sql(sql, params=values).pl()
    keys = ["hour", "replica", "model"]
    counted = [c for c in frozen.columns if c not in ("month", *keys)]
    want = (
        raw.with_columns(
            (pl.col("t") // 3600).alias("hour"),
            pl.col("replica", "model").fill_null(""),
        )
        .group_by(keys)
        .agg(pl.col(counted).sum())
        .sort(keys)
    )
    assert want.height > 0
    assert want["engine_tokens"].sum() > 0
    got = frozen.sort(keys).select(keys + counted)
    assert got.equals(want.select(keys + counted).cast(dict(got.schema))), (got, want)
