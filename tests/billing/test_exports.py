"""Chargeback exports: FOCUS 1.0 accepted by the reference validator, FOCUS 1.2 by its spec."""

from __future__ import annotations

import csv
import io
import re

import polars as pl
import pytest

from billing.chargeback import Chargeback
from billing.ledger import Ledger
from exporters.chargeback_csv import chargeback_frame, defuse, write_csv
from exporters.focus import FOCUS_1_2_MANDATORY, focus_frame
from infermeter.cli import main
from infermeter.config import Config
from infermeter.statement import Statement
from tests.billing.conftest import NOV, OCT, batch, gpu_samples, usage
from tests.focus_validator import focus_1_0_failures

UTC_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


def _statement(ledger: Ledger, config: Config) -> Statement:
    """November with two teams, plus an adjustment for a late record of closed October."""
    for start in (OCT, NOV):
        ledger.ingest(
            batch("gpu_samples", gpu_samples(start=start + 3600, seconds=3600)),
            now=NOV + 20 * 86400,
        )
        ledger.ingest(batch("usage", [usage("search", start + 3700, 300), usage("assistant", start + 3800, 600)]),
                      now=NOV + 20 * 86400)  # fmt: skip
    cb = Chargeback(ledger, config)
    cb.close("2026-10", now=NOV + 86400)
    ledger.ingest(batch("usage", [usage("research", OCT + 4000, 900)]), now=NOV + 2 * 86400)
    return cb.statement("2026-11")


def test_focus_1_0_is_accepted_by_the_reference_validator(ledger, config, tmp_path):
    """focus-validator 1.0.0 runs every FOCUS 1.0 check on the file; none fails."""
    statement = _statement(ledger, config)
    path = tmp_path / "focus-1.0.csv"
    path.write_text(write_csv(focus_frame(statement, config, "1.0")))
    checks, failures = focus_1_0_failures(path, tmp_path / "focus-report.xml")
    assert checks > 100
    assert failures == []


def test_focus_1_2_has_the_mandatory_columns_and_allowed_values(ledger, config):
    """The 21 mandatory FOCUS 1.2 columns, UTC dates with Z, the spec's values, x_ extras."""
    statement = _statement(ledger, config)
    frame = focus_frame(statement, config, "1.2")
    rows = list(csv.DictReader(io.StringIO(write_csv(frame))))
    assert set(FOCUS_1_2_MANDATORY) <= set(rows[0])
    assert len(FOCUS_1_2_MANDATORY) == 21
    for row in rows:
        for column in (
            "BillingPeriodStart",
            "BillingPeriodEnd",
            "ChargePeriodStart",
            "ChargePeriodEnd",
        ):
            assert UTC_Z.match(row[column]), (column, row[column])
        assert row["ServiceCategory"] == "AI and Machine Learning"
        assert row["ChargeCategory"] == "Usage"
        assert row["ChargeClass"] in ("", "Correction")
        assert row["BillingCurrency"] == "USD"
        for column in FOCUS_1_2_MANDATORY:
            if column != "ChargeClass":
                assert row[column] != "", column
    custom = [c for c in rows[0] if c.startswith("x_")]
    assert {"x_Team", "x_Model", "x_PromptTokens", "x_CompletionTokens", "x_EnergyKWh"} <= set(
        custom
    )
    non_focus = set(rows[0]) - set(custom) - {
        *FOCUS_1_2_MANDATORY, "AvailabilityZone", "ChargeFrequency", "CommitmentDiscountCategory",
        "CommitmentDiscountId", "CommitmentDiscountName", "CommitmentDiscountStatus",
        "CommitmentDiscountType", "ConsumedQuantity", "ConsumedUnit", "ContractedUnitPrice",
        "ListUnitPrice", "PricingCategory", "RegionId", "RegionName", "ResourceId", "ResourceName",
        "ResourceType", "SkuId", "SkuPriceId", "SubAccountId", "SubAccountName", "Tags",
        "ServiceSubcategory", "InvoiceId", "BillingAccountType", "SubAccountType",
    }  # fmt: skip
    assert non_focus == set()


def test_focus_rows_carry_the_statement_to_the_cent(ledger, config):
    """BilledCost adds up to the statement; the late October record is a Correction row."""
    statement = _statement(ledger, config)
    frame = focus_frame(statement, config, "1.2")
    assert round(frame["BilledCost"].sum() * 100) == statement.total_cents
    corrections = frame.filter(pl.col("ChargeClass") == "Correction")
    assert "research" in corrections["x_Team"].to_list()
    assert set(corrections["ChargePeriodStart"]) == {"2026-10-01T00:00:00Z"}


@pytest.mark.parametrize("value", ["=1+2", "+1", "-1+1", "@SUM(A1)", "\tx", "\rx"])
def test_formula_like_cells_are_defused(value):
    """A cell a spreadsheet would evaluate gets a leading apostrophe; others are untouched."""
    frame = pl.DataFrame({"team": [value, "search"]}).with_columns(defuse("team"))
    assert frame["team"].to_list() == ["'" + value, "search"]


