"""The autoscaler's decisions as records: spooled on each change, shipped to a real billing service."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from alerts.autoscale.decisions import DecisionShipping, changed_from, decision_record
from alerts.autoscale.hooks import ScalingGauges
from alerts.autoscale.policy import Decision, ModelState, model_limits, params_from_config
from alerts.autoscale.service import Autoscaler, PageReader
from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config
from infermeter.records import MAX_DECISION_REASONS
from infermeter.serving import free_port
from infermeter.spool import Spool
from tests.alerts_autoscale.test_service import Fleet
from tests.conftest import config_ledger
from tests.servers import serving

INGEST_TOKEN = "im-demo-ingest"


def test_a_change_is_measured_from_the_count_last_asked_for():
    """From the last desired count; on the first tick from the replicas serving; same: no change."""
    decision = Decision("chat-small", 2e9, current=2, desired=3, reasons=("scale up",))
    assert changed_from(decision, None) == 2
    assert changed_from(decision, ModelState(last_desired=4)) == 4
    assert changed_from(decision, ModelState(last_desired=3)) is None


def test_the_record_keeps_the_change_and_cuts_long_reasons():
    """The record says from, to and why, with an id of time and model; reasons end in an ellipsis."""
    long = ("x" * 600, "y" * 600)
    record = decision_record(Decision("chat-small", 2e9, 2, 3, long), previous=4)
    assert (record.model, record.decided_at, record.previous, record.current, record.desired) == (
        "chat-small",
        2e9,
        4,
        2,
        3,
    )
    assert len(record.reasons) == MAX_DECISION_REASONS
    assert record.reasons.startswith("x" * 600 + "; y")
    assert record.reasons.endswith("y\u2026")
    again = decision_record(Decision("chat-small", 2e9, 2, 3, ("short",)), previous=4)
    assert again.decision_id == record.decision_id
    assert again.reasons == "short"


@pytest.fixture
def ledger(tmp_path: Path, config: Config) -> Iterator[Ledger]:
    """A ledger file for the demo's teams and models."""
    led = config_ledger(config, tmp_path / "ledger.duckdb")
    yield led
    led.close()


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """Billing's ingest over the ledger, on loopback; yields its ingest URL."""
    async with serving(create_app(config, ledger), lifespan="off") as url:
        yield f"{url}/v1/ingest"


def kept(ledger: Ledger) -> list[tuple[str, int, int, int]]:
    with ledger.reader() as cur:
        rows = cur.execute(
            "SELECT model, previous, current, desired FROM scaling_decisions ORDER BY decided_at, model"
        ).fetchall()
    return [(str(m), int(p), int(c), int(d)) for m, p, c, d in rows]


async def test_each_change_reaches_billing_once_and_a_hold_writes_nothing(
    config, ledger, billing, tmp_path
):
    """Two changes on the first tick, none while holding, one when the queue has stayed high."""
    fleet = Fleet()
    now = [time.time() - 60]
    async with serving(fleet.app()) as url, httpx.AsyncClient() as client:
        shipping = DecisionShipping(tmp_path / "spool", billing, INGEST_TOKEN, client)
        await shipping.start()
        reader = PageReader(
            f"{url}/metrics", [], ["chat-small", "chat-large"], client, clock=lambda: now[0]
        )
        limits = {m.name: model_limits(config, m.name) for m in config.models}
        scaler = Autoscaler(
            params_from_config(config), limits, reader, ScalingGauges(), spool=shipping.spool
        )
        await scaler.tick()
        for seconds in (15, 20, 5):  # queue 12 > 10 for 35 s, then asked for 3 already
            now[0] += seconds
            await scaler.tick()
        await shipping.stop()
    assert kept(ledger) == [("chat-large", 1, 1, 2), ("chat-small", 2, 2, 3)]
    with ledger.reader() as cur:
        reasons = cur.execute(
            "SELECT reasons FROM scaling_decisions WHERE model = 'chat-small'"
        ).fetchone()
    assert reasons is not None
    assert "queue 12 > 10" in reasons[0]
    assert list((tmp_path / "spool").glob("seg-*.jsonl")) == []


async def test_decisions_wait_on_disk_while_billing_is_away_and_ship_at_the_next_start(
    config, ledger, billing, tmp_path
):
    """Billing unreachable: the records stay in the spool; the next start ships them."""
    away = f"http://127.0.0.1:{free_port()}/v1/ingest"
    decision = Decision("chat-small", time.time() - 5, 2, 3, ("scale up",))
    async with httpx.AsyncClient() as client:
        first = DecisionShipping(tmp_path / "spool", away, INGEST_TOKEN, client)
        await first.start()
        await first.spool.append(decision_record(decision, 2).to_json())
        await first.stop(last_shipment_seconds=0.5)
        assert kept(ledger) == []
        assert len(list((tmp_path / "spool").glob("seg-*.jsonl"))) == 1
        second = DecisionShipping(tmp_path / "spool", billing, INGEST_TOKEN, client)
        await second.start()
        await second.stop()
    assert kept(ledger) == [("chat-small", 2, 2, 3)]


async def test_a_spool_that_cannot_take_a_decision_costs_the_record_not_the_tick(
    config, tmp_path, caplog
):
    """A full spool: the tick still decides and logs the change, and says the record is lost."""
    fleet = Fleet()
    spool = Spool(tmp_path / "spool", max_bytes=10)
    async with serving(fleet.app()) as url, httpx.AsyncClient() as client:
        spool.open()
        reader = PageReader(f"{url}/metrics", [], ["chat-large"], client)
        limits = {"chat-large": model_limits(config, "chat-large")}
        scaler = Autoscaler(
            params_from_config(config), limits, reader, ScalingGauges(), spool=spool
        )
        with caplog.at_level(logging.INFO, logger="infermeter.autoscale"):
            decisions = await scaler.tick()
        await spool.close()
    assert decisions["chat-large"].desired == 2
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "autoscale: chat-large: 1 -> 2 replicas: raised to min_replicas 2"
    assert lines[1].startswith("autoscale: chat-large: the change to 2 is not kept for billing:")
    assert "full" in lines[1]
