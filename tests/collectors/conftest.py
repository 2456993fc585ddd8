"""A demo fleet on loopback: replica small-0 simulated for real and node-b's dcgm-exporter."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from infermeter.config import Config
from infermeter.serving import free_port
from simulator.dcgm import NodeExporter, node_exporters
from simulator.replica import ReplicaSim, replica_spec
from tests.ports import off_demo_ports
from tests.servers import serving


@pytest.fixture
def fleet_config(config: Config) -> Callable[..., Config]:
    """The demo config on free ports (nothing listens on them), collector settings set."""

    def make(small_gpus: list[int] | None = None, **collector: Any) -> Config:
        data = off_demo_ports(config.model_dump())
        for r in data["replicas"]:
            if r["id"] == "small-0" and small_gpus is not None:
                r["gpus"] = small_gpus
        data["collector"].update(collector)
        return Config.model_validate(data)

    return make


def targets_down(config: Config, spool_dir: Path) -> Config:
    """``config`` with every dcgm-exporter and replica on a free loopback port where nothing
    listens, the collector spooling to ``spool_dir`` and giving up on a scrape after 0.5 s."""
    data = config.model_dump()
    data["collector"].update(spool_dir=str(spool_dir), scrape_timeout_seconds=0.5)
    for n in data["nodes"]:
        n["dcgm_exporter_url"] = f"http://127.0.0.1:{free_port()}/metrics"
    for r in data["replicas"]:
        r["upstream_url"] = f"http://127.0.0.1:{free_port()}"
    return Config.model_validate(data)


@dataclass
class Fleet:
    """What runs: the replica simulator, its URL, node-b's exporter and its /metrics URL."""

    config: Config
    sim: ReplicaSim
    replica_url: str
    node: NodeExporter
    dcgm_url: str
    client: httpx.AsyncClient


@pytest.fixture
def running_fleet() -> Callable[[Config], Any]:
    """Start small-0 and node-b's dcgm-exporter stand-in for real on loopback."""

    def start(cfg: Config) -> Any:
        return _running(cfg)

    return start


async def _fleet(cfg: Config) -> AsyncIterator[Fleet]:
    replica = cfg.replica("small-0")
    node_cfg = next(n for n in cfg.nodes if n.name == "node-b")
    assert node_cfg.dcgm_exporter_url is not None
    sim = ReplicaSim(replica_spec(cfg, "small-0"))
    dcgm_port = int(node_cfg.dcgm_exporter_url.split(":")[2].split("/")[0])
    port = int(replica.upstream_url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(timeout=60) as client:
        node = node_exporters(cfg, client)["node-b"]
        async with serving(sim, port) as url, serving(node, dcgm_port, lifespan="off"):
            yield Fleet(cfg, sim, url, node, node_cfg.dcgm_exporter_url, client)


def _running(cfg: Config) -> Any:
    import contextlib

    return contextlib.asynccontextmanager(_fleet)(cfg)
