"""The collector's own /metrics: the joined fleet view, built fresh on every scrape.

``FleetMetrics`` is a prometheus-client custom collector that reads ``FleetCollector``'s latest
view inside ``collect()``; it holds no metric objects of its own. ``create_app`` serves it from
its own ``CollectorRegistry`` (never the global one) next to ``/healthz``.

``/metrics`` needs the metrics or admin token, like every other service's: it is per-GPU and
per-instance telemetry of the whole fleet (which GPU each team's model runs on, how busy, how
much power), which billing shows the admin only. Open when the configuration sets neither
token (``scrapers``), as the sidecar's is; ``/healthz`` is always open.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from collectors.loop import FleetCollector
from infermeter.asgi import Receive, Scope, Send, idle_lifespan, respond
from infermeter.auth import ADMIN, METRICS, AuthError, KeyRing, bearer_key
from infermeter.config import Config
from infermeter.errors import error_body
from infermeter.records import EngineSample, GpuSample

__all__ = ["FleetMetrics", "create_app", "scrapers"]

_NEEDS_TOKEN = error_body(
    401,
    "The metrics endpoint needs the metrics or admin token.",
    "invalid_request_error",
    "invalid_api_key",
)
_JSON = (b"content-type", b"application/json")

MIB = 2**20
GPU_LABELS = ["node", "gpu", "uuid", "replica", "model"]
REPLICA_LABELS = ["replica", "model"]
# Not "instance": Prometheus gives every scraped series that label (the scrape target).
INSTANCE_LABELS = ["instance_id", "replica", "model"]
TARGET_LABELS = ["target", "kind"]


class FleetMetrics(Collector):
    """Builds every family from the collector's current view at scrape time."""

    def __init__(self, collector: FleetCollector) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        """Per-GPU, per-replica and self-monitoring families."""
        samples = [s for group in self.collector.gpus.values() for s in group]
        yield from self._gpu_families(samples)
        yield from self._replica_families(samples)
        yield from self._instance_families()
        yield from self._target_families()

    def _gpu_families(self, samples: list[GpuSample]) -> Iterator[Metric]:
        util = GaugeMetricFamily(
            "infermeter_gpu_utilization_ratio",
            "GPU (or MIG slice) utilization, 0 to 1.",
            labels=GPU_LABELS,
        )
        power = GaugeMetricFamily(
            "infermeter_gpu_power_watts",
            "GPU power draw (a MIG slice's share of its board).",
            labels=GPU_LABELS,
        )
        energy = CounterMetricFamily(
            "infermeter_gpu_energy_joules",
            "Energy drawn since the collector started, gaps excluded.",
            labels=GPU_LABELS,
        )
        used = GaugeMetricFamily(
            "infermeter_gpu_memory_used_bytes", "Framebuffer memory in use.", labels=GPU_LABELS
        )
        free = GaugeMetricFamily(
            "infermeter_gpu_memory_free_bytes", "Framebuffer memory free.", labels=GPU_LABELS
        )
        xid = GaugeMetricFamily(
            "infermeter_gpu_xid_errors", "Code of the last XID error (0: none).", labels=GPU_LABELS
        )
        for s in samples:
            labels = [s.node, s.gpu, s.uuid, s.replica or "", s.model or ""]
            util.add_metric(labels, s.utilization)
            power.add_metric(labels, s.power_watts)
            energy.add_metric(labels, self.collector.gpu_energy_joules.get((s.node, s.gpu), 0.0))
            used.add_metric(labels, s.memory_used_mib * MIB)
            free.add_metric(labels, s.memory_free_mib * MIB)
            xid.add_metric(labels, s.xid_errors)
        yield from (util, power, energy, used, free, xid)

    def _replica_families(self, samples: list[GpuSample]) -> Iterator[Metric]:
        by_replica: dict[tuple[str, str], list[GpuSample]] = defaultdict(list)
        for s in samples:
            if s.replica is not None:
                by_replica[(s.replica, s.model or "")].append(s)
        util = GaugeMetricFamily(
            "infermeter_replica_gpu_utilization_ratio",
            "Mean utilization of the replica's GPUs, 0 to 1.",
            labels=REPLICA_LABELS,
        )
        power = GaugeMetricFamily(
            "infermeter_replica_gpu_power_watts",
            "Power drawn by the replica's GPUs.",
            labels=REPLICA_LABELS,
        )
        energy = CounterMetricFamily(
            "infermeter_replica_gpu_energy_joules",
            "Energy drawn by the replica's GPUs since the collector started.",
            labels=REPLICA_LABELS,
        )
        memory = GaugeMetricFamily(
            "infermeter_replica_gpu_memory_used_bytes",
            "Framebuffer memory in use on the replica's GPUs.",
            labels=REPLICA_LABELS,
        )
        gpus = GaugeMetricFamily(
            "infermeter_replica_gpus",
            "GPUs (or MIG slices) attributed to the replica.",
            labels=REPLICA_LABELS,
        )
        for (replica, model), group in sorted(by_replica.items()):
            labels = [replica, model]
            util.add_metric(labels, sum(s.utilization for s in group) / len(group))
            power.add_metric(labels, sum(s.power_watts for s in group))
            energy.add_metric(labels, self.collector.replica_energy_joules.get(replica, 0.0))
            memory.add_metric(labels, sum(s.memory_used_mib for s in group) * MIB)
            gpus.add_metric(labels, len(group))
        queue = GaugeMetricFamily(
            "infermeter_replica_queue_depth",
            "Requests waiting in the engine's queue (vllm:num_requests_waiting).",
            labels=REPLICA_LABELS,
        )
        running = GaugeMetricFamily(
            "infermeter_replica_requests_running",
            "Requests in the engine's running batch.",
            labels=REPLICA_LABELS,
        )
        kv = GaugeMetricFamily(
            "infermeter_replica_kv_cache_usage_ratio",
            "KV-cache blocks in use, 0 to 1.",
            labels=REPLICA_LABELS,
        )
        # A group of several instances is one series: queues and batches add up, KV use is the mean.
        by_group: dict[tuple[str, str], list[EngineSample]] = defaultdict(list)
        for e in self.collector.engines.values():
            by_group[(e.replica, e.model)].append(e)
        for (replica, model), engines in sorted(by_group.items()):
            labels = [replica, model]
            queue.add_metric(labels, sum(e.requests_waiting for e in engines))
            running.add_metric(labels, sum(e.requests_running for e in engines))
            kv.add_metric(labels, sum(e.kv_cache_usage for e in engines) / len(engines))
        yield from (util, power, energy, memory, gpus, queue, running, kv)

    def _instance_families(self) -> Iterator[Metric]:
        queue = GaugeMetricFamily(
            "infermeter_instance_queue_depth",
            "Requests waiting in one engine instance's queue (vllm:num_requests_waiting).",
            labels=INSTANCE_LABELS,
        )
        running = GaugeMetricFamily(
            "infermeter_instance_requests_running",
            "Requests in one engine instance's running batch.",
            labels=INSTANCE_LABELS,
        )
        kv = GaugeMetricFamily(
            "infermeter_instance_kv_cache_usage_ratio",
            "KV-cache blocks in use in one engine instance, 0 to 1.",
            labels=INSTANCE_LABELS,
        )
        # The engine's own counters, passed on per instance: a sum over a group would fall when
        # one instance restarts, and rate() would read that as a reset of the whole group.
        preempted = CounterMetricFamily(
            "infermeter_instance_preemptions",
            "Sequences the engine preempted (vllm:num_preemptions).",
            labels=INSTANCE_LABELS,
        )
        queries = CounterMetricFamily(
            "infermeter_instance_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries).",
            labels=INSTANCE_LABELS,
        )
        hits = CounterMetricFamily(
            "infermeter_instance_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (vllm:prefix_cache_hits).",
            labels=INSTANCE_LABELS,
        )
        for e in sorted(
            self.collector.engines.values(), key=lambda e: (e.replica, e.instance or "")
        ):
            labels = [e.instance or e.replica, e.replica, e.model]
            queue.add_metric(labels, e.requests_waiting)
            running.add_metric(labels, e.requests_running)
            kv.add_metric(labels, e.kv_cache_usage)
            preempted.add_metric(labels, e.preemptions_total)
            queries.add_metric(labels, e.prefix_cache_queries_total)
            hits.add_metric(labels, e.prefix_cache_hits_total)
        yield from (queue, running, kv, preempted, queries, hits)

    def _target_families(self) -> Iterator[Metric]:
        c = self.collector
        up = GaugeMetricFamily(
            "infermeter_collector_target_up",
            "1 if the last scrape of the target succeeded.",
            labels=TARGET_LABELS,
        )
        took = GaugeMetricFamily(
            "infermeter_collector_scrape_duration_seconds",
            "How long the last scrape of the target took.",
            labels=TARGET_LABELS,
        )
        errors = CounterMetricFamily(
            "infermeter_collector_scrape_errors",
            "Failed scrapes of the target.",
            labels=TARGET_LABELS,
        )
        refused = CounterMetricFamily(
            "infermeter_collector_refused_values",
            "Values the target sent that cannot be true (NaN, infinite, negative, more than the "
            "board can draw, a GPU's field given twice with different values), not used.",
            labels=TARGET_LABELS,
        )
        duplicates = CounterMetricFamily(
            "infermeter_collector_duplicate_gpus",
            "GPU boards the target reported that another target reports too, sampled there only.",
            labels=TARGET_LABELS,
        )
        for state in c.states.values():
            labels = [state.target, state.kind]
            up.add_metric(labels, 1.0 if state.up else 0.0)
            took.add_metric(labels, state.scrape_seconds)
            errors.add_metric(labels, state.errors_total)
            refused.add_metric(labels, state.refused_values_total)
            duplicates.add_metric(labels, state.duplicate_gpus_total)
        yield from (up, took, errors, refused, duplicates)
        yield CounterMetricFamily(
            "infermeter_collector_gaps",
            "GPU intervals recorded as gaps (no energy).",
            value=c.gaps_total,
        )
        yield CounterMetricFamily(
            "infermeter_collector_round_errors",
            "Scrape rounds that failed unexpectedly.",
            value=c.round_errors_total,
        )
        yield CounterMetricFamily(
            "infermeter_collector_spool_errors",
            "Batches of samples that could not be spooled.",
            value=c.sink_errors_total,
        )


