"""``infermeter collect``: the scrape loop, engine discovery, the sample spools and shippers, and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client import CollectorRegistry

from collectors.adopt import Adopter, AdoptionMetrics
from collectors.baseline import BaselineFile
from collectors.dcgm import DcgmSource
from collectors.discovery import OnTargets, PodWatcher, RegistryPoller
from collectors.loop import Batch, FleetCollector
from collectors.metrics import create_app, scrapers
from collectors.nvml import NvmlSource
from collectors.sources import EngineSource, GpuSource
from collectors.targets import EngineTarget, PodRules, placements, static_targets
from collectors.vllm import VllmSource
from infermeter.config import Config, env_value, process_environment
from infermeter.kubernetes import ca_verify, in_cluster_api
from infermeter.otlp import metrics_export_configured, otlp_settings
from infermeter.serving import ensure_free, host_port, server
from infermeter.shipper import Shipper, ShipperMetrics, last_shipment
from infermeter.spool import Spool
from infermeter.writers import Credential, Role, Sealer, credential_from

if TYPE_CHECKING:
    from infermeter.otlp_export import MetricsExport

__all__ = [
    "SpoolSink",
    "build_collector",
    "collector_credential",
    "engine_sources",
    "metrics_export",
    "pod_watcher",
    "registry_poller",
    "serve_collector",
]

log = logging.getLogger("infermeter.collectors")

GPU_KIND = "gpu_samples"
# Each GPU's last reading, beside the spools (``collectors.baseline``).
BASELINE_FILE = "gpu-baseline.json"
ENGINE_KIND = "engine_samples"


def build_collector(
    config: Config, client: httpx.AsyncClient, environ: Mapping[str, str] | None = None
) -> FleetCollector:
    """A collector over the configuration's sources: dcgm-exporter per node (or local NVML).

    Engines are the configured replicas under static discovery; otherwise none until the
    registry or the Kubernetes API names them.
    """
    settings = config.collector
    env = process_environment() if environ is None else environ
    gpu_sources: list[GpuSource]
    if settings.source == "nvml":
        host = env.get(settings.node_name_env) or socket.gethostname()
        node = next((n for n in config.node_names() if n == host), host)
        gpu_sources = [NvmlSource(node)]
    elif settings.dcgm_exporter_url:
        node = env.get(settings.node_name_env) or socket.gethostname()
        gpu_sources = [
            DcgmSource(node, settings.dcgm_exporter_url, client, settings.scrape_timeout_seconds)
        ]
    else:
        gpu_sources = [
            DcgmSource(n.name, n.dcgm_exporter_url, client, settings.scrape_timeout_seconds)
            for n in config.nodes
            if n.dcgm_exporter_url
        ]
    static = static_targets(config.replicas) if settings.discovery == "static" else {}
    return FleetCollector(config, gpu_sources, engine_sources(config, static, client, env))


def engine_sources(
    config: Config,
    targets: Mapping[str, EngineTarget],
    client: httpx.AsyncClient,
    environ: Mapping[str, str],
) -> list[EngineSource]:
    """One vLLM source per target; the metrics token only to the sidecar relays that need it."""
    settings = config.collector
    token = environ.get(settings.metrics_token_env) or None
    return [
        VllmSource(
            t.replica,
            t.url,
            client,
            settings.scrape_timeout_seconds,
            token if t.token else None,
            t.instance,
            t.node,
        )
        for t in targets.values()
    ]


def registry_poller(
    config: Config, client: httpx.AsyncClient, on_targets: OnTargets, environ: Mapping[str, str]
) -> RegistryPoller:
    """Engine targets from billing's instance registry, asked with the metrics token."""
    r = config.collector.registry
    return RegistryPoller(
        r.url or config.billing.url,
        client,
        config.replicas,
        on_targets,
        environ.get(config.collector.metrics_token_env) or None,
        r.refresh_seconds,
        r.timeout_seconds,
    )


def pod_watcher(
    config: Config, on_targets: OnTargets, environ: Mapping[str, str]
) -> tuple[PodWatcher, httpx.AsyncClient]:
    """Engine targets from the vLLM pods (on this node when its name is known), and the API's client.

    With no ``api_url`` the pod's service account: the in-cluster address, CA and token file.
    KubernetesApiError when neither is there.
    """
    settings = config.collector
    k = settings.kubernetes
    token_file = None
    if k.api_url:
        api_url, token = k.api_url, environ.get(k.token_env) or None
        client = httpx.AsyncClient(verify=ca_verify(k.ca_file, "ca_file"))
    else:
        api_url, token_file, context = in_cluster_api(environ)
        token = None
        client = httpx.AsyncClient(verify=context)
    rules = PodRules(k.replica_label, k.sidecar_port, k.engine_metrics_path)
    watcher = PodWatcher(
        api_url,
        k.namespace,
        k.label_selector,
        client,
        config.replicas,
        on_targets,
        rules=rules,
        node_name=environ.get(settings.node_name_env),
        token=token,
        token_file=token_file,
        watch_timeout_seconds=k.watch_timeout_seconds,
        retry_seconds=k.retry_seconds,
    )
    return watcher, client


