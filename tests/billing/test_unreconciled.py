"""Unreconciled: billed requests with no engine reading around them are reported, never silent."""

from __future__ import annotations

from typing import Any

import polars as pl
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from billing import reconciled
from billing.api import create_app
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.metrics import ReconciliationCollector
from billing.reconciliation import PENDING_SECONDS
from infermeter.config import Config
from infermeter.statement import statement_from_json
from tests.billing.conftest import OCT, usage
from tests.billing.test_reconciliation import HOUR, engine_samples, fill, row

# The engine served from 01:00:00; the collector first read it at 01:04:20.
FIRST_READ = OCT + HOUR + 260.0


def early_and_late() -> list[dict[str, Any]]:
    """80 requests of 2 s, one every 3 s from 01:00:00 (before the first reading), then 10 more."""
    early = [usage("search", OCT + HOUR + 3.0 * i, 2.0) for i in range(80)]
    late = [usage("search", OCT + HOUR + 600.0 + 60.0 * i, 10.0) for i in range(10)]
    return early + late


def read_from(
    records: list[dict[str, Any]], start: float, end: float = OCT + 3 * HOUR, **kw: Any
) -> list[dict[str, Any]]:
    """The engine's counters for ``records``, read every 60 s from ``start`` on."""
    return engine_samples(records, start - 60.0, end, **kw)


def test_requests_before_the_first_reading_are_unreconciled(ledger: Ledger) -> None:
    """The 80 requests served before the collector first read the engine: their count and tokens."""
    records = early_and_late()
    fill(ledger, records, read_from(records, FIRST_READ))
    one = row(reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR), 1)
    assert one["unreconciled_requests"] == 80
    assert (one["unreconciled_prompt_tokens"], one["unreconciled_completion_tokens"]) == (
        8000,
        4000,
    )
    assert one["unreconciled_tokens"] == 12000
    # The rest reconciles exactly: the early requests are in neither side.
    assert (one["engine_tokens"], one["ledger_tokens"], one["difference_tokens"]) == (1500, 1500, 0)


def test_a_request_across_the_first_reading_is_unreconciled_up_to_it(ledger: Ledger) -> None:
    """A stream across the first reading: its prompt and its completion before it are unreconciled."""
    across = usage("search", FIRST_READ - 6.0, 11.0, first_token_at=FIRST_READ - 5.0)  # 5 s of 10
    fill(ledger, [across], read_from([across], FIRST_READ))
    one = row(reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR), 1)
    assert (one["unreconciled_requests"], one["unreconciled_prompt_tokens"]) == (1, 100)
    assert one["unreconciled_completion_tokens"] == 25
    assert (one["ledger_completion_tokens"], one["difference_tokens"]) == (25, 0)


def test_an_instance_never_read_is_unreconciled_whole(ledger: Ledger) -> None:
    """Records of a pod the collector never read: a row of their own, with no engine tokens."""
    read = [usage("search", OCT + HOUR + 60.0 * i, 10.0, instance="small-0-a") for i in range(5)]
    unread = [
        usage("search", OCT + HOUR + 60.0 * i + 5, 10.0, instance="small-0-b") for i in range(3)
    ]
    fill(ledger, read + unread, engine_samples(read, OCT, OCT + 3 * HOUR, instance="small-0-a"))
    frame = reconciled.reconciled(ledger, OCT + HOUR, OCT + 2 * HOUR)
    assert frame.select(
        "instance",
        "replica",
        "model",
        "engine_tokens",
        "ledger_tokens",
        "unreconciled_requests",
        "unreconciled_tokens",
    ).rows() == [
        ("small-0-a", "small-0", "chat-small", 750, 750, 0, 0),
        ("small-0-b", "small-0", "chat-small", 0, 0, 3, 450),
    ]


