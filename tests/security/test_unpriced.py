"""A GPU model with no price is an error line on the statement, never a month that cannot be billed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import polars as pl
import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing.api import create_app
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from exporters.chargeback_csv import chargeback_frame, write_csv
from exporters.focus import focus_frame
from infermeter.config import Config
from infermeter.months import month_bounds, month_of
from tests.billing.conftest import NOV, OCT, batch, gpu_samples, usage
from tests.servers import serving

METRICS, INGEST = "im-demo-metrics", "im-demo-ingest"


def _october(ledger: Ledger) -> None:
    """An hour of a priced L40S under small-0, and of an unpriced B200 on another node."""
    for samples in (
        gpu_samples(start=OCT + 3600, seconds=3600),
        gpu_samples(start=OCT + 3600, seconds=3600, gpu_model="B200", node="node-x"),
    ):
        ledger.ingest(batch("gpu_samples", samples), now=NOV)
    records = [usage("search", OCT + 3700, 300), usage("assistant", OCT + 3800, 600)]
    ledger.ingest(batch("usage", records), now=NOV)


def test_an_unpriced_gpu_model_is_a_zero_cost_platform_line_naming_it(ledger, config):
    """The month is billed; the B200's hour is a platform line at zero cost that says why."""
    _october(ledger)
    statement = Chargeback(ledger, config).statement("2026-10")
    errors = statement.lines.filter(pl.col("model").str.contains("B200"))
    assert errors.height == 1
    line = errors.row(0, named=True)
    assert line["team"] == config.billing.platform_account
    assert line["model"] == "(error) no price for GPU model B200 in prices.usd_per_gpu_hour"
    assert line["gpu_hours"] == pytest.approx(1.0)
    assert (line["compute_cents"], line["energy_cents"], line["idle_cents"]) == (0, 0, 0)
    assert line["total_cents"] == 0
    assert {"search", "assistant"} <= set(statement.lines["team"])


def test_a_month_with_an_unpriced_gpu_still_reconciles_and_closes(ledger, config):
    """Teams + idle + error lines add up to the fleet cost to the cent, and the month closes."""
    _october(ledger)
    cb = Chargeback(ledger, config)
    statement = cb.statement("2026-10")
    assert statement.fleet_cents == 164  # the L40S hour alone, as without the B200
    assert statement.reconciles
    assert int(statement.lines["total_cents"].sum()) == statement.fleet_cents
    closed = cb.close("2026-10", now=NOV + 86400)
    assert closed.closed
    assert closed.lines.equals(statement.lines)


def test_a_month_with_an_unpriced_gpu_exports(ledger, config):
    """The chargeback CSV and both FOCUS files carry the error line at zero cost."""
    _october(ledger)
    statement = Chargeback(ledger, config).statement("2026-10")
    csv_text = write_csv(chargeback_frame(statement, {}))
    assert "(error) no price for GPU model B200" in csv_text
    for version in ("1.0", "1.2"):
        frame = focus_frame(statement, config, version)
        error = frame.filter(pl.col("x_Model").str.starts_with("(error)"))
        assert error["BilledCost"].to_list() == [0]


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """The billing API over the in-memory ledger, on a loopback port."""
    async with serving(create_app(config, ledger), lifespan="off") as url:
        yield url


async def test_billing_metrics_count_the_error_lines_of_the_month(billing):
    """/metrics shows how many lines of this month's statement could not be priced."""
    now = time.time()
    start = max(month_bounds(month_of(now))[0], now - 900)
    samples = gpu_samples(start=start, seconds=300, gpu_model="B200", node="node-x") + gpu_samples(
        start=start, seconds=300, gpu_model="GB300", node="node-y"
    )
    async with httpx.AsyncClient(base_url=billing) as client:
        ingest = await client.post(
            "/v1/ingest",
            content=batch("gpu_samples", samples),
            headers={"authorization": f"Bearer {INGEST}"},
        )
        assert ingest.json()["rejected"] == []
        text = (await client.get("/metrics", headers={"authorization": f"Bearer {METRICS}"})).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples_out = families["infermeter_billing_statement_error_lines"].samples
    assert {s.labels["reason"]: s.value for s in samples_out} == {
        "unpriced_gpu_model": 2.0,
        "cost_out_of_range": 0.0,
        "unroundable": 0.0,
    }
