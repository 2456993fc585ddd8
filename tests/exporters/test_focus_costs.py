"""FOCUS rows of node pools, commitments, prompt caching and projects, on the worked month.

The month and its hand-computed figures are in ``tests/exporters/month.py``.
"""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal
from pathlib import Path

import polars as pl
import pytest

from exporters.chargeback_csv import write_csv
from exporters.focus import FOCUS_1_2_MANDATORY, FOCUS_1_3_MANDATORY, focus_frame
from exporters.focus_lines import apportion
from infermeter.config import Config
from infermeter.statement import LINE_SCHEMA, Statement
from tests import focus_spec
from tests.exporters import month
from tests.focus_validator import focus_1_0_failures, known_versions


def _rows(statement: Statement, config: Config, version: str) -> list[dict[str, str]]:
    """The FOCUS ``version`` file of ``statement`` as a reader gets it."""
    return list(csv.DictReader(io.StringIO(write_csv(focus_frame(statement, config, version)))))


def _usd(text: str) -> Decimal:
    """A cost cell as the exact amount it says."""
    return Decimal(text)


@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_the_files_meet_the_specification_checks(pooled: Config, version: str) -> None:
    """Every row of the 1.2 and 1.3 files passes the checks transcribed from the specification."""
    assert focus_spec.spec_failures(_rows(month.statement(), pooled, version), version) == []


def test_the_1_3_file_carries_every_mandatory_column_of_1_3(pooled: Config) -> None:
    """The 23 mandatory FOCUS 1.3 columns are in the file, and none is empty but ChargeClass."""
    assert set(FOCUS_1_3_MANDATORY) == focus_spec.FOCUS_1_3_MANDATORY
    assert set(FOCUS_1_2_MANDATORY) == focus_spec.FOCUS_1_2_MANDATORY
    assert len(FOCUS_1_3_MANDATORY) == 23
    rows = _rows(month.statement(), pooled, "1.3")
    assert set(FOCUS_1_3_MANDATORY) <= set(rows[0])
    for row in rows:
        assert [c for c in FOCUS_1_3_MANDATORY if c != "ChargeClass" and row[c] == ""] == []
    assert {r["ServiceProviderName"] for r in rows} == {"infermeter"}
    assert {r["HostProviderName"] for r in rows} == {"infermeter"}


def test_the_1_0_file_of_pools_and_commitments_passes_the_reference_validator(
    pooled: Config, tmp_path: Path
) -> None:
    """focus-validator 1.0.0 accepts the Committed, Dynamic, Other and Unused rows."""
    path = tmp_path / "focus-1.0.csv"
    path.write_text(write_csv(focus_frame(month.statement(), pooled, "1.0")))
    checks, failures = focus_1_0_failures(path, tmp_path / "report.xml")
    assert checks > 100
    assert failures == []


def test_a_half_used_commitment_is_a_used_and_an_unused_row_adding_up_to_it(pooled: Config) -> None:
    """Used rows cost $720.00 (360 GPU-h at $2.00), the Unused row $720.00; together $1,440.00."""
    rows = _rows(month.statement(), pooled, "1.3")
    used = [r for r in rows if r["CommitmentDiscountStatus"] == "Used"]
    unused = [r for r in rows if r["CommitmentDiscountStatus"] == "Unused"]
    assert len(used) == 3
    assert len(unused) == 1
    used_cost = sum(_usd(r["BilledCost"]) for r in used)
    assert used_cost == Decimal("720.00")  # 48 000 + 16 000 + 8 000 cents
    (row,) = unused
    assert _usd(row["BilledCost"]) == _usd(row["EffectiveCost"]) == Decimal("720.00")
    assert used_cost + _usd(row["BilledCost"]) == Decimal("1440.00")  # committed_cents / 100
    assert Decimal(row["PricingQuantity"]) == Decimal("360")  # 720 committed - 360 used GPU-h
    assert (row["ConsumedQuantity"], row["ConsumedUnit"]) == ("", "")
    assert row["SubAccountId"] == "platform"
    assert row["ResourceId"] == "pool/reserved"
    assert row["SkuId"] == "gpu-h100-1y"  # the pool's price entry names it
    ids = {r["CommitmentDiscountId"] for r in (*used, row)}
    assert ids == {"infermeter/pools/reserved/commitment"}
    for r in (*used, row):
        assert r["PricingCategory"] == "Committed"
        assert (r["CommitmentDiscountCategory"], r["CommitmentDiscountUnit"]) == (
            "Usage",
            "GPU-Hours",
        )
    assert sum(Decimal(r["CommitmentDiscountQuantity"]) for r in used) == Decimal("360")


