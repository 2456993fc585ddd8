"""Exports fed hostile or degenerate statements: formula cells, JSON tags, all-zero months."""

from __future__ import annotations

import csv
import io
import json

import polars as pl
import pytest

from billing.chargeback import Chargeback
from billing.ledger import Ledger
from exporters.chargeback_csv import chargeback_frame, defuse, write_csv
from exporters.focus import focus_frame
from infermeter.config import Config
from infermeter.statement import Statement
from tests.billing.conftest import OCT, batch, gpu_samples, usage
from tests.focus_validator import focus_1_0_failures

# The FOCUS columns whose type is Decimal, in every version the product writes.
DECIMAL_COLUMNS = (
    "BilledCost",
    "ContractedCost",
    "EffectiveCost",
    "ListCost",
    "PricingQuantity",
    "ConsumedQuantity",
    "ContractedUnitPrice",
    "ListUnitPrice",
)


def _month(ledger: Ledger, config: Config, kind: str) -> Statement:
    """October 2026 as one of the degenerate statements an export must still get right."""
    if kind == "all-zero":
        # Requests but no GPU seen: every line costs nothing.
        records = [usage("search", OCT + 3600, 60), usage("assistant", OCT + 3700, 60)]
        ledger.ingest(batch("usage", records), now=OCT + 86400)
    else:
        # One team holding the one GPU for exactly one hour: whole GPU-hours.
        ledger.ingest(batch("gpu_samples", gpu_samples(start=OCT, seconds=3600)), now=OCT + 86400)
        ledger.ingest(batch("usage", [usage("search", OCT, 3600)]), now=OCT + 86400)
    return Chargeback(ledger, config).statement("2026-10")


@pytest.mark.parametrize("kind", ["all-zero", "single-line"])
def test_degenerate_months_pass_the_reference_focus_validator(ledger, config, tmp_path, kind):
    """A month of zero costs, and a month of one line, pass every FOCUS 1.0 check."""
    statement = _month(ledger, config, kind)
    assert statement.lines.height == (2 if kind == "all-zero" else 1)
    path = tmp_path / "focus-1.0.csv"
    path.write_text(write_csv(focus_frame(statement, config, "1.0")))
    checks, failures = focus_1_0_failures(path, tmp_path / "focus-report.xml")
    assert checks > 100
    assert failures == []


@pytest.mark.parametrize("version", ["1.0", "1.2", "1.3"])
@pytest.mark.parametrize("kind", ["all-zero", "single-line"])
def test_decimal_columns_are_written_as_decimals(ledger, config, kind, version):
    """Every Decimal column holds a number with a decimal point (or nothing), never ``0``."""
    statement = _month(ledger, config, kind)
    rows = list(csv.DictReader(io.StringIO(write_csv(focus_frame(statement, config, version)))))
    for row in rows:
        for column in DECIMAL_COLUMNS:
            value = row[column]
            assert value == "" or ("." in value and float(value) >= 0), (column, value)


@pytest.mark.parametrize(
    "model",
    ['say "hi"', "back\\slash", 'x", "team": "admin', "line\nfeed", "tab\there", "émoji 🚀"],
)
def test_focus_tags_are_json_whatever_the_model_is_called(config, model):
    """Tags is a JSON object naming the line's team and model, for any model name."""
    lines = pl.DataFrame(
        {
            "month": ["2026-10"],
            "for_month": ["2026-10"],
            "team": ["search"],
            "model": [model],
            "requests": [1],
            "prompt_tokens": [1],
            "completion_tokens": [1],
            "gpu_hours": [0.5],
            "energy_kwh": [0.1],
            "compute_cents": [80],
            "energy_cents": [2],
            "idle_cents": [0],
            "total_cents": [82],
        }
    )
    statement = Statement("2026-10", False, lines, 82, 0)
    for version in ("1.0", "1.2", "1.3"):
        frame = focus_frame(statement, config, version)
        assert json.loads(frame["Tags"][0]) == {"team": "search", "model": model}


@pytest.mark.parametrize(
    ("cell", "defused"),
    [
        ("=1+2", True),
        ("+1", True),
        ("-1+1", True),
        ("@SUM(A1)", True),
        ("\tx", True),
        ("\rx", True),
        ("\n=1+2", True),
        ("\r\n=1+2", True),
        (" =1+2", True),
        ("   +1", True),
        ("\u00a0=1", True),  # no-break space
        ("\u3000=1", True),  # ideographic space
        ("\uff1d1+2", True),  # full-width =
        ("\uff0b1", True),  # full-width +
        ("\uff0d1", True),  # full-width -
        ("\uff20SUM(A1)", True),  # full-width @
        ("\ufe661", True),  # small =
        (" \t", True),
        ("search", False),
        ("chat-small", False),
        ("a=b", False),
        ("2026-10", False),
        (" search", False),
        ("\nsearch", False),
        ("", False),
        (None, False),
    ],
)
def test_formula_looking_cells_are_defused(cell, defused):
    """A cell whose first non-blank character (after NFKC) starts a formula gets an apostrophe."""
    frame = pl.DataFrame({"team": [cell]}, schema={"team": pl.String}).with_columns(defuse("team"))
    expected = ("'" + cell) if defused and cell is not None else cell
    assert frame["team"].to_list() == [expected]


def test_negative_numbers_stay_numbers_in_the_chargeback_csv():
    """A negative adjustment is written as a plain negative number, without an apostrophe."""
    lines = pl.DataFrame(
        {
            "month": ["2026-11"],
            "for_month": ["2026-10"],
            "team": ["-search"],
            "model": ["m"],
            "requests": [-2],
            "prompt_tokens": [-300],
            "completion_tokens": [-30],
            "gpu_hours": [-0.25],
            "energy_kwh": [-0.05],
            "compute_cents": [-40],
            "energy_cents": [-1],
            "idle_cents": [-5],
            "total_cents": [-46],
        }
    )
    statement = Statement("2026-11", False, lines, 0, -46)
    rows = list(
        csv.DictReader(io.StringIO(write_csv(chargeback_frame(statement, {"-search": 10.0}))))
    )
    row = rows[0]
    assert row["team"] == "'-search"
    assert (
        row["requests"],
        row["gpu_hours"],
        row["total_usd"],
        row["team_budget_used_percent"],
    ) == (
        "-2",
        "-0.25",
        "-0.46",
        "-4.6",
    )
