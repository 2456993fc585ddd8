"""A collector told to stop ships what its spools hold before it exits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.api import create_app
from billing.ledger import Ledger
from collectors.serve import serve_collector
from infermeter.config import Config
from infermeter.serving import free_port
from infermeter.spool import read_segment
from tests.servers import serving


async def test_the_last_samples_reach_billing_before_the_collector_exits(
    fleet_config: Callable[..., Config],
    running_fleet: Callable[[Config], Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped mid-segment: every sample it took is in the ledger, nothing left in its spool."""
    monkeypatch.setenv("INFERMETER_INGEST_TOKEN", "im-demo-ingest")
    billing_config = fleet_config()
    ledger = Ledger.open(":memory:", [t.name for t in billing_config.teams], {})
    async with serving(create_app(billing_config, ledger), lifespan="off") as billing:
        cfg = fleet_config(
            scrape_interval_seconds=0.2,
            spool_dir=str(tmp_path / "spool"),
            ingest_url=f"{billing}/v1/ingest",
            drain_ship_seconds=5.0,
        )
        async with running_fleet(cfg):
            listen = f"127.0.0.1:{free_port()}"
            task = asyncio.create_task(serve_collector(cfg, listen))
            async with httpx.AsyncClient() as client:
                for _ in range(200):
                    await asyncio.sleep(0.05)
                    spooled = list((tmp_path / "spool" / "gpu_samples").glob("seg-*.jsonl"))
                    if spooled and any(read_segment(p)[0] for p in spooled):
                        break
                assert (await client.get(f"http://{listen}/healthz")).status_code == 200
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    left = [r for p in (tmp_path / "spool").rglob("seg-*.jsonl") for r in read_segment(p)[0]]
    assert left == []
    with ledger.reader() as con:
        row = con.execute("SELECT count(*) FROM gpu_samples").fetchone()
    ledger.close()
    assert row is not None
    assert row[0] > 0
