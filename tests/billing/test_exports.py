"""Chargeback exports: FOCUS 1.0 passes the reference validator, 1.2 and 1.3 the spec's checks."""

from __future__ import annotations

import csv
import io
from dataclasses import replace
from typing import Any

import polars as pl
import pytest

from billing import allocation
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from exporters.chargeback_csv import chargeback_frame, defuse, write_csv
from exporters.focus import focus_frame
from infermeter.config import Config
from infermeter.months import month_of
from infermeter.statement import Statement
from launcher.cli import main
from tests import focus_spec
from tests.billing.conftest import NOV, OCT, batch, gpu_samples, usage
from tests.focus_validator import focus_1_0_failures


def _statement(ledger: Ledger, config: Config) -> Statement:
    """November with two teams, plus an adjustment for a late record of closed October."""
    for start in (OCT, NOV):
        ledger.ingest(
            batch("gpu_samples", gpu_samples(start=start + 3600, seconds=3600)),
            now=NOV + 20 * 86400,
        )
        ledger.ingest(
            batch(
                "usage", [usage("search", start + 3700, 300), usage("assistant", start + 3800, 600)]
            ),
            now=NOV + 20 * 86400,
        )
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


@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_focus_1_2_and_1_3_have_the_mandatory_columns_and_allowed_values(
    ledger: Ledger, config: Config, version: str
) -> None:
    """The mandatory columns, UTC dates with Z, the spec's values, x_ extras (focus_spec's checks)."""
    statement = _statement(ledger, config)
    frame = focus_frame(statement, config, version)
    rows = list(csv.DictReader(io.StringIO(write_csv(frame))))
    assert focus_spec.spec_failures(rows, version) == []
    assert set(focus_spec.MANDATORY[version]) <= set(rows[0])
    for row in rows:
        assert row["ServiceCategory"] == "AI and Machine Learning"
        assert row["ChargeCategory"] == "Usage"
        assert row["ChargeClass"] in ("", "Correction")
        assert row["BillingCurrency"] == "USD"
        # Lines with no node pool are on-demand at the GPU model's price.
        assert row["PricingCategory"] == "Standard"
        assert row["CommitmentDiscountId"] == ""
    custom = [c for c in rows[0] if c.startswith("x_")]
    assert {"x_Team", "x_Model", "x_PromptTokens", "x_CompletionTokens", "x_EnergyKWh"} <= set(
        custom
    )


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
    *types, last = frame["line_type"].to_list()
    assert types == sorted(types, reverse=True)
    assert last == "total"
    adjustments = frame.filter(pl.col("line_type") == "adjustment")
    assert set(adjustments["for_month"]) == {"2026-10"}
    assert frame.filter(pl.col("team") == "search")["team_budget_usd"].to_list()[0] == 6000


def test_chargeback_csv_counts_each_budget_once_and_ends_with_the_total(ledger, config):
    """A team's budget is on its first line only; the last row sums every line and budget."""
    statement = _statement(ledger, config)
    budgets = {t.name: t.budget_usd_per_month for t in config.teams}
    frame = chargeback_frame(statement, budgets)
    lines, total = frame[:-1], frame.row(-1, named=True)
    teams = set(lines["team"])
    assert lines["team_budget_usd"].sum() == sum(budgets[t] for t in teams if budgets[t] > 0)
    for team in teams:
        own = lines.filter(pl.col("team") == team)
        assert own["team_budget_usd"].drop_nulls().len() == (1 if budgets[team] > 0 else 0)
    assert total["line_type"] == "total"
    assert (total["team"], total["model"], total["for_month"]) == (None, None, None)
    assert round(total["total_usd"] * 100) == statement.total_cents
    assert total["requests"] == lines["requests"].sum()
    assert total["team_budget_usd"] == lines["team_budget_usd"].sum()


