"""Run simulated replicas and dcgm-exporter stand-ins as real HTTP servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import uvicorn

from infermeter.config import Config
from infermeter.serving import ensure_free, host_port, server
from simulator.dcgm import node_exporters
from simulator.replica import ReplicaSim, replica_spec

__all__ = ["serve_dcgm", "serve_replica"]


def replica_server(
    config: Config, replica_id: str, listen: str | None = None, instance: str | None = None
) -> tuple[ReplicaSim, uvicorn.Server]:
    """The simulator and server of one replica (or ``instance`` of it), on ``listen``.

    ``listen`` defaults to the replica's ``upstream_url``: an instance of a group needs its own.
    """
    replica = config.replica(replica_id)
    host, port = host_port(listen or replica.upstream_url)
    ensure_free(host, port, f"replica {instance or replica_id} address")
    sim = ReplicaSim(replica_spec(config, replica_id, instance))
    return sim, server(sim, host, port)


async def serve_replica(
    config: Config, replica_id: str, listen: str | None = None, instance: str | None = None
) -> None:
    """Serve one replica until the server is told to exit."""
    _, srv = replica_server(config, replica_id, listen, instance)
    await srv.serve()


async def serve_dcgm(config: Config) -> None:
    """Serve every node's dcgm-exporter stand-in in this process."""
    servers = []
    async with httpx.AsyncClient() as client:
        instances = Path(config.simulator.instances_file)
        for name, app in node_exporters(config, client, instances).items():
            node = next((n for n in config.nodes if n.name == name), None)
            if node is None or node.dcgm_exporter_url is None:
                continue
            host, port = host_port(node.dcgm_exporter_url)
            ensure_free(host, port, f"dcgm-exporter of node {name}")
            servers.append(server(app, host, port))
        for srv in servers:
            srv.config.lifespan = "off"
        await asyncio.gather(*(srv.serve() for srv in servers))
