"""Backups of a running billing service under ingest, and restoring one."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import httpx
import orjson
import pytest
import yaml

from billing import backup
from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from infermeter.shipper import Shipper
from infermeter.spool import Spool
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.billing.conftest import batch, usage
from tests.servers import serving, stop_process, wait_healthy

INGEST = {"authorization": "Bearer im-demo-ingest"}
ADMIN = {"authorization": "Bearer im-demo-admin"}
BATCH = 200


@dataclass
class Billing:
    """A billing process on loopback, its ledger file and its working directory."""

    url: str
    database: Path
    root: Path
    config: Path
    process: subprocess.Popen[bytes] = field(repr=False)


def _config(root: Path, port: int, **sidecar: Any) -> Path:
    """A configuration for billing on ``port`` with its ledger in ``root``, taking the shared
    ingest token, without the retention timer; ``sidecar``: settings of the sidecars."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["sidecar"].update(sidecar)
    data["billing"].update(
        listen=f"127.0.0.1:{port}",
        url=f"http://127.0.0.1:{port}",
        database=str(root / "ledger.duckdb"),
        shared_ingest_token=True,
        backup_dir=str(root / "backups"),
        retention={"interval_seconds": 0, "archive": str(root / "archive")},
    )
    config = root / "infermeter.yaml"
    config.write_text(yaml.safe_dump(data))
    return config


@contextmanager
def _running(root: Path, port: int | None = None) -> Iterator[Billing]:
    """``infermeter billing`` as its own process over ``root``'s ledger, stopped after the block;
    its configuration is ``root``'s infermeter.yaml when there is one."""
    config = root / "infermeter.yaml"
    if config.exists():
        port = int(yaml.safe_load(config.read_text())["billing"]["listen"].rsplit(":", 1)[1])
    else:
        port = port or free_port()
        config = _config(root, port)
    command = [sys.executable, "-m", "launcher", "billing", "--config", str(config)]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, what="billing")
        yield Billing(url, root / "ledger.duckdb", root, config, process)
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def billing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Billing]:
    """One billing service for the module."""
    with _running(tmp_path_factory.mktemp("backup")) as service:
        yield service


@dataclass
class Shipped:
    """One batch as a shipper sent it: its ids, and when it was sent and acknowledged."""

    ids: list[str]
    sent: float
    acked: float


def _ingest_until(url: str, stop: threading.Event, shipped: list[Shipped], tag: str) -> None:
    """Send batches of fresh records one after another, as one shipper does, until ``stop``."""
    with httpx.Client(base_url=url, headers=INGEST, timeout=30) as client:
        n = 0
        while not stop.is_set():
            records = [
                usage("search", time.time() - 60, request_id=f"{tag}-{n}-{i}") for i in range(BATCH)
            ]
            sent = time.monotonic()
            response = client.post("/v1/ingest", content=batch("usage", records))
            assert response.status_code == 200, response.text
            assert response.json()["accepted"] == BATCH, response.text
            shipped.append(Shipped([r["request_id"] for r in records], sent, time.monotonic()))
            n += 1


def _ids(database: Path) -> list[str]:
    with duckdb.connect(str(database), read_only=True) as con:
        return [r[0] for r in con.execute("SELECT request_id FROM usage").fetchall()]


def test_a_backup_under_ingest_holds_exactly_the_batches_committed_before_it(
    billing: Billing, tmp_path: Path
) -> None:
    """Batches acknowledged before the backup began are in it, those sent after it ended are
    not, none is in part, none twice; the manifest's counts are the restored ledger's."""
    stop, shipped = threading.Event(), list[Shipped]()
    sender = threading.Thread(target=_ingest_until, args=(billing.url, stop, shipped, "load"))
    sender.start()
    try:
        time.sleep(1.0)
        began = time.monotonic()
        name = f"snapshot-{tmp_path.name}"
        dest = billing.root / "backups" / name
        response = httpx.post(
            f"{billing.url}/v1/admin/backup", params={"name": name}, headers=ADMIN, timeout=120
        )
        ended = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        sender.join(30)
    assert response.status_code == 200, response.text
    assert any(s.acked > began for s in shipped), "ingest did not go on during the backup"
    rows = backup.restore(dest, tmp_path / "restored.duckdb")
    ids = _ids(tmp_path / "restored.duckdb")
    assert len(ids) == len(set(ids)) == rows["usage"] == response.json()["rows"]["usage"]
    kept = set(ids)
    whole = [s for s in shipped if kept.issuperset(s.ids)]
    assert all(kept.isdisjoint(s.ids) for s in shipped if s not in whole)  # none in part
    assert len(kept) == BATCH * len(whole)
    assert all(s in whole for s in shipped if s.acked < began)
    assert not any(s in whole for s in shipped if s.sent > ended)
    assert whole == shipped[: len(whole)]  # what the snapshot holds is a prefix of the shipments


