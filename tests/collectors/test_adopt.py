"""Orphan spools: what a sidecar that is gone left on the node reaches billing, once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from billing.api import create_app
from billing.ledger import Ledger
from collectors.adopt import Action, Adopter, AdoptionMetrics, Listing, candidates, plan
from infermeter.config import DEFAULT_CONFIG
from infermeter.serving import free_port
from infermeter.spooldir import SpoolLock
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import serving, sidecar_process
from tests.sidecar.conftest import KEYS, make_config

INGEST = "im-demo-ingest"
CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
POD = {
    "POD_NAME": "vllm-small-7d9f8-abcde",
    "POD_UID": "0b6c1f2e-1111-2222-3333-444455556666",
    "POD_NAMESPACE": "inference",
    "POD_IP": "127.0.0.1",
}


@pytest.mark.parametrize(
    ("found", "action"),
    [
        (Listing(usage_segments=2), Action.SHIP),
        (Listing(instance_segments=1), Action.SHIP),
        (Listing(override_segments=1), Action.SHIP),
        (Listing(usage_segments=1, other_files=("rejected.jsonl",)), Action.SHIP),
        (Listing(), Action.REMOVE),
        (Listing(other_files=("rejected.jsonl",)), Action.KEEP),
        (Listing(recent_nonces=True), Action.KEEP),
    ],
    ids=[
        "usage",
        "events",
        "overrides",
        "usage-and-dead-letters",
        "empty",
        "only-dead-letters",
        "recent-nonces",
    ],
)
def test_plan_ships_what_there_is_and_removes_only_an_empty_directory(found, action):
    """Segments are shipped; an empty directory is removed; dead letters keep it for an operator,
    and gateway nonces a restarted sidecar would still need keep it for that sidecar."""
    assert plan(found) is action


def test_hidden_entries_of_the_spool_root_are_not_candidates():
    """Names starting with a dot (the root's own files) are never adopted."""
    assert candidates(["pod-b", ".tmp", "pod-a"]) == ["pod-a", "pod-b"]


def _adopter(
    root: Path, billing_port: int, client: httpx.AsyncClient
) -> tuple[Adopter, CollectorRegistry]:
    registry = CollectorRegistry()
    adopter = Adopter(
        root,
        f"http://127.0.0.1:{billing_port}/v1/ingest",
        INGEST,
        client,
        AdoptionMetrics(registry),
        max_wait_seconds=0.5,
    )
    return adopter, registry


def _ledger_ids(ledger: Ledger) -> list[str]:
    with ledger.reader() as con:
        return [r[0] for r in con.execute("SELECT request_id FROM usage").fetchall()]


async def test_a_stopped_sidecars_spool_is_shipped_and_removed(tmp_path, ledger, config):
    """Usage and lifetime events of a sidecar that never shipped reach billing; the directory goes."""
    cfg = make_config(f"http://127.0.0.1:{free_port()}", **{"sidecar.spool_dir": str(tmp_path)})
    sim = ReplicaSim(replica_spec(cfg, "small-0"))
    port = int(cfg.replica("small-0").upstream_url.rsplit(":", 1)[1])
    headers = {"authorization": f"Bearer {KEYS['search']}"}
    async with (
        serving(sim, port),
        serving(Sidecar(cfg, "small-0")) as url,
        httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c,
    ):
        ids = [
            (await c.post("/v1/chat/completions", json=CHAT)).headers["x-infermeter-request-id"]
            for _ in range(3)
        ]
    billing_port = free_port()
    async with (
        serving(create_app(config, ledger), billing_port, lifespan="off"),
        httpx.AsyncClient() as client,
    ):
        adopter, registry = _adopter(tmp_path, billing_port, client)
        assert await adopter.adopt_once() == 3 + 2
    assert sorted(_ledger_ids(ledger)) == sorted(ids)
    with ledger.reader() as con:
        events = con.execute('SELECT event FROM instance_events ORDER BY "timestamp"').fetchall()
    assert events == [("start",), ("stop",)]
    assert not (tmp_path / "small-0").exists()
    assert registry.get_sample_value("infermeter_collector_spools_adopted_total") == 1
    assert (
        registry.get_sample_value("infermeter_collector_adopted_records_total", {"kind": "usage"})
        == 3
    )
    assert (
        registry.get_sample_value(
            "infermeter_collector_adopted_records_total", {"kind": "instances"}
        )
        == 2
    )


async def test_a_locked_spool_is_left_alone(tmp_path):
    """A directory whose sidecar runs (its lock held) is neither shipped nor removed."""
    directory = tmp_path / "small-0"
    lock = SpoolLock(directory)
    assert lock.try_acquire()
    (directory / "seg-00000000000000000001.jsonl").write_text('{"request_id": "x"}\n')
    async with httpx.AsyncClient() as client:
        adopter, _ = _adopter(tmp_path, free_port(), client)
        assert await adopter.adopt_once() == 0
    assert (directory / "seg-00000000000000000001.jsonl").exists()
    assert lock.held
    lock.release()


async def test_dead_letters_keep_the_directory_and_its_lock_free(tmp_path):
    """A spool left with only rejected records stays for an operator, unlocked."""
    directory = tmp_path / "small-0"
    directory.mkdir()
    (directory / "rejected.jsonl").write_text('{"reason": "bad", "record": {}}\n')
    async with httpx.AsyncClient() as client:
        adopter, _ = _adopter(tmp_path, free_port(), client)
        assert await adopter.adopt_once() == 0
    assert (directory / "rejected.jsonl").exists()
    lock = SpoolLock(directory)
    assert lock.try_acquire()
    lock.release()


async def test_an_empty_audit_spool_and_the_keys_cache_leave_nothing_behind(tmp_path):
    """A gone sidecar's audit spool with nothing in it and its cache of issued keys do not keep
    its directory; an audit event it did not ship does (for an operator: nothing is lost)."""
    emptied, unshipped = tmp_path / "small-0", tmp_path / "small-1"
    for directory in (emptied, unshipped):
        (directory / "audit").mkdir(parents=True)
        (directory / "issued-keys.json").write_text("{}")
    (unshipped / "audit" / "seg-00000000000000000001.jsonl").write_text('{"action": "x"}\n')
    async with httpx.AsyncClient() as client:
        adopter, _ = _adopter(tmp_path, free_port(), client)
        assert await adopter.adopt_once() == 0
    assert not emptied.exists()
    assert (unshipped / "audit" / "seg-00000000000000000001.jsonl").exists()


async def test_acknowledged_segments_kept_for_a_restore_do_not_keep_the_directory(tmp_path):
    """A gone sidecar's spool holding only segments billing acknowledged (kept by
    ``spool_keep_acked_seconds``), even asked to reship, is removed like an empty one."""
    directory = tmp_path / "small-0"
    directory.mkdir()
    (directory / "acked-00000000000000000001.jsonl").write_text('{"request_id": "r"}\n')
    (directory / "reship").touch()
    async with httpx.AsyncClient() as client:
        adopter, _ = _adopter(tmp_path, free_port(), client)
        assert await adopter.adopt_once() == 0
    assert not directory.exists()


async def test_gateway_nonces_keep_the_directory_only_while_they_matter(tmp_path):
    """Nonces written within keep_nonces_seconds keep a shipped directory; older ones go with it."""
    nonces = tmp_path / "small-0" / "gateway-nonces"
    nonces.mkdir(parents=True)
    written = nonces / "nonces-000000000000.log"
    written.write_text(f"{int(time.time())} n-0123456789abcdef\n")
    async with httpx.AsyncClient() as client:
        adopter = Adopter(
            tmp_path,
            f"http://127.0.0.1:{free_port()}/v1/ingest",
            INGEST,
            client,
            AdoptionMetrics(CollectorRegistry()),
            keep_nonces_seconds=600,
        )
        await adopter.adopt_once()
        assert written.exists()
        os.utime(written, (time.time() - 601, time.time() - 601))
        await adopter.adopt_once()
    assert not (tmp_path / "small-0").exists()


def _sidecar_config(tmp_path: Path, upstream: str, listen: str, billing_port: int) -> Path:
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["replicas"][1].update(upstream_url=upstream, sidecar_listen=listen)
    data["simulator"]["engines"]["chat-small"].update(step_base_ms=3, step_per_seq_ms=0.02)
    data["teams"][0]["limits"] = {}
    data["sidecar"] = {
        "spool_dir": str(tmp_path / "spool"),
        "heartbeat_seconds": 0.2,
        "ingest_url": f"http://127.0.0.1:{billing_port}/v1/ingest",
    }
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start_sidecar(config: Path, url: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, **POD, "INFERMETER_INGEST_TOKEN": INGEST}
    return sidecar_process(str(config), url, env=env)


@pytest.mark.timeout(180)
async def test_a_pod_killed_while_billing_is_down_is_billed_once_when_billing_returns(
    tmp_path, ledger, config
):
    """kill -9 of a pod's sidecar, billing down: once billing is back, every completed response is in the ledger exactly once."""
    up_port, side_port, billing_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{side_port}"
    path = _sidecar_config(
        tmp_path, f"http://127.0.0.1:{up_port}", f"127.0.0.1:{side_port}", billing_port
    )
    sim = ReplicaSim(replica_spec(make_config(f"http://127.0.0.1:{up_port}"), "small-0"))
    spool = tmp_path / "spool" / POD["POD_UID"]
    completed: list[str] = []
    headers = {"authorization": f"Bearer {KEYS['search']}"}

    async def wave(client: httpx.AsyncClient, n: int) -> None:
        async def one(i: int) -> None:
            body = {**CHAT, "max_tokens": 3 + i % 10, "stream": i % 2 == 0}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            assert not body["stream"] or response.content.endswith(b"data: [DONE]\n\n")
            completed.append(response.headers["x-infermeter-request-id"])

        await asyncio.gather(*(one(i) for i in range(n)))

    async with serving(sim, up_port):
        proc = None
        try:
            async with serving(create_app(config, ledger), billing_port, lifespan="off"):
                proc = await asyncio.to_thread(_start_sidecar, path, url)
                async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:
                    await wave(c, 40)
                    # Some of it is shipped while billing is up (waited for, not timed: a busy
                    # machine's shipper took more than the 3 s this once slept).
                    deadline = time.monotonic() + 30
                    while not _ledger_ids(ledger) and time.monotonic() < deadline:
                        await asyncio.sleep(0.2)
            shipped_before = set(_ledger_ids(ledger))
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:
                await wave(c, 40)  # served while billing is down: spooled only
        finally:
            if proc is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
    assert shipped_before, "the sidecar shipped nothing while billing was up"
    assert set(completed) - shipped_before
    async with httpx.AsyncClient() as client:
        adopter, registry = _adopter(tmp_path / "spool", billing_port, client)
        assert await adopter.adopt_once() == 0  # billing is still down
        assert spool.exists()
        assert registry.get_sample_value("infermeter_collector_orphan_spools") == 1
        async with serving(create_app(config, ledger), billing_port, lifespan="off"):
            assert await adopter.adopt_once() > 0
    ids = _ledger_ids(ledger)
    assert sorted(ids) == sorted(completed)
    assert len(ids) == len(set(ids)) == 80
    with ledger.reader() as con:
        events = dict(
            con.execute(
                "SELECT event, count(*) FROM instance_events WHERE instance = ? GROUP BY event",
                [POD["POD_NAME"]],
            ).fetchall()
        )
    assert events.get("start") == 1
    assert events.get("heartbeat", 0) >= 5
    assert "stop" not in events, "a killed sidecar never says it stopped"
    assert not spool.exists()
    assert not list((tmp_path / "spool").iterdir())
    assert registry.get_sample_value("infermeter_collector_spools_adopted_total") == 1
    assert registry.get_sample_value("infermeter_collector_orphan_spools") == 0