def scrapers(config: Config) -> KeyRing | None:
    """Who may read ``/metrics``: the admin and metrics tokens; None (anyone) when neither is set."""
    if not (config.admin_token_sha256 or config.metrics_token_sha256):
        return None
    return KeyRing([(ADMIN, config.admin_token_sha256), (METRICS, config.metrics_token_sha256)])


def _allowed(ring: KeyRing | None, scope: Scope) -> bool:
    if ring is None:
        return True
    header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
    try:
        ring.team_for(bearer_key(header.decode("latin-1") if header is not None else None))
    except AuthError:
        return False
    return True


def create_app(
    collector: FleetCollector,
    registry: CollectorRegistry | None = None,
    scraper_keys: KeyRing | None = None,
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The collector's ASGI app: ``/metrics`` (fleet view) and ``/healthz``.

    ``scraper_keys``: the tokens ``/metrics`` asks for (``scrapers``); None serves it to anyone.
    """
    registry = registry or CollectorRegistry()
    registry.register(FleetMetrics(collector))
    metrics = make_asgi_app(registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await idle_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics":
            if not _allowed(scraper_keys, scope):
                await respond(send, 401, _NEEDS_TOKEN, [_JSON])
                return
            await metrics(scope, receive, send)
            return
        status, body = (200, b"ok\n") if scope["path"] == "/healthz" else (404, b"not found\n")
        await respond(send, status, body, [(b"content-type", b"text/plain; charset=utf-8")])

    return app
