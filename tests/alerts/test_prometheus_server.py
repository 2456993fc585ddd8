"""A real Prometheus evaluates the rendered rules over a simulated replica under overload."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from alerts.cli import write_rules
from collectors.loop import FleetCollector
from collectors.metrics import create_app
from collectors.serve import build_collector
from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from sidecar.app import Sidecar
from simulator.dcgm import node_exporters
from simulator.replica import ReplicaSim, replica_spec
from tests.alerts.prometheus import running_prometheus
from tests.servers import serving

METRICS_TOKEN = "im-demo-metrics"
TEAM_KEY = "im-demo-search"
WATCHED = {"InfermeterQueueBacklog", "InfermeterTTFTAboveSLA"}


def _fast_config(tmp_path: Path) -> Config:
    """The demo fleet cut to small-0 on free ports, with short windows and low thresholds.

    The engine takes 2 sequences at a time and the sidecar admits everything (no
    ``max_num_seqs`` on the replica), so a dozen concurrent clients queue in vLLM itself.
    """
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    [small] = [r for r in data["replicas"] if r["id"] == "small-0"]
    small.pop("max_num_seqs")
    small["upstream_url"] = f"http://127.0.0.1:{free_port()}"
    data["replicas"] = [small]
    data["nodes"] = [
        {**n, "dcgm_exporter_url": f"http://127.0.0.1:{free_port()}/metrics"}
        for n in data["nodes"]
        if n["name"] == "node-b"
    ]
    data["simulator"]["engines"]["chat-small"].update(
        max_num_seqs=2, step_base_ms=10, step_per_seq_ms=0.0
    )
    for m in data["models"]:
        m["sla"]["ttft_p95_seconds"] = 0.25
    data["scaling"].update(scale_up_queue_depth=2, scale_up_after_seconds=2)
    data["collector"].update(scrape_interval_seconds=1, spool_dir=str(tmp_path / "cspool"))
    data["alerts"] = {
        "evaluation_interval_seconds": 1,
        "rate_window_seconds": 8,
        "sla_for_seconds": 2,
    }
    return Config.model_validate(data)


@dataclass
class Fleet:
    """Where Prometheus finds each part."""

    replica: str
    sidecar: str
    collector: str


@contextlib.asynccontextmanager
async def _fleet(config: Config, tmp_path: Path) -> AsyncIterator[Fleet]:
    replica = config.replica("small-0")
    port = int(replica.upstream_url.rsplit(":", 1)[1])
    [node] = config.nodes
    assert node.dcgm_exporter_url is not None
    dcgm_port = int(node.dcgm_exporter_url.split(":")[2].split("/")[0])
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
        sim = ReplicaSim(replica_spec(config, "small-0"))
        replica_url = await stack.enter_async_context(serving(sim, port))
        exporter = node_exporters(config, client)["node-b"]
        await stack.enter_async_context(serving(exporter, dcgm_port, lifespan="off"))
        sidecar = Sidecar(config, "small-0", spool_dir=tmp_path / "spool")
        sidecar_url = await stack.enter_async_context(serving(sidecar))
        collector: FleetCollector = build_collector(config, client)
        collector_url = await stack.enter_async_context(serving(create_app(collector)))
        task = asyncio.create_task(collector.run())
        try:
            yield Fleet(replica_url, sidecar_url, collector_url)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _scrape_configs(fleet: Fleet) -> list[dict[str, Any]]:
    def job(name: str, url: str, **extra: Any) -> dict[str, Any]:
        return {
            "job_name": name,
            "static_configs": [{"targets": [url.removeprefix("http://")]}],
            **extra,
        }

    return [
        job("vllm", fleet.replica),
        job("infermeter-sidecar", fleet.sidecar, authorization={"credentials": METRICS_TOKEN}),
        job("infermeter-collector", fleet.collector),
    ]


async def _active(client: httpx.AsyncClient, prometheus: str) -> dict[str, str]:
    """Watched alert name -> pending or firing, as Prometheus' API reports them now."""
    body = (await client.get(f"{prometheus}/api/v1/alerts")).json()
    states: dict[str, str] = {}
    for alert in body["data"]["alerts"]:
        name = alert["labels"]["alertname"]
        if name in WATCHED and states.get(name) != "firing":
            states[name] = alert["state"]
    return states


async def _until(
    client: httpx.AsyncClient, prometheus: str, want: dict[str, str], seconds: float
) -> dict[str, str]:
    """Poll the alerts until they are exactly ``want`` (or time runs out); the last reading."""
    deadline = time.monotonic() + seconds
    states = await _active(client, prometheus)
    while states != want and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        states = await _active(client, prometheus)
    return states


async def _targets_up(client: httpx.AsyncClient, prometheus: str, seconds: float) -> dict[str, str]:
    """Job -> health of its target, once all are up (or time runs out)."""
    deadline = time.monotonic() + seconds
    while True:
        body = (await client.get(f"{prometheus}/api/v1/targets")).json()
        health = {t["labels"]["job"]: t["health"] for t in body["data"]["activeTargets"]}
        if set(health.values()) == {"up"} or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.5)


async def _load(sidecar: str, stop: asyncio.Event, clients: int) -> int:
    """Streamed chat requests from ``clients`` loops until ``stop``; how many completed."""
    done = 0
    body = {
        "model": "chat-small",
        "stream": True,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "tell me about queues"}],
    }

    async def one_client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while not stop.is_set():
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for _ in response.aiter_bytes():
                    pass
            done += 1

    headers = {"authorization": f"Bearer {TEAM_KEY}"}
    async with httpx.AsyncClient(base_url=sidecar, headers=headers, timeout=60) as http:
        await asyncio.gather(*(one_client(http) for _ in range(clients)))
    return done


async def test_overload_fires_queue_and_ttft_alerts_which_resolve_after_it(tmp_path):
    """Queue backlog and TTFT over SLA fire under overload, via Prometheus, then resolve."""
    config = _fast_config(tmp_path)
    write_rules(config, "test config", tmp_path / "rules")
    async with _fleet(config, tmp_path) as fleet, httpx.AsyncClient(timeout=5) as client:
        with running_prometheus(tmp_path, _scrape_configs(fleet), ["rules/*.yml"]) as prometheus:
            health = await _targets_up(client, prometheus, 20)
            assert health == {
                "vllm": "up",
                "infermeter-sidecar": "up",
                "infermeter-collector": "up",
            }
            assert await _active(client, prometheus) == {}, "alerts active before any traffic"
            stop = asyncio.Event()
            load = asyncio.create_task(_load(fleet.sidecar, stop, clients=12))
            try:
                fired = await _until(client, prometheus, dict.fromkeys(WATCHED, "firing"), 45)
            finally:
                stop.set()
                completed = await load
            assert fired == dict.fromkeys(WATCHED, "firing"), f"after {completed} requests"
            resolved = await _until(client, prometheus, {}, 45)
            assert resolved == {}