def test_the_platforms_unused_commitment_line_is_the_unused_row_not_a_second_one(
    pooled: Config,
) -> None:
    """A statement carrying the unused commitment as the platform's line gets no row from pools."""
    line = month.lines(
        [
            (
                "platform",
                "(unused commitment) reserved",
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                0.0,
                72000,
                0,
            )
        ]
    ).with_columns(
        compute_cents=pl.lit(0, dtype=pl.Int64), idle_cents=pl.lit(72000, dtype=pl.Int64)
    )
    lines = pl.concat([month.lines(month.ROWS), line])
    rows = _rows(month.statement(lines=lines), pooled, "1.3")
    (unused,) = [r for r in rows if r["CommitmentDiscountStatus"] == "Unused"]
    assert _usd(unused["BilledCost"]) == Decimal("720.00")
    assert Decimal(unused["PricingQuantity"]) == Decimal("360")  # from the pool's row
    assert unused["x_NodePool"] == "reserved"
    assert unused["SkuId"] == "gpu-h100-1y"  # the pool's, though the line names none
    assert sum(_usd(r["BilledCost"]) for r in rows) == Decimal("1471.00")  # 75 100 + 72 000 cents


def test_spot_is_dynamic_owned_is_other_and_neither_is_a_commitment(pooled: Config) -> None:
    """The spot pool's row is priced Dynamic, the owned pool's Other; a line of no pool Standard."""
    rows = {r["ResourceId"]: r for r in _rows(month.statement(), pooled, "1.3")}
    assert rows["large-0-spot"]["PricingCategory"] == "Dynamic"
    assert rows["large-0-own"]["PricingCategory"] == "Other"
    for resource in ("large-0-spot", "large-0-own"):
        assert rows[resource]["CommitmentDiscountId"] == ""
        assert rows[resource]["CommitmentDiscountStatus"] == ""
    # No SKU named for spot: a stable id from the pool; the unit price is the row's own.
    assert rows["large-0-spot"]["SkuId"] == "gpu-hours/spot"
    assert rows["large-0-spot"]["SkuPriceId"] == "gpu-hours/spot/spot/2026-11"
    assert Decimal(rows["large-0-spot"]["ListUnitPrice"]) == Decimal("1.2")  # $12.00 / 10 GPU-h
    plain = month.lines(
        [("search", "chat-small", None, None, None, None, None, None, None, 1.0, 390, 10)]
    )
    (row,) = _rows(month.statement(lines=plain, pools=month.pools().clear()), pooled, "1.3")
    assert (row["PricingCategory"], row["SkuId"]) == ("Standard", "gpu-inference/chat-small")


def test_cached_prompt_tokens_and_savings_are_on_the_teams_row(pooled: Config) -> None:
    """Search's 4,000 cached prompt tokens and $1.50 saved are on its row; others carry none."""
    rows = _rows(month.statement(), pooled, "1.2")
    by_team = {(r["x_Team"], r["ResourceId"], r["Tags"]): r for r in rows}
    search = [r for k, r in by_team.items() if k[0] == "search"]
    assert [(r["x_CachedPromptTokens"], r["x_CacheSavingsCost"]) for r in search] == [
        ("4000", "1.50")
    ]
    others = [r for r in rows if r["x_Team"] != "search"]
    assert {(r["x_CachedPromptTokens"], r["x_CacheSavingsCost"]) for r in others} == {("0", "0.00")}


def test_a_teams_two_projects_are_two_rows_with_their_tags(pooled: Config) -> None:
    """Assistant's projects alpha and beta are rows of their own, tagged and allocated to each."""
    rows = [r for r in _rows(month.statement(), pooled, "1.3") if r["x_Team"] == "assistant"]
    tags = sorted((json.loads(r["Tags"]) for r in rows), key=lambda t: t["project"])
    assert tags == [
        {
            "team": "assistant",
            "model": "chat-small",
            "replica_group": "small-0",
            "project": "alpha",
            "user": "u1",
        },
        {
            "team": "assistant",
            "model": "chat-small",
            "replica_group": "small-0",
            "project": "beta",
            "user": "u2",
        },
    ]
    assert sorted(r["AllocatedResourceId"] for r in rows) == [
        "assistant/chat-small/alpha/u1",
        "assistant/chat-small/beta/u2",
    ]
    assert sorted(_usd(r["BilledCost"]) for r in rows) == [Decimal("80.00"), Decimal("160.00")]


