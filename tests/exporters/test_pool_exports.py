"""The exports of a month whose GPU is in a committed node pool, from a real ledger through billing.

One L40S on node ``node-b`` is in pool ``reserved``: 1 GPU committed for November 2026 at $2.00 per
GPU-hour, power included (the pool's ``usd_per_kwh`` is 0). The commitment is 720 GPU-hours,
$1,440.00. The GPU runs one hour, serving search and assistant: $2.00 of the commitment used,
719 GPU-hours ($1,438.00) left unused; $2.00 + $1,438.00 = $1,440.00.
"""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from billing.chargeback import Chargeback
from billing.ledger import Ledger
from exporters.chargeback_csv import write_csv
from exporters.focus import focus_frame
from infermeter.config import Config, NodePool
from infermeter.statement import Statement
from launcher.cli import main
from tests import focus_spec
from tests.billing.conftest import NOV, batch, gpu_samples, usage
from tests.focus_validator import focus_1_0_failures


@pytest.fixture
def reserved(config: Config) -> Config:
    """The demo configuration with node-b in the committed pool ``reserved``."""
    pool = NodePool.model_validate(
        {
            "name": "reserved",
            "nodes": ["node-b"],
            "prices": [
                {
                    "from": "2026-11-01",
                    "category": "committed",
                    "usd_per_gpu_hour": 2.0,
                    "committed_gpus": 1,
                    "usd_per_kwh": 0.0,
                    "sku": "l40s-1y-commit",
                }
            ],
        }
    )
    return config.model_copy(update={"prices": config.prices.model_copy(update={"pools": [pool]})})


def _fill(ledger: Ledger) -> None:
    """The GPU's hour of November, and a request of search and one of assistant in it."""
    now = NOV + 20 * 86400
    ledger.ingest(batch("gpu_samples", gpu_samples(start=NOV + 3600, seconds=3600)), now=now)
    records = [usage("search", NOV + 3700, 300), usage("assistant", NOV + 3800, 600)]
    ledger.ingest(batch("usage", records), now=now)


def _month(ledger: Ledger, config: Config) -> Statement:
    """November's statement split by instance, as the FOCUS route reads it."""
    _fill(ledger)
    chargeback = Chargeback(ledger, config)
    return chargeback.by_instance(chargeback.statement("2026-11"))


def _rows(statement: Statement, config: Config, version: str) -> list[dict[str, str]]:
    """The FOCUS ``version`` file of ``statement`` as a reader gets it."""
    return list(csv.DictReader(io.StringIO(write_csv(focus_frame(statement, config, version)))))


def test_a_committed_pools_month_is_used_and_unused_rows_adding_up_to_the_commitment(
    ledger: Ledger, reserved: Config
) -> None:
    """$2.00 Used on the teams' rows and $1,438.00 Unused on the platform's: $1,440.00."""
    statement = _month(ledger, reserved)
    rows = _rows(statement, reserved, "1.3")
    assert focus_spec.spec_failures(rows, "1.3") == []
    used = [r for r in rows if r["CommitmentDiscountStatus"] == "Used"]
    (unused,) = [r for r in rows if r["CommitmentDiscountStatus"] == "Unused"]
    assert {r["x_Team"] for r in used} == {"search", "assistant"}
    assert {(r["PricingCategory"], r["SkuId"], r["x_NodePool"]) for r in used} == {
        ("Committed", "l40s-1y-commit", "reserved")
    }
    used_cost = sum(Decimal(r["BilledCost"]) for r in used)
    assert used_cost == Decimal("2.00")  # 1 GPU-hour at $2.00, idle included
    assert Decimal(unused["BilledCost"]) == Decimal("1438.00")  # 719 GPU-hours at $2.00
    assert Decimal(unused["PricingQuantity"]) == Decimal("719")
    assert used_cost + Decimal(unused["BilledCost"]) == Decimal("1440.00")
    assert (unused["SubAccountId"], unused["SkuId"]) == ("platform", "l40s-1y-commit")
    # The file is the statement, to the cent: the unused commitment is the platform's line.
    assert sum(Decimal(r["BilledCost"]) for r in rows) * 100 == statement.total_cents


def test_a_committed_pools_month_passes_the_reference_validator_in_1_0(
    ledger: Ledger, reserved: Config, tmp_path: Path
) -> None:
    """focus-validator 1.0.0 runs every check on the committed pool's 1.0 file; none fails."""
    path = tmp_path / "focus-1.0.csv"
    path.write_text(write_csv(focus_frame(_month(ledger, reserved), reserved, "1.0")))
    checks, failures = focus_1_0_failures(path, tmp_path / "report.xml")
    assert checks > 100
    assert failures == []


def test_the_chargeback_command_names_the_pool_in_the_csv(reserved: Config, tmp_path: Path) -> None:
    """`infermeter chargeback --format csv` with node pools writes a row per team, model and pool."""
    path = tmp_path / "ledger.duckdb"
    config_file = tmp_path / "fleet.yaml"
    config_file.write_text(yaml.safe_dump(reserved.model_dump(mode="json")))
    ledger = Ledger.open(path, [t.name for t in reserved.teams], {})
    _fill(ledger)
    ledger.close()
    out = tmp_path / "chargeback.csv"
    assert (
        main(
            [
                "chargeback",
                "--config",
                str(config_file),
                "--month",
                "2026-11",
                "--format",
                "csv",
                "--database",
                str(path),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    named = {
        (r["team"], r["pool"], r["pricing_category"]) for r in rows if r["line_type"] == "usage"
    }
    assert named == {
        ("search", "reserved", "committed"),
        ("assistant", "reserved", "committed"),
        ("platform", "reserved", "committed"),  # the unused commitment
    }
    assert {r["basis"] for r in rows} == {"list"}
    assert Decimal(rows[-1]["total_usd"]) == Decimal("1440.00")