def test_chargeback_csv_lists_adjustments_after_usage(ledger, config):
    """Usage lines come first; October's correction is an adjustment line for_month 2026-10."""
    statement = _statement(ledger, config)
    frame = chargeback_frame(statement, {t.name: t.budget_usd_per_month for t in config.teams})
    types = frame["line_type"].to_list()
    assert types == sorted(types, reverse=True)
    adjustments = frame.filter(pl.col("line_type") == "adjustment")
    assert set(adjustments["for_month"]) == {"2026-10"}
    assert frame.filter(pl.col("team") == "search")["budget_usd"].to_list()[0] == 6000


@pytest.mark.parametrize(
    ("fmt", "version", "header"),
    [("csv", "1.0", "month,team,model"), ("focus", "1.2", "BilledCost,")],
)
def test_the_chargeback_command_writes_from_a_ledger_file(
    tmp_path, config, fmt, version, header, capsys
):
    """`infermeter chargeback --database` computes the statement and writes the file."""
    path = tmp_path / "ledger.duckdb"
    ledger = Ledger.open(path, [t.name for t in config.teams], {})
    _statement(ledger, config)
    ledger.close()
    out = tmp_path / f"out.{fmt}.csv"
    code = main(["chargeback", "--month", "2026-11", "--format", fmt, "--focus-version", version,
                 "--database", str(path), "--out", str(out)])  # fmt: skip
    assert code == 0
    assert out.read_text().startswith(header)


def test_the_chargeback_command_names_a_bad_month(tmp_path, capsys):
    """A month that is not YYYY-MM is a one-line error."""
    with pytest.raises(ValueError, match="month '2026-13' is not of the form YYYY-MM"):
        main(["chargeback", "--month", "2026-13", "--database", str(tmp_path / "x.duckdb")])


def _pods(ledger: Ledger, config: Config) -> Chargeback:
    """November: group small-0 served by two pods, each with its GPU; search on one, assistant on both."""
    for pod, gpu in (("small-0-a", "0"), ("small-0-b", "1")):
        samples = [
            {**s, "instance": pod} for s in gpu_samples(start=NOV + 3600, seconds=3600, gpu=gpu)
        ]
        ledger.ingest(batch("gpu_samples", samples), now=NOV + 20 * 86400)
    ledger.ingest(batch("usage", [usage("search", NOV + 3700, 300, instance="small-0-a"),
                                  usage("assistant", NOV + 3800, 600, instance="small-0-a"),
                                  usage("assistant", NOV + 3800, 900, instance="small-0-b")]),
                  now=NOV + 20 * 86400)  # fmt: skip
    return Chargeback(ledger, config)


def test_focus_rows_are_instances_grouped_by_replica_group(ledger, config, tmp_path):
    """ResourceId is the pod that served the line, x_ReplicaGroup its group; the cents still add up."""
    cb = _pods(ledger, config)
    statement = cb.by_instance(cb.statement("2026-11"))
    frame = focus_frame(statement, config, "1.2")
    rows = {(r["x_Team"], r["ResourceId"]): r for r in frame.iter_rows(named=True)}
    assert set(rows) == {("search", "small-0-a"), ("assistant", "small-0-a"),
                         ("assistant", "small-0-b")}  # fmt: skip
    assert {r["x_ReplicaGroup"] for r in rows.values()} == {"small-0"}
    assert rows[("assistant", "small-0-b")]["ResourceType"] == "LLM Inference Instance"
    assert '"replica_group":"small-0"' in rows[("search", "small-0-a")]["Tags"]
    assert round(frame["BilledCost"].sum() * 100) == statement.total_cents == statement.fleet_cents
    path = tmp_path / "focus-1.0.csv"
    path.write_text(write_csv(focus_frame(statement, config, "1.0")))
    assert focus_1_0_failures(path, tmp_path / "focus-report.xml")[1] == []


def test_lines_split_by_instance_add_up_to_each_line(ledger, config):
    """Every line's cents, requests and tokens are its instance rows' sum, adjustments included."""
    statement = _statement(ledger, config)
    split = Chargeback(ledger, config).by_instance(statement)
    keys = ["for_month", "team", "model"]
    columns = ["requests", "prompt_tokens", "completion_tokens", "compute_cents", "energy_cents",
               "idle_cents", "total_cents"]  # fmt: skip
    summed = split.lines.group_by(keys).agg(pl.col(columns).sum()).sort(keys)
    assert summed.equals(statement.lines.select(*keys, *columns).sort(keys))
    adjustments = split.lines.filter(pl.col("for_month") == "2026-10")
    assert adjustments["total_cents"].to_list() != [0] * adjustments.height
    assert set(split.lines["instance"]) == {"small-0"}