def test_rows_of_an_instance_are_its_cost_allocated_by_ratio(pooled: Config) -> None:
    """small-0-a's $720.00 is allocated 2/3 to search, 2/9 to alpha, 1/9 to beta (by cents)."""
    rows = [r for r in _rows(month.statement(), pooled, "1.3") if r["ResourceId"] == "small-0-a"]
    ratios = {
        r["AllocatedResourceId"]: json.loads(r["AllocatedMethodDetails"])["Elements"][0]
        for r in rows
    }
    assert ratios["search/chat-small"]["AllocatedRatio"] == pytest.approx(48000 / 72000)
    assert ratios["assistant/chat-small/alpha/u1"]["AllocatedRatio"] == pytest.approx(16000 / 72000)
    assert ratios["assistant/chat-small/beta/u2"]["AllocatedRatio"] == pytest.approx(8000 / 72000)
    assert {e["UsageUnit"] for e in ratios.values()} == {"GPU-Hours"}
    assert {r["AllocatedMethodId"] for r in rows} == {"infermeter/in_flight"}
    assert json.loads(rows[0]["AllocatedTags"]) == {"team": "search"}
    unused = [
        r
        for r in _rows(month.statement(), pooled, "1.3")
        if r["CommitmentDiscountStatus"] == "Unused"
    ]
    assert unused[0]["AllocatedMethodId"] == ""  # nobody's share: not an allocated charge


def test_on_the_allocation_basis_billed_is_the_lines_and_list_the_usage_basis(
    pooled: Config,
) -> None:
    """Billed cost is the invoice-scaled lines, list cost the usage basis split onto the rows."""
    # The invoice of ``reserved`` was 10 % below the price book: its rows are scaled by 0.9.
    scaled = [
        (*r[:10], round(r[10] * 0.9) if r[4] == "reserved" else r[10], r[11]) for r in month.ROWS
    ]
    # The usage basis, a line per team and model (not split): search 48 000, assistant 24 000,
    # research 3 100 cents.
    usage = pl.DataFrame(
        [
            {
                "month": month.MONTH,
                "for_month": month.MONTH,
                "team": t,
                "model": m,
                "requests": 10,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "gpu_hours": 0.0,
                "energy_kwh": 0.0,
                "compute_cents": c,
                "energy_cents": 0,
                "idle_cents": 0,
                "total_cents": c,
            }
            for t, m, c in (
                ("search", "chat-small", 48000),
                ("assistant", "chat-small", 24000),
                ("research", "chat-large", 3100),
            )
        ],
        schema=LINE_SCHEMA,
    )
    statement = month.statement(lines=month.lines(scaled), basis="allocation", usage_lines=usage)
    rows = [r for r in _rows(statement, pooled, "1.3") if r["CommitmentDiscountStatus"] != "Unused"]
    costs = sorted(
        (r["ResourceId"], r["Tags"], _usd(r["BilledCost"]), _usd(r["ListCost"])) for r in rows
    )
    # search: 48 000 x 0.9 = 43 200 billed, 48 000 listed; alpha and beta 14 400 and 7 200
    # billed, assistant's 24 000 listed split 2:1 = 16 000 and 8 000; research's pools were
    # not scaled: 1 200 and 1 900 on both bases, its 3 100 listed split 1 200 : 1 900.
    assert [(c[0], c[2], c[3]) for c in costs] == [
        ("large-0-own", Decimal("19.00"), Decimal("19.00")),
        ("large-0-spot", Decimal("12.00"), Decimal("12.00")),
        ("small-0-a", Decimal("144.00"), Decimal("160.00")),  # alpha
        ("small-0-a", Decimal("72.00"), Decimal("80.00")),  # beta
        ("small-0-a", Decimal("432.00"), Decimal("480.00")),  # search
    ]
    assert sum(c[2] for c in costs) * 100 == statement.total_cents == 67900
    assert sum(c[3] for c in costs) == Decimal("751.00")  # the usage basis's total
    for row in rows:
        assert row["ContractedCost"] == row["ListCost"]
        assert row["EffectiveCost"] == row["BilledCost"]
    assert focus_spec.spec_failures(_rows(statement, pooled, "1.3"), "1.3") == []


@pytest.mark.parametrize(
    ("total", "weights", "split"),
    [
        (10, [1, 1, 1], [4, 3, 3]),
        (-5, [1, 1], [-2, -3]),
        (7, [0, 0], [4, 3]),
        (100, [3, 1], [75, 25]),
        (1, [1, 2], [0, 1]),
    ],
)
def test_apportion_splits_whole_units_exactly(
    total: int, weights: list[int], split: list[int]
) -> None:
    """A total is split in whole units by largest remainder; the parts always add up to it."""
    rows = pl.DataFrame({"k": ["a"] * len(weights), "w": weights})
    out = apportion(rows, pl.DataFrame({"k": ["a"], "v": [total]}), ["k"], ["v"], pl.col("w"))
    assert out["v"].to_list() == split
    assert sum(split) == total


def test_the_reference_validator_knows_no_version_past_1_0() -> None:
    """focus-validator 1.0.0 has rules for 0.5 and 1.0 only: 1.2 and 1.3 are checked by focus_spec.

    When an upgrade brings rules for a later version, this fails: run the files through it.
    """
    assert known_versions() == {"0.5", "1.0-preview", "1.0"}
