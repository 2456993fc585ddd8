"""The sidecar as an instance: its identity on every record, its lifetime in billing's ledger."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.api import create_app
from infermeter.config import Config
from infermeter.identity import identity_from_environment
from infermeter.serving import free_port
from infermeter.spool import read_segment
from infermeter.spooldir import INSTANCES, SpoolBusyError
from launcher.cli import main
from sidecar.app import Sidecar
from sidecar.lifetime import engine_metrics_url
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import serving
from tests.sidecar.conftest import KEYS, make_config

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
POD = {
    "POD_NAME": "vllm-small-7d9f8-abcde",
    "POD_UID": "0b6c1f2e-1111-2222-3333-444455556666",
    "POD_NAMESPACE": "inference",
    "NODE_NAME": "gpu-node-7",
    "NVIDIA_VISIBLE_DEVICES": "GPU-aaaa",
}


def _spooled(directory: Path) -> list[dict[str, Any]]:
    return [r for seg in sorted(directory.glob("seg-*.jsonl")) for r in read_segment(seg)[0]]


async def _serve_one_request(config: Config, sidecar: Sidecar) -> str:
    """Serve ``sidecar`` in front of a simulated small-0 for one completed request; its id."""
    sim = ReplicaSim(replica_spec(config, "small-0"))
    port = int(config.replica("small-0").upstream_url.rsplit(":", 1)[1])
    headers = {"authorization": f"Bearer {KEYS['search']}"}
    async with (
        serving(sim, port),
        serving(sidecar) as url,
        httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client,
    ):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        return response.headers["x-infermeter-request-id"]


@pytest.mark.parametrize(
    ("host", "environ", "expected"),
    [
        ("0.0.0.0", {"POD_IP": "10.1.2.3"}, "http://10.1.2.3:8100/engine/metrics"),
        ("0.0.0.0", {}, "http://gpu-host-1:8100/engine/metrics"),
        ("127.0.0.1", {}, "http://127.0.0.1:8100/engine/metrics"),
        ("::", {"POD_IP": "fd00::7"}, "http://[fd00::7]:8100/engine/metrics"),
    ],
    ids=["pod-ip", "wildcard-hostname", "listen-address", "ipv6-pod-ip"],
)
def test_engine_metrics_url_is_an_address_the_collector_can_reach(host, environ, expected):
    """The pod IP in Kubernetes, else the listen address, else (a wildcard) the host's name."""
    assert engine_metrics_url(host, 8100, environ, "gpu-host-1") == expected


async def test_a_pods_identity_reaches_its_usage_records_and_names_its_spool(tmp_path):
    """Pod name on every usage record, replica group as replica, spool under the pod UID."""
    config = make_config(f"http://127.0.0.1:{free_port()}", **{"sidecar.spool_dir": str(tmp_path)})
    identity = identity_from_environment(config.replica("small-0"), POD)
    sidecar = Sidecar(
        config,
        "small-0",
        identity=identity,
        engine_metrics_url="http://10.1.2.3:8102/engine/metrics",
    )
    rid = await _serve_one_request(config, sidecar)
    spool = tmp_path / POD["POD_UID"]
    [record] = _spooled(spool)
    assert (record["request_id"], record["instance"], record["replica"]) == (
        rid,
        POD["POD_NAME"],
        "small-0",
    )
    events = _spooled(spool / INSTANCES)
    assert [e["event"] for e in events] == ["start", "stop"]
    assert {
        (e["instance"], e["pod_uid"], e["namespace"], e["node"], e["gpus"], e["gpu_count"])
        for e in events
    } == {(POD["POD_NAME"], POD["POD_UID"], "inference", "gpu-node-7", "GPU-aaaa", 1)}
    assert events[0]["engine_metrics_url"] == "http://10.1.2.3:8102/engine/metrics"


async def test_a_fixed_replica_names_no_instance_on_usage_and_announces_itself(tmp_path):
    """Without identity variables, records keep instance null, events name the replica, spool as before."""
    config = make_config(f"http://127.0.0.1:{free_port()}", **{"sidecar.spool_dir": str(tmp_path)})
    await _serve_one_request(config, Sidecar(config, "small-0"))
    [record] = _spooled(tmp_path / "small-0")
    assert (record["instance"], record["replica"]) == (None, "small-0")
    events = _spooled(tmp_path / "small-0" / INSTANCES)
    assert [(e["event"], e["instance"], e["pod_uid"]) for e in events] == [
        ("start", "small-0", None),
        ("stop", "small-0", None),
    ]


async def test_start_heartbeats_and_stop_reach_billings_instance_events(
    tmp_path, ledger, monkeypatch
):
    """A served and stopped sidecar leaves start, heartbeats and stop, in order, in billing's ledger."""
    monkeypatch.setenv("INFERMETER_INGEST_TOKEN", "im-demo-ingest")
    billing_port = free_port()
    config = make_config(
        f"http://127.0.0.1:{free_port()}",
        **{
            "sidecar.spool_dir": str(tmp_path),
            "sidecar.heartbeat_seconds": 0.1,
            "sidecar.ingest_url": f"http://127.0.0.1:{billing_port}/v1/ingest",
        },
    )
    identity = identity_from_environment(config.replica("small-0"), POD)
    sidecar = Sidecar(config, "small-0", identity=identity)
    async with serving(create_app(config, ledger), billing_port, lifespan="off"):
        sim = ReplicaSim(replica_spec(config, "small-0"))
        port = int(config.replica("small-0").upstream_url.rsplit(":", 1)[1])
        async with serving(sim, port), serving(sidecar):
            await asyncio.sleep(0.5)
    with ledger.reader() as con:
        rows = con.execute(
            'SELECT event, instance, replica, started_at, "timestamp" FROM instance_events '
            'ORDER BY "timestamp"'
        ).fetchall()
    events = [r[0] for r in rows]
    assert events[0] == "start"
    assert events[-1] == "stop"
    assert set(events[1:-1]) == {"heartbeat"}
    assert len(events) >= 4
    assert {(r[1], r[2], r[3]) for r in rows} == {(POD["POD_NAME"], "small-0", rows[0][4])}
    assert not list((tmp_path / POD["POD_UID"] / INSTANCES).glob("seg-*.jsonl")), "all shipped"


async def test_a_second_sidecar_on_a_locked_spool_does_not_start(tmp_path):
    """The same instance twice: the second waits for the spool's lock, then fails naming it."""
    config = make_config(f"http://127.0.0.1:{free_port()}", **{"sidecar.spool_dir": str(tmp_path)})
    first, second = Sidecar(config, "small-0"), Sidecar(config, "small-0")
    await first.startup()
    try:
        with pytest.raises(SpoolBusyError, match=str(tmp_path / "small-0")):
            await second.lifetime.claim(wait_seconds=0.2)
    finally:
        await first.shutdown()
    await second.startup()
    await second.shutdown()


def test_an_invalid_identity_variable_stops_the_sidecar_with_exit_2(monkeypatch, capsys):
    """A pod name that cannot be an id is a one-line start-up error naming the variable."""
    monkeypatch.setenv("POD_NAME", "not a pod name!")
    assert main(["sidecar", "--replica", "small-0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        "infermeter: cannot tell which instance this is: environment variable POD_NAME="
    )
