"""Run simulated replicas and dcgm-exporter stand-ins as real HTTP servers."""

from __future__ import annotations

import asyncio

import httpx
import uvicorn

from infermeter.config import Config
from infermeter.serving import ensure_free, host_port, server
from simulator.dcgm import node_exporters
from simulator.replica import ReplicaSim, replica_spec

__all__ = ["serve_dcgm", "serve_replica"]


def replica_server(config: Config, replica_id: str) -> tuple[ReplicaSim, uvicorn.Server]:
    """The simulator and server of one replica, bound to its ``upstream_url``."""
    replica = config.replica(replica_id)
    host, port = host_port(replica.upstream_url)
    ensure_free(host, port, f"replica {replica_id} upstream_url")
    sim = ReplicaSim(replica_spec(config, replica_id))
    return sim, server(sim, host, port)


async def serve_replica(config: Config, replica_id: str) -> None:
    """Serve one replica until the server is told to exit."""
    _, srv = replica_server(config, replica_id)
    await srv.serve()


async def serve_dcgm(config: Config) -> None:
    """Serve every node's dcgm-exporter stand-in in this process."""
    servers = []
    async with httpx.AsyncClient() as client:
        for name, app in node_exporters(config, client).items():
            node = next((n for n in config.nodes if n.name == name), None)
            if node is None or node.dcgm_exporter_url is None:
                continue
            host, port = host_port(node.dcgm_exporter_url)
            ensure_free(host, port, f"dcgm-exporter of node {name}")
            servers.append(server(app, host, port))
        for srv in servers:
            srv.config.lifespan = "off"
        await asyncio.gather(*(srv.serve() for srv in servers))