def test_restore_refuses_a_live_ledger_an_existing_one_and_an_altered_backup(
    billing: Billing, tmp_path: Path
) -> None:
    """The service's open file is never replaced; another needs --force; a changed file stops it."""
    name = f"snapshot-{tmp_path.name}"
    dest = billing.root / "backups" / name
    response = httpx.post(
        f"{billing.url}/v1/admin/backup", params={"name": name}, headers=ADMIN, timeout=120
    )
    assert response.status_code == 200, response.text
    with pytest.raises(backup.BackupError, match="in use"):
        backup.restore(dest, billing.database, force=True)
    other = tmp_path / "other.duckdb"
    backup.restore(dest, other)
    with pytest.raises(backup.BackupError, match="pass --force"):
        backup.restore(dest, other)
    assert sum(backup.restore(dest, other, force=True).values()) > 0
    path = httpx.post(
        f"{billing.url}/v1/admin/backup", params={"name": "../elsewhere"}, headers=ADMIN, timeout=30
    )
    assert path.status_code == 422  # a name, never a path
    again = httpx.post(
        f"{billing.url}/v1/admin/backup", params={"name": name}, headers=ADMIN, timeout=30
    )
    assert again.status_code == 409
    assert "exists" in again.json()["error"]["message"]
    altered = tmp_path / "altered"
    shutil.copytree(dest, altered)
    table = next(p for p in altered.iterdir() if p.name.startswith("usage"))
    table.write_bytes(table.read_bytes() + b"x")
    with pytest.raises(backup.BackupError, match="missing or altered"):
        backup.restore(altered, tmp_path / "third.duckdb")


