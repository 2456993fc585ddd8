"""``infermeter collect``: the scrape loop, the sample spools and shippers, and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from collectors.adopt import Adopter, AdoptionMetrics
from collectors.dcgm import DcgmSource
from collectors.loop import Batch, FleetCollector
from collectors.metrics import create_app
from collectors.nvml import NvmlSource
from collectors.sources import EngineSource, GpuSource
from collectors.vllm import VllmSource
from infermeter.config import Config
from infermeter.serving import ensure_free, host_port, server
from infermeter.shipper import Shipper, ShipperMetrics
from infermeter.spool import Spool

__all__ = ["SpoolSink", "build_collector", "serve_collector"]

log = logging.getLogger("infermeter.collectors")

GPU_KIND = "gpu_samples"
ENGINE_KIND = "engine_samples"


def build_collector(config: Config, client: httpx.AsyncClient) -> FleetCollector:
    """A collector over the configuration's sources: dcgm-exporter per node (or local NVML)."""
    settings = config.collector
    gpu_sources: list[GpuSource]
    if settings.source == "nvml":
        host = socket.gethostname()
        node = next((n for n in config.node_names() if n == host), host)
        gpu_sources = [NvmlSource(node)]
    else:
        gpu_sources = [
            DcgmSource(n.name, n.dcgm_exporter_url, client, settings.scrape_timeout_seconds)
            for n in config.nodes
            if n.dcgm_exporter_url
        ]
    # The metrics token goes only where a relay was configured, never to a plain vLLM.
    token = os.environ.get(settings.metrics_token_env) or None
    engine_sources: list[EngineSource] = [
        VllmSource(r.id, r.engine_metrics, client, settings.scrape_timeout_seconds,
                   token if r.engine_metrics_url else None)
        for r in config.replicas
    ]  # fmt: skip
    return FleetCollector(config, gpu_sources, engine_sources)


class SpoolSink:
    """Appends each round's samples to one spool per kind (group-committed, durable)."""

    def __init__(self, directory: Path) -> None:
        self.gpus = Spool(directory / GPU_KIND)
        self.engines = Spool(directory / ENGINE_KIND)

    def open(self) -> None:
        """Create the directories and start the writers."""
        self.gpus.open()
        self.engines.open()

    async def close(self) -> None:
        """Finish the queued appends and close the open segments."""
        await self.gpus.close()
        await self.engines.close()

    async def __call__(self, batch: Batch) -> None:
        """Return once every sample of ``batch`` is on disk."""
        await asyncio.gather(
            *(self.gpus.append(s.to_json()) for s in batch.gpus),
            *(self.engines.append(s.to_json()) for s in batch.engines),
        )


async def serve_collector(config: Config, listen: str | None) -> None:
    """Scrape, spool, ship and serve /metrics until the server is told to exit."""
    settings = config.collector
    host, port = host_port(listen or settings.listen)
    ensure_free(host, port, "collector listen address")
    sink = SpoolSink(Path(settings.spool_dir))
    sink.open()
    # Scrapes come every 10 s, after httpx's 5 s keep-alive expiry: connections are not reused.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        collector = build_collector(config, client)
        tasks = [asyncio.create_task(collector.run(sink), name="collector")]
        registry = CollectorRegistry()
        if settings.ingest_url:
            token = os.environ.get(settings.ingest_token_env)
            shipped = ShipperMetrics(registry)
            for spool, kind in ((sink.gpus, GPU_KIND), (sink.engines, ENGINE_KIND)):
                shipper = Shipper(spool, settings.ingest_url, token, kind, client, metrics=shipped)
                tasks.append(asyncio.create_task(shipper.run(), name=f"ship-{kind}"))
            if settings.adopt_spools_dir:
                adopter = Adopter(Path(settings.adopt_spools_dir), settings.ingest_url, token, client,
                                  AdoptionMetrics(registry), shipped, settings.scrape_interval_seconds,
                                  exclude=[Path(settings.spool_dir)])  # fmt: skip
                tasks.append(asyncio.create_task(adopter.run(), name="adopt-spools"))
        elif settings.adopt_spools_dir:
            log.warning("collector.adopt_spools_dir is set but collector.ingest_url is not: "
                        "the spools of sidecars that are gone are not shipped")  # fmt: skip
        log.info("collector: %d GPU and %d engine targets, /metrics on http://%s:%d/metrics",
                 len(collector.gpu_sources), len(collector.engine_sources), host, port)  # fmt: skip
        try:
            await server(create_app(collector, registry), host, port).serve()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await sink.close()
