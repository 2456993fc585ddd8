"""Run simulated replicas and dcgm-exporter stand-ins as real HTTP servers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import uvicorn

from infermeter.config import Config
from infermeter.serving import ensure_free, host_port, server
from simulator.dcgm import NodeExporter, node_exporters
from simulator.replica import ReplicaSim, replica_spec
from simulator.truth import TruthWriter, open_truth

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
    truth = open_truth(config.simulator.truth_dir, f"replica-{instance or replica_id}")
    sim = ReplicaSim(replica_spec(config, replica_id, instance), truth=truth)
    return sim, server(sim, host, port)


async def serve_replica(
    config: Config, replica_id: str, listen: str | None = None, instance: str | None = None
) -> None:
    """Serve one replica until the server is told to exit."""
    _, srv = replica_server(config, replica_id, listen, instance)
    await srv.serve()


BOARD_TRUTH_SECONDS = 1.0


async def record_boards(exporter: NodeExporter, writer: TruthWriter, every: float) -> None:
    """Write each board's holder and counters every ``every`` seconds (the ground-truth log)."""
    while True:
        t = time.time()
        for board in await exporter.boards():
            gpu = board.gpu
            writer.write(
                "board",
                {
                    "node": exporter.node,
                    "index": gpu.index,
                    "uuid": gpu.uuid,
                    "gpu_model": board.gpu_model,
                    "holder": board.holder,
                    "replica": board.replica,
                    "t": t,
                    "energy_j": board.energy_j,
                    "busy_s": board.busy_s,
                },
            )
        await asyncio.sleep(max(0.0, t + every - time.time()))


async def serve_dcgm(config: Config) -> None:
    """Serve every node's dcgm-exporter stand-in in this process.

    With ``simulator.truth_dir`` set, each node's boards also go to the ground-truth log.
    """
    servers = []
    tasks = []
    async with httpx.AsyncClient() as client:
        instances = Path(config.simulator.instances_file)
        for name, app in node_exporters(config, client, instances).items():
            truth = open_truth(config.simulator.truth_dir, f"dcgm-{name}")
            if truth is not None:
                tasks.append(asyncio.create_task(record_boards(app, truth, BOARD_TRUTH_SECONDS)))
            node = next((n for n in config.nodes if n.name == name), None)
            if node is None or node.dcgm_exporter_url is None:
                continue
            host, port = host_port(node.dcgm_exporter_url)
            ensure_free(host, port, f"dcgm-exporter of node {name}")
            servers.append(server(app, host, port))
        for srv in servers:
            srv.config.lifespan = "off"
        await asyncio.gather(*(srv.serve() for srv in servers))
