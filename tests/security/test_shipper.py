"""The shipper survives any answer billing gives: nothing stops it, nothing blocks the records behind."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config, load_config
from infermeter.shipper import Shipper, ShipperMetrics
from infermeter.spool import SegmentReader, Spool
from tests.billing.conftest import ndjson, usage
from tests.servers import serving

INGEST = "im-demo-ingest"


class _Flaky:
    """An ingest stand-in whose first ``bad`` answers are a 200 that is not an ingest answer."""

    def __init__(self, bad: int, body: bytes) -> None:
        self.bad, self.body, self.posts = bad, body, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        self.posts += 1
        body = self.body if self.posts <= self.bad else b'{"rejected": []}'
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/html")],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _spool(path: Path, records: list[dict[str, Any]]) -> Spool:
    spool = Spool(path, roll_seconds=0.0)
    spool.open()
    for record in records:
        await spool.append(record)
    return spool


@pytest.mark.parametrize("body", [b"<html>gateway</html>", b"[1, 2]", b'{"rejected": 7}'])
async def test_a_200_that_is_not_an_ingest_answer_is_counted_and_retried(tmp_path, body):
    """A non-answer (not JSON, or not the ingest shape) never ends the loop: it ships on retry."""
    spool = await _spool(tmp_path / "spool", [usage(), usage()])
    registry = CollectorRegistry()
    app = _Flaky(bad=2, body=body)
    async with serving(app, lifespan="off") as url, httpx.AsyncClient() as client:
        shipper = Shipper(
            spool,
            f"{url}/v1/ingest",
            INGEST,
            "usage",
            client,
            arrow=False,
            interval_seconds=0.01,
            metrics=ShipperMetrics(registry),
        )
        task = asyncio.create_task(shipper.run())
        try:
            async with asyncio.timeout(30):
                while shipper.shipped < 2:
                    assert not task.done(), task
                    await asyncio.sleep(0.02)
        finally:
            task.cancel()
    await spool.close()
    failures = registry.get_sample_value(
        "infermeter_shipper_failures_total", {"kind": "usage", "reason": "bad_answer"}
    )
    assert failures is not None
    assert failures >= 1
    assert app.posts >= 3
    assert await spool.closed_segments() == []


@pytest.fixture
def small_batches() -> Config:
    """The demo configuration with billing taking at most 2 records a batch (and the shared
    ingest token, which the shipper sends)."""
    return load_config(
        None,
        environ={
            "INFERMETER__BILLING__MAX_BATCH_RECORDS": "2",
            "INFERMETER__BILLING__SHARED_INGEST_TOKEN": "true",
        },
    )


async def test_a_batch_over_billings_limit_is_split_until_it_fits(tmp_path, small_batches):
    """413 from the real billing service: the shipper halves the batch and every record is kept."""
    records = [usage() for _ in range(7)]
    spool = await _spool(tmp_path / "spool", records)
    teams = [t.name for t in small_batches.teams]
    ledger = Ledger.open(":memory:", teams, {})
    try:
        app = create_app(small_batches, ledger)
        async with serving(app, lifespan="off") as url, httpx.AsyncClient() as client:
            shipper = Shipper(spool, f"{url}/v1/ingest", INGEST, "usage", client)
            assert await shipper.ship_once(max_wait_seconds=5) == 7
        with ledger.reader() as con:
            kept = con.execute("SELECT count(*), count(DISTINCT request_id) FROM usage").fetchone()
    finally:
        ledger.close()
    await spool.close()
    assert kept == (7, 7)
    assert not (tmp_path / "spool" / "rejected.jsonl").exists()
    assert await spool.closed_segments() == []


class _TooLarge:
    """An ingest stand-in that finds every batch too large."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b"too large"})


async def test_a_single_record_billing_will_not_take_is_dead_lettered(tmp_path):
    """A record that is too large on its own goes to rejected.jsonl; the spool moves on."""
    records = [usage(), usage()]
    spool = await _spool(tmp_path / "spool", records)
    async with serving(_TooLarge(), lifespan="off") as url, httpx.AsyncClient() as client:
        shipper = Shipper(spool, f"{url}/v1/ingest", INGEST, "usage", client)
        assert await shipper.ship_once(max_wait_seconds=5) == 2
    await spool.close()
    lines = (tmp_path / "spool" / "rejected.jsonl").read_bytes().splitlines()
    dead = [orjson.loads(line) for line in lines]
    assert [d["record"]["request_id"] for d in dead] == [r["request_id"] for r in records]
    assert all("413" in d["reason"] for d in dead)
    assert await spool.closed_segments() == []


def test_a_segment_is_read_in_batches_not_whole(tmp_path):
    """The reader yields bounded batches, by record count and by bytes, and skips a torn tail."""
    path = tmp_path / "seg.jsonl"
    lines = ndjson([usage() for _ in range(10)])
    path.write_bytes(lines + b'{"torn": ')
    by_count = SegmentReader(path, records=4, max_bytes=1 << 30)
    assert [len(b) for b in by_count] == [4, 4, 2]
    assert by_count.torn == 1
    one_line = len(lines.splitlines()[0]) + 1
    by_bytes = SegmentReader(path, records=100, max_bytes=one_line * 3)
    assert [len(b) for b in by_bytes] == [3, 3, 3, 1]


async def test_an_outage_is_logged_once_and_its_end_once(tmp_path, caplog):
    """Billing unable to take five posts in a row: one warning, one line when it takes again."""
    spool = await _spool(tmp_path / "spool", [usage()])
    app = _Flaky(bad=5, body=b"<html>gateway</html>")
    caplog.set_level("INFO", logger="infermeter.shipper")
    async with serving(app, lifespan="off") as url, httpx.AsyncClient() as client:
        shipper = Shipper(
            spool, f"{url}/v1/ingest", INGEST, "usage", client, arrow=False, interval_seconds=0.01
        )
        task = asyncio.create_task(shipper.run())
        try:
            async with asyncio.timeout(60):
                while shipper.shipped < 1:
                    await asyncio.sleep(0.02)
        finally:
            task.cancel()
    await spool.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "infermeter.shipper"]
    assert app.posts == 6
    assert len(lines) == 2, lines
    assert lines[0].startswith("billing did not take a usage batch: HTTP 200")
    assert lines[1].startswith("billing takes usage batches again, after ")