def test_budget_used_is_a_percentage():
    """46 cents of a 10-dollar budget is written 4.6 (percent), on the team's first line."""
    lines = pl.DataFrame(
        {
            "month": ["2026-11"] * 2,
            "for_month": ["2026-11"] * 2,
            "team": ["search"] * 2,
            "model": ["a", "b"],
            "requests": [1, 1],
            "prompt_tokens": [1, 1],
            "completion_tokens": [1, 1],
            "gpu_hours": [0.1, 0.1],
            "energy_kwh": [0.0, 0.0],
            "compute_cents": [20, 20],
            "energy_cents": [0, 0],
            "idle_cents": [3, 3],
            "total_cents": [23, 23],
        }
    )
    frame = chargeback_frame(Statement("2026-11", False, lines, 46, 0), {"search": 10.0})
    assert frame["team_budget_used_percent"].to_list() == [4.6, None, 4.6]


@pytest.mark.parametrize(
    ("fmt", "version", "header"),
    [
        ("csv", "1.0", "month,team,model"),
        ("focus", "1.2", "BilledCost,"),
        ("focus", "1.3", "BilledCost,"),
    ],
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
    code = main(
        [
            "chargeback",
            "--month",
            "2026-11",
            "--format",
            fmt,
            "--focus-version",
            version,
            "--database",
            str(path),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert out.read_text().startswith(header)


def test_the_chargeback_command_names_a_bad_month(tmp_path, capsys):
    """A month that is not YYYY-MM is a one-line usage error, exit 2, and no file is opened."""
    with pytest.raises(SystemExit) as info:
        main(["chargeback", "--month", "2026-13", "--database", str(tmp_path / "x.duckdb")])
    assert info.value.code == 2
    assert "month '2026-13' is not of the form YYYY-MM" in capsys.readouterr().err
    assert not (tmp_path / "x.duckdb").exists()


def test_focus_unit_prices_come_from_unrounded_costs(config):
    """A line of a few GPU-seconds is priced at the book's rate, not at its cents over its hours."""
    lines = pl.DataFrame(
        {
            "month": ["2026-11"] * 2,
            "for_month": ["2026-11"] * 2,
            "team": ["search"] * 2,
            "model": [
                "chat-large",
                "(error) no price for GPU model B200 in prices.usd_per_gpu_hour",
            ],
            "requests": [1, 1],
            "prompt_tokens": [10, 10],
            "completion_tokens": [1, 1],
            "gpu_hours": [0.001, 0.5],
            "energy_kwh": [0.0005, 0.1],
            "compute_cents": [0, 0],
            "energy_cents": [0, 0],
            "idle_cents": [0, 0],
            "total_cents": [0, 0],
        }
    )
    frame = focus_frame(Statement("2026-11", False, lines, 0, 0), config, "1.2")
    rate = 3.90 + 0.0005 / 0.001 * 0.14 * 1.35  # H100 price + the line's energy per GPU-hour
    assert float(frame["ListUnitPrice"][0]) == pytest.approx(rate, abs=1e-6)
    assert float(frame["ContractedUnitPrice"][0]) == pytest.approx(rate, abs=1e-6)
    assert float(frame["ListUnitPrice"][1]) == 0  # a line that could not be priced costs nothing


def test_focus_unit_prices_times_quantity_give_the_billed_cost(ledger, config):
    """Unit price x GPU-hours is each line's billed cost to within the cent it was rounded to."""
    statement = _statement(ledger, config)
    frame = focus_frame(statement, config, "1.0").filter(pl.col("PricingQuantity") > 0)
    assert frame.height
    for price, quantity, billed in frame.select(
        "ListUnitPrice", "PricingQuantity", "BilledCost"
    ).iter_rows():
        assert float(price) * float(quantity) == pytest.approx(float(billed), abs=0.01)


def _pods(ledger: Ledger, config: Config) -> Chargeback:
    """November: group small-0 served by two pods, each with its GPU; search on one, assistant on both."""
    for pod, gpu in (("small-0-a", "0"), ("small-0-b", "1")):
        samples = [
            {**s, "instance": pod} for s in gpu_samples(start=NOV + 3600, seconds=3600, gpu=gpu)
        ]
        ledger.ingest(batch("gpu_samples", samples), now=NOV + 20 * 86400)
    ledger.ingest(
        batch(
            "usage",
            [
                usage("search", NOV + 3700, 300, instance="small-0-a"),
                usage("assistant", NOV + 3800, 600, instance="small-0-a"),
                usage("assistant", NOV + 3800, 900, instance="small-0-b"),
            ],
        ),
        now=NOV + 20 * 86400,
    )
    return Chargeback(ledger, config)


def test_focus_rows_are_instances_grouped_by_replica_group(ledger, config, tmp_path):
    """ResourceId is the pod that served the line, x_ReplicaGroup its group; the cents still add up."""
    cb = _pods(ledger, config)
    statement = cb.by_instance(cb.statement("2026-11"))
    frame = focus_frame(statement, config, "1.2")
    rows = {(r["x_Team"], r["ResourceId"]): r for r in frame.iter_rows(named=True)}
    assert set(rows) == {
        ("search", "small-0-a"),
        ("assistant", "small-0-a"),
        ("assistant", "small-0-b"),
    }
    assert {r["x_ReplicaGroup"] for r in rows.values()} == {"small-0"}
    assert rows[("assistant", "small-0-b")]["ResourceType"] == "LLM Inference Instance"
    assert '"replica_group":"small-0"' in rows[("search", "small-0-a")]["Tags"]
    assert round(frame["BilledCost"].sum() * 100) == statement.total_cents == statement.fleet_cents
    path = tmp_path / "focus-1.0.csv"
    path.write_text(write_csv(focus_frame(statement, config, "1.0")))
    assert focus_1_0_failures(path, tmp_path / "focus-report.xml")[1] == []
    # In 1.3 each row is a share of its instance's cost: the ratios of an instance add up to 1.
    shares = list(csv.DictReader(io.StringIO(write_csv(focus_frame(statement, config, "1.3")))))
    assert focus_spec.spec_failures(shares, "1.3") == []
    assert {r["AllocatedMethodId"] for r in shares} == {"infermeter/in_flight"}


def test_lines_split_by_instance_add_up_to_each_line(ledger, config):
    """Every line's cents, requests and tokens are its instance rows' sum, adjustments included."""
    statement = _statement(ledger, config)
    split = Chargeback(ledger, config).by_instance(statement)
    keys = ["for_month", "team", "model"]
    columns = [
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "compute_cents",
        "energy_cents",
        "idle_cents",
        "total_cents",
    ]
    summed = split.lines.group_by(keys).agg(pl.col(columns).sum()).sort(keys)
    assert summed.equals(statement.lines.select(*keys, *columns).sort(keys))
    adjustments = split.lines.filter(pl.col("for_month") == "2026-10")
    assert adjustments["total_cents"].to_list() != [0] * adjustments.height
    assert set(split.lines["instance"]) == {"small-0"}


def _counting_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every build of an allocation's priced queries (one per allocation run), by month."""
    builds: list[str] = []
    build = allocation.priced_sql_of

    def counted(*args: Any, **kwargs: Any) -> allocation.AllocationSql:
        builds.append(month_of(kwargs["period"][0]))
        return build(*args, **kwargs)

    monkeypatch.setattr(allocation, "priced_sql_of", counted)
    return builds


def test_a_statement_and_its_focus_file_run_the_allocation_once(ledger, config, monkeypatch):
    """An open month's statement and its FOCUS file split by instance cost one allocation run."""
    cb = _pods(ledger, config)
    builds = _counting_builds(monkeypatch)
    statement = cb.statement("2026-11")
    frame = focus_frame(cb.by_instance(statement), config, "1.2")
    assert builds == ["2026-11"]
    assert round(frame["BilledCost"].sum() * 100) == statement.total_cents


def test_a_statement_with_adjustments_runs_each_month_charged_once(ledger, config, monkeypatch):
    """With a late record of a closed month, the statement and its file run each month once."""
    statement = _statement(ledger, config)
    builds = _counting_builds(monkeypatch)
    cb = Chargeback(ledger, config)
    focus_frame(cb.by_instance(cb.statement("2026-11")), config, "1.2")
    assert sorted(builds) == ["2026-10", "2026-11"]
    assert statement.instance_parts is not None


def test_the_split_carried_by_a_statement_is_the_one_made_afresh(ledger, config):
    """A statement's own instance split gives the lines a fresh by-instance allocation gives."""
    statement = _statement(ledger, config)
    cb = Chargeback(ledger, config)
    carried = cb.by_instance(statement)
    afresh = cb.by_instance(replace(statement, instance_parts=None))
    assert carried.lines.equals(afresh.lines)
    assert carried.lines.height > statement.lines.height - 1