def test_the_commands_take_a_backup_and_restore_it(billing: Billing, tmp_path: Path) -> None:
    """``infermeter billing backup`` goes through the service; ``restore`` writes the file."""
    env = {"INFERMETER_ADMIN_TOKEN": "im-demo-admin", "PATH": "/usr/bin:/bin"}
    cli = [sys.executable, "-m", "launcher", "billing"]
    taken = subprocess.run(
        [*cli, "backup", "--config", str(billing.config), "by-command-%Y%m%d"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert taken.returncode == 0, taken.stderr
    manifest = orjson.loads(taken.stdout)
    restored = tmp_path / "restored.duckdb"
    dest = Path(manifest["directory"])
    assert dest == billing.root / "backups" / time.strftime("by-command-%Y%m%d", time.gmtime())
    back = subprocess.run(
        [*cli, "restore", "--config", str(billing.config), str(dest), "--database", str(restored)],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert back.returncode == 0, back.stderr
    assert len(_ids(restored)) == manifest["rows"]["usage"]


def test_the_retain_command_runs_retention_in_the_service(billing: Billing) -> None:
    """``infermeter billing retain`` asks the service, which answers with what it moved."""
    env = {"INFERMETER_ADMIN_TOKEN": "im-demo-admin", "PATH": "/usr/bin:/bin"}
    command = [
        sys.executable,
        "-m",
        "launcher",
        "billing",
        "retain",
        "--config",
        str(billing.config),
    ]
    done = subprocess.run(command, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = orjson.loads(done.stdout)
    assert report["moved"] == {"usage": 0, "gpu_samples": 0, "engine_samples": 0}  # all recent
    assert report["horizon"] < time.time() - 35 * 86_400
    assert (billing.root / "archive" / "_lock").is_file()


async def test_after_a_restore_the_spool_ships_again_what_billing_had_acknowledged(
    tmp_path: Path,
) -> None:
    """A spool that keeps acknowledged segments ships them again once asked (``infermeter spool
    reship``): the restored ledger gets back what it acknowledged after the backup, each once."""
    spool = Spool(tmp_path / "spool", keep_acked_seconds=3600)
    spool.open()
    before = [usage("search", time.time() - 60, request_id=f"before-{i}") for i in range(50)]
    after = [usage("search", time.time() - 30, request_id=f"after-{i}") for i in range(50)]
    with _running(tmp_path) as service:
        async with httpx.AsyncClient(timeout=30) as client:
            shipper = Shipper(spool, f"{service.url}/v1/ingest", "im-demo-ingest", "usage", client)
            for record in before:
                spool.write(record)
            await spool.seal()
            assert await shipper.ship_once() == 50
            taken = await client.post(
                f"{service.url}/v1/admin/backup", headers=ADMIN, params={"name": "snapshot"}
            )
            assert taken.status_code == 200, taken.text
            for record in after:
                spool.write(record)
            await spool.seal()
            assert await shipper.ship_once() == 50
    assert spool.backlog == 0
    backup.restore(tmp_path / "backups" / "snapshot", tmp_path / "ledger.duckdb", force=True)
    assert len(_ids(tmp_path / "ledger.duckdb")) == 50  # the day after the backup is gone
    command = [sys.executable, "-m", "launcher", "spool", "reship", str(tmp_path / "spool")]
    marked = subprocess.run(command, capture_output=True, timeout=60)
    assert marked.returncode == 0, marked.stderr
    with _running(tmp_path) as service:
        async with httpx.AsyncClient(timeout=30) as client:
            shipper = Shipper(spool, f"{service.url}/v1/ingest", "im-demo-ingest", "usage", client)
            assert await shipper.ship_once() == 100  # acknowledged: 50 kept, 50 repeats
    await spool.close()
    ids = _ids(tmp_path / "ledger.duckdb")
    assert sorted(ids) == sorted(r["request_id"] for r in before + after)


async def test_a_sidecar_ships_again_what_a_restore_took_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar keeping acknowledged records (``spool_keep_acked_seconds``) in front of a
    simulated replica: billing restored to a backup taken between two waves of requests gets
    the second wave back once the spools are asked to reship, and no request twice."""
    monkeypatch.setenv("INFERMETER_INGEST_TOKEN", "im-demo-ingest")
    up_port, port = free_port(), free_port()
    path = _config(
        tmp_path,
        port,
        spool_dir=str(tmp_path / "spool"),
        spool_keep_acked_seconds=3600,
        ingest_url=f"http://127.0.0.1:{port}/v1/ingest",
    )
    data = yaml.safe_load(path.read_text())
    data["replicas"][1]["upstream_url"] = f"http://127.0.0.1:{up_port}"
    path.write_text(yaml.safe_dump(data))
    config = Config.model_validate(data)
    sim = ReplicaSim(replica_spec(config, "small-0"))
    sidecar = Sidecar(config, "small-0", spool_dir=tmp_path / "spool")
    chat = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    waves: list[list[str]] = []
    async with (
        serving(sim, up_port),
        serving(sidecar) as url,
        httpx.AsyncClient(
            base_url=url, headers={"authorization": "Bearer im-demo-search"}, timeout=60
        ) as client,
    ):

        async def wave() -> None:
            ids = []
            for _ in range(10):
                response = await client.post("/v1/chat/completions", json=chat)
                assert response.status_code == 200, response.text
                ids.append(response.headers["x-infermeter-request-id"])
            waves.append(ids)
            await _until(lambda: sidecar.spool.backlog == 0, "the spool did not drain")

        with _running(tmp_path, port) as service:
            await wave()
            taken = await client.post(
                f"{service.url}/v1/admin/backup", headers=ADMIN, params={"name": "snapshot"}
            )
            assert taken.status_code == 200, taken.text
            await wave()
        backup.restore(tmp_path / "backups" / "snapshot", tmp_path / "ledger.duckdb", force=True)
        assert sorted(_ids(tmp_path / "ledger.duckdb")) == sorted(waves[0])
        command = [sys.executable, "-m", "launcher", "spool", "reship", str(tmp_path / "spool")]
        marked = subprocess.run(command, capture_output=True, timeout=60)
        assert marked.returncode == 0, marked.stderr
        with _running(tmp_path, port) as service:

            async def found() -> bool:
                answer = await client.get(
                    f"{service.url}/v1/usage/records", headers=ADMIN, params={"id": waves[1][-1]}
                )
                return bool(answer.json()["records"])

            await _until(found, "the second wave did not come back")
            await _until(lambda: sidecar.spool.backlog == 0, "the spool did not drain")
    assert sorted(_ids(tmp_path / "ledger.duckdb")) == sorted(waves[0] + waves[1])


async def _until(
    check: Callable[[], bool | Awaitable[bool]], failure: str, seconds: float = 90
) -> None:
    """Wait until ``check`` holds, polling; fail with ``failure`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        held = check()
        if held if isinstance(held, bool) else await held:
            return
        assert time.monotonic() < deadline, failure
        await asyncio.sleep(0.2)