def metrics_export(
    collector: FleetCollector, registry: CollectorRegistry, environ: Mapping[str, str]
) -> MetricsExport | None:
    """The GPU readings over OTLP when the OTEL_* variables ask for it (``collectors.otlp_metrics``).

    The SDK is imported only then (its exporter reads the rest of the variables from the
    process environment). OtlpConfigError for a protocol or interval it cannot honour.
    """
    if not metrics_export_configured(environ):
        return None
    from collectors.otlp_metrics import SCHEMA_URL, GpuExport
    from infermeter.otlp_export import make_metrics_export

    return make_metrics_export(
        otlp_settings(environ),
        "infermeter-collector",
        "infermeter.collector",
        {"service.instance.id": socket.gethostname()},
        [GpuExport(collector).produce],
        registry,
        SCHEMA_URL,
    )


def collector_credential(
    config: Config, collector: FleetCollector, environ: Mapping[str, str]
) -> Credential | None:
    """The collector's writer credential (``collector.credential_env``; None when unset).

    WriterError when the variable holds another writer's. A node this collector reads GPUs of
    that its credential does not cover is logged: billing would quarantine those samples.
    """
    credential = credential_from(environ, config.collector.credential_env, Role.COLLECTOR)
    if credential is not None:
        outside = sorted({s.target for s in collector.gpu_sources} - set(credential.writer.nodes))
        if outside:
            log.error(
                "collector: its credential (%s) does not cover node(s) %s: billing will "
                "quarantine their samples",
                credential.writer.principal,
                ", ".join(outside),
            )
    return credential


class SpoolSink:
    """Appends each round's samples to one spool per kind (group-committed, durable).

    ``sealer``: the collector's seal on each line (``infermeter.writers.Sealer``).
    """

    def __init__(self, directory: Path, sealer: Callable[[bytes], bytes] | None = None) -> None:
        self.gpus = Spool(directory / GPU_KIND, sealer=sealer)
        self.engines = Spool(directory / ENGINE_KIND, sealer=sealer)

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
    # Scrapes come every 10 s, after httpx's 5 s keep-alive expiry: connections are not reused.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client, contextlib.AsyncExitStack() as stack:
        env = process_environment()
        collector = build_collector(config, client, env)

        def on_targets(targets: Mapping[str, EngineTarget]) -> None:
            collector.replace_engine_sources(engine_sources(config, targets, client, env))
            # GPUs are joined to the instances discovery found by their pod labels and devices.
            collector.place(placements(targets))

        # Found before anything runs: outside a cluster with no api_url this raises, and the
        # command stops with one line.
        discover: Callable[[], Coroutine[Any, Any, None]] | None = None
        if settings.discovery == "registry":
            discover = registry_poller(config, client, on_targets, env).run
        elif settings.discovery == "kubernetes":
            watcher, api = pod_watcher(config, on_targets, env)
            await stack.enter_async_context(api)
            discover = watcher.run
        credential = collector_credential(config, collector, env)
        sink = SpoolSink(Path(settings.spool_dir), Sealer(credential) if credential else None)
        sink.open()
        collector.restore(BaselineFile(Path(settings.spool_dir) / BASELINE_FILE), time.time())
        tasks = [asyncio.create_task(collector.run(sink), name="collector")]
        if discover is not None:
            tasks.append(asyncio.create_task(discover(), name=f"discover-{settings.discovery}"))
        registry = CollectorRegistry()
        export = metrics_export(collector, registry, env)
        if export is not None:
            tasks.append(asyncio.create_task(export.run(), name="otlp-metrics"))
        shippers: list[Shipper] = []
        if settings.ingest_url:
            token = env_value(settings.ingest_token_env)
            shipped = ShipperMetrics(registry)
            for spool, kind in ((sink.gpus, GPU_KIND), (sink.engines, ENGINE_KIND)):
                shipper = Shipper(
                    spool,
                    settings.ingest_url,
                    token,
                    kind,
                    client,
                    metrics=shipped,
                    credential=credential,
                )
                shippers.append(shipper)
                tasks.append(asyncio.create_task(shipper.run(), name=f"ship-{kind}"))
            if settings.adopt_spools_dir:
                adopter = Adopter(
                    Path(settings.adopt_spools_dir),
                    settings.ingest_url,
                    token,
                    client,
                    AdoptionMetrics(registry),
                    shipped,
                    settings.scrape_interval_seconds,
                    exclude=[Path(settings.spool_dir)],
                    credential=credential,
                    keep_nonces_seconds=2 * config.sidecar.gateway.max_skew_seconds,
                )
                tasks.append(asyncio.create_task(adopter.run(), name="adopt-spools"))
        elif settings.adopt_spools_dir:
            log.warning(
                "collector.adopt_spools_dir is set but collector.ingest_url is not: "
                "the spools of sidecars that are gone are not shipped"
            )
        log.info(
            "collector: %d GPU targets, engines from %s discovery, /metrics on "
            "http://%s:%d/metrics",
            len(collector.gpu_sources),
            settings.discovery,
            host,
            port,
        )
        try:
            await server(create_app(collector, registry, scrapers(config)), host, port).serve()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await sink.close()
            # The last samples go to billing now, not at the next start (which may not come: a
            # node drained for good). What billing does not take in time stays spooled.
            await last_shipment(shippers, settings.drain_ship_seconds)
            left = sink.gpus.backlog + sink.engines.backlog
            if shippers and left:
                log.warning(
                    "collector: %d sample(s) left unshipped in %s", left, settings.spool_dir
                )
            if export is not None:
                await export.close()
