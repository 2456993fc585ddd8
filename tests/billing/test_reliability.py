"""kill -9 of billing during a sidecar load test, or its disk full, loses nothing and double-counts
nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.billing.conftest import ndjson, usage
from tests.disks import small_disk
from tests.servers import serving, stop_process, wait_healthy

INGEST_TOKEN = "im-demo-ingest"
CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hello there"}]}


def _config(tmp_path: Path, upstream: str, billing_port: int) -> tuple[Path, Config]:
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["replicas"][1]["upstream_url"] = upstream
    data["simulator"]["engines"]["chat-small"].update(step_base_ms=3, step_per_seq_ms=0.02)
    data["teams"][0]["limits"] = {}
    data["billing"].update(
        listen=f"127.0.0.1:{billing_port}",
        url=f"http://127.0.0.1:{billing_port}",
        database=str(tmp_path / "ledger.duckdb"),
        # durability is under test here, not writer credentials: the shared token
        shared_ingest_token=True,
    )
    data["sidecar"] = {
        "spool_dir": str(tmp_path / "spool"),
        "ingest_url": f"http://127.0.0.1:{billing_port}/v1/ingest",
    }
    path = tmp_path / "infermeter.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, Config.model_validate(data)


def _start_billing(path: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "billing", "--config", str(path)])
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", what="billing")
    except AssertionError:
        proc.kill()
        proc.wait()
        raise
    return proc


@pytest.mark.timeout(240)
async def test_kill_9_of_billing_loses_nothing_and_counts_nothing_twice(tmp_path, monkeypatch):
    """Every request the clients made is in the ledger exactly once after billing was killed."""
    monkeypatch.setenv("INFERMETER_INGEST_TOKEN", INGEST_TOKEN)
    up_port, billing_port = free_port(), free_port()
    path, config = _config(tmp_path, f"http://127.0.0.1:{up_port}", billing_port)
    billing = await asyncio.to_thread(_start_billing, path, billing_port)
    sent: list[str] = []
    try:
        sim = ReplicaSim(replica_spec(config, "small-0"))
        sidecar = Sidecar(config, "small-0", spool_dir=tmp_path / "spool")
        headers = {"authorization": "Bearer im-demo-search"}
        async with (
            serving(sim, up_port),
            serving(sidecar) as url,
            httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as client,
        ):

            async def one(i: int) -> None:
                body = {**CHAT, "max_tokens": 5 + i % 20, "stream": i % 2 == 0}
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200
                sent.append(response.headers["x-infermeter-request-id"])

            async def wave(start: int, n: int) -> None:
                for chunk in range(start, start + n, 20):
                    await asyncio.gather(*(one(i) for i in range(chunk, chunk + 20)))
                    await asyncio.sleep(0.2)

            await wave(0, 200)
            # Wait until billing has some of it, then kill it mid-stream of shipments.
            await asyncio.sleep(2)
            os.kill(billing.pid, signal.SIGKILL)
            billing.wait(10)
            await wave(200, 200)  # served while billing is down: spooled, not lost
            billing = await asyncio.to_thread(_start_billing, path, billing_port)
            await wave(400, 100)
            deadline = time.monotonic() + 90
            while sidecar.spool.backlog and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            assert sidecar.spool.backlog == 0, "the spool did not drain into billing"
    finally:
        stop_process(billing, grace=20)
    con = duckdb.connect(str(tmp_path / "ledger.duckdb"), read_only=True)
    ids = [r[0] for r in con.execute("SELECT request_id FROM usage").fetchall()]
    requests = con.execute("SELECT sum(requests) FROM usage_slots").fetchone()
    con.close()
    assert len(sent) == 500
    assert sorted(ids) == sorted(sent)
    assert requests == (500,)


def test_sigterm_checkpoints_the_ledger(tmp_path):
    """SIGTERM (what Kubernetes sends) shuts billing down cleanly: ledger checkpointed, data kept."""
    port = free_port()
    path, _ = _config(tmp_path, "http://127.0.0.1:1", port)
    billing = _start_billing(path, port)
    record = {
        "sample_id": "e1",
        "replica": "small-0",
        "model": "chat-small",
        "timestamp": 1790812805.0,
        "requests_running": 3.0,
        "requests_waiting": 1.0,
        "kv_cache_usage": 0.2,
        "prompt_tokens_total": 10.0,
        "generation_tokens_total": 20.0,
    }
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/ingest",
        json={"engine_samples": [record]},
        headers={"authorization": f"Bearer {INGEST_TOKEN}"},
    )
    assert response.json()["accepted"] == 1
    billing.send_signal(signal.SIGTERM)
    billing.wait(20)
    assert not (tmp_path / "ledger.duckdb.wal").exists()
    con = duckdb.connect(str(tmp_path / "ledger.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT sample_id FROM engine_samples").fetchall() == [("e1",)]
    finally:
        con.close()


def _fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` with one file, and return it."""
    filler = disk / "filler"
    with filler.open("wb") as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\0" * (64 << 10))
            fh.flush()
    return filler


@pytest.mark.timeout(120)
def test_a_full_disk_refuses_ingest_with_503_and_the_batch_is_kept_when_sent_again(
    tmp_path, monkeypatch
):
    """A batch billing cannot commit on a full disk is refused with 503 ledger_unavailable (the
    shipper retries it), and is kept whole, once, when it is sent again after space is freed."""
    monkeypatch.setenv("INFERMETER_INGEST_TOKEN", INGEST_TOKEN)
    port = free_port()
    path, _ = _config(tmp_path, "http://127.0.0.1:1", port)
    with small_disk(tmp_path / "disk", "16M") as disk:
        data = yaml.safe_load(path.read_text())
        data["billing"]["database"] = str(disk / "ledger.duckdb")
        path.write_text(yaml.safe_dump(data))
        billing = _start_billing(path, port)
        try:
            body = ndjson([usage() for _ in range(200)])
            headers = {
                "authorization": f"Bearer {INGEST_TOKEN}",
                "content-type": "application/x-ndjson",
            }
            url = f"http://127.0.0.1:{port}/v1/ingest/usage"
            filler = _fill(disk)
            refused = httpx.post(url, content=body, headers=headers)
            filler.unlink()
            taken = httpx.post(url, content=body, headers=headers)
            again = httpx.post(url, content=body, headers=headers)
        finally:
            stop_process(billing, grace=20)
        con = duckdb.connect(str(disk / "ledger.duckdb"), read_only=True)
        try:
            kept = con.execute("SELECT count(*) FROM usage").fetchone()
        finally:
            con.close()
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "ledger_unavailable"
    assert (taken.status_code, taken.json()["accepted"]) == (200, 200)
    assert (again.json()["accepted"], again.json()["duplicates"]) == (0, 200)
    assert kept == (200,)
