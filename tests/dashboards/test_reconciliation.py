"""The fleet page's reconciliation table, from billing's query over loopback."""

from __future__ import annotations

import polars as pl

from billing.ledger import Ledger
from dashboards.client import BillingClient
from dashboards.reconciliation import COLUMNS, summary, table
from infermeter.config import Config
from tests.billing.conftest import OCT
from tests.billing.test_reconciliation import HOUR, engine_samples, fill, requests
from tests.billing.test_reconciliation_example import example
from tests.dashboards.stack import billing_thread


def test_the_table_sums_each_group_over_the_range(config: Config) -> None:
    """Billing's instance-hours become one row per replica group with the unattributed share."""
    ledger = Ledger.open(":memory:", [t.name for t in config.teams], {})
    try:
        hour1, hour2 = requests(10, 1), requests(10, 2)
        fill(ledger, hour1[2:] + hour2, engine_samples(hour1 + hour2, OCT, OCT + 3 * HOUR))
        frame = _query(config, ledger)
    finally:
        ledger.close()
    assert frame.height == 2  # small-0 in hours 1 and 2
    rows = summary(frame).to_dicts()
    assert rows == [
        {
            "replica": "small-0",
            "model": "chat-small",
            "engine_tokens": 3000,
            "ledger_tokens": 2700,
            "hangup_tokens": 0,
            "unattributed_tokens": 300,
            "ledger_excess_tokens": 0,
            "unattributed_share": 0.1,
            "unreconciled_requests": 0,
            "unreconciled_tokens": 0,
        }
    ]
    shown = table(frame).children  # the table, in its scrolling wrapper
    assert getattr(shown, "id", None) == "fleet-reconciliation-table"


def test_the_columns_say_where_the_difference_went(config: Config) -> None:
    """docs/billing.md's example: engine - ledger = tails + unattributed - excess, and the
    requests before the first reading are unreconciled; no column repeats another."""
    ledger = Ledger.open(":memory:", [t.name for t in config.teams], {})
    try:
        records, engine = example()
        fill(ledger, records, engine)
        frame = _query(config, ledger)
    finally:
        ledger.close()
    [got] = summary(frame).to_dicts()
    assert got == {
        "replica": "small-0",
        "model": "chat-small",
        "engine_tokens": 578,
        "ledger_tokens": 420,
        "hangup_tokens": 8,
        "unattributed_tokens": 150,
        "ledger_excess_tokens": 0,
        "unattributed_share": 0.2595,
        "unreconciled_requests": 3,
        "unreconciled_tokens": 450,
    }
    engine_over_ledger = got["engine_tokens"] - got["ledger_tokens"]
    assert (
        engine_over_ledger
        == got["hangup_tokens"] + got["unattributed_tokens"] - got["ledger_excess_tokens"]
    )
    assert len(set(COLUMNS)) == len(COLUMNS)


def _query(config: Config, ledger: Ledger) -> pl.DataFrame:
    """Billing's reconciliation query for hours 1 and 2, as the dashboard asks it over loopback."""
    with billing_thread(config, ledger) as url:
        client = BillingClient(url)
        try:
            return client.query("im-demo-admin", "reconciliation", OCT + HOUR, OCT + 3 * HOUR)
        finally:
            client.close()


def test_an_empty_range_is_an_empty_table() -> None:
    """No instance-hours: the table has its columns and no rows."""
    empty = summary(pl.DataFrame(schema={"replica": pl.String}))
    assert (empty.columns, empty.height) == (list(COLUMNS), 0)