def test_records_after_an_instance_stopped_being_read_are_unreconciled(ledger: Ledger) -> None:
    """Pod b is last read at 01:20 while pod a is read all hour: b's later requests are unreconciled."""
    a = [usage("search", OCT + HOUR + 60.0 * i, 10.0, instance="small-0-a") for i in range(50)]
    b = [usage("search", OCT + HOUR + 120.0 * i + 5, 10.0, instance="small-0-b") for i in range(25)]
    stop = OCT + HOUR + 1200.0
    engine = engine_samples(a, OCT, OCT + 3 * HOUR, instance="small-0-a")
    engine += engine_samples(b, OCT, stop, instance="small-0-b")
    fill(ledger, a + b, engine)
    frame = reconciled.reconciled(ledger, OCT + HOUR, OCT + 2 * HOUR).filter(
        pl.col("instance") == "small-0-b"
    )
    after = [r for r in b if r["first_token_at"] > stop]
    assert frame["unreconciled_requests"].to_list() == [len(after)]
    assert frame["unreconciled_tokens"].to_list() == [150 * len(after)]
    assert frame["difference_tokens"].to_list() == [0]


def test_records_after_the_last_reading_wait_while_the_fleet_is_not_read(ledger: Ledger) -> None:
    """No engine read since: the newest records wait for the next reading, nothing is unreconciled."""
    records = [usage("search", OCT + HOUR + 60.0 * i + 5, 10.0) for i in range(30)]
    last = OCT + HOUR + 1500.0
    fill(ledger, records, engine_samples(records, OCT, last))
    one = row(reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR), 1)
    waiting = [r for r in records if r["first_token_at"] > last]
    assert waiting
    assert (one["unreconciled_requests"], one["ledger_tokens"]) == (0, 150 * (30 - len(waiting)))
    assert PENDING_SECONDS == 600


def test_records_after_the_hour_read_in_the_next_are_not_unreconciled(ledger: Ledger) -> None:
    """Hour 1 asked alone: requests after its last reading are reconciled in hour 2, not missed."""
    records = [usage("search", OCT + HOUR + 60.0 * i + 30, 10.0) for i in range(60)]
    fill(ledger, records, engine_samples(records, OCT, OCT + 3 * HOUR))
    one = row(reconciled.reconciled(ledger, OCT + HOUR, OCT + 2 * HOUR), 1)
    assert one["unreconciled_requests"] == 0


def test_the_statement_the_api_and_metrics_report_them(ledger: Ledger, config: Config) -> None:
    """The month's statement carries them per group; the admin's JSON and /metrics show them."""
    records = early_and_late()
    fill(ledger, records, read_from(records, FIRST_READ))
    statement = Chargeback(ledger, config).statement("2026-10")
    expected = [
        {
            "replica": "small-0",
            "model": "chat-small",
            "requests": 80,
            "prompt_tokens": 8000,
            "completion_tokens": 4000,
        }
    ]
    assert statement.unreconciled.to_dicts() == expected
    assert statement.reconciles
    # Billed all the same: the team's line has all 90 requests.
    search = statement.lines.filter(pl.col("team") == "search")
    assert search.select("requests", "prompt_tokens").rows() == [(90, 9000)]
    with TestClient(create_app(config, ledger)) as client:
        admin = client.get(
            "/v1/chargeback/2026-10", headers={"authorization": "Bearer im-demo-admin"}
        )
        team = client.get(
            "/v1/chargeback/2026-10", headers={"authorization": "Bearer im-demo-search"}
        )
    assert admin.json()["unreconciled"] == expected
    assert statement_from_json(admin.json()).unreconciled.to_dicts() == expected
    assert "unreconciled" not in team.json()
    registry = CollectorRegistry()
    registry.register(ReconciliationCollector(ledger, clock=lambda: OCT + 2 * HOUR + 60))
    group = {"replica": "small-0", "model": "chat-small"}
    assert (
        registry.get_sample_value("infermeter_reconciliation_unreconciled_tokens", group) == 12000
    )
    assert registry.get_sample_value("infermeter_reconciliation_unreconciled_requests", group) == 80
