"""GPU telemetry (dcgm-exporter or NVML) and vLLM engine state, joined to replicas.

``infermeter collect`` (``collectors.serve.serve_collector``) scrapes, every
``collector.scrape_interval_seconds``, each node's dcgm-exporter (or this machine's GPUs through
NVML) and each engine instance's vLLM ``/metrics``, found by ``collector.discovery``
(``collectors.targets``, ``collectors.discovery``: the configured replicas, billing's instance
registry, or the Kubernetes API's pods, never a Service); joins every GPU to the replica group
and instance on it (``collectors.attribution``: configuration first, then the
``vllm-<replica id>`` pod label, the pod being the instance);
accounts energy from the boards' counters (``collectors.energy``: counter resets survived, gaps
recorded, never filled); appends ``GpuSample`` and ``EngineSample`` records to
``<collector.spool_dir>/gpu_samples`` and ``/engine_samples`` and ships them to
``collector.ingest_url`` when it is set. A target that is down, slow or answers garbage is marked
down and retried with a doubling back-off; the others go on.

Its own ``/metrics`` (on ``collector.listen``; ``/healthz`` too) is built at scrape time:

================================================  ===========================================
metric                                            meaning
================================================  ===========================================
infermeter_gpu_utilization_ratio{node,gpu,        utilization of a GPU or MIG slice (0-1);
  uuid,replica,model}                             ``gpu`` is ``<index>/<GPU_I_ID>`` for a slice,
                                                  ``replica``/``model`` empty when idle capacity
infermeter_gpu_power_watts{...}                   power (a MIG slice: its share of the board)
infermeter_gpu_energy_joules_total{...}           energy since the collector started, no gaps
infermeter_gpu_memory_used_bytes{...}             framebuffer in use
infermeter_gpu_memory_free_bytes{...}             framebuffer free
infermeter_gpu_xid_errors{...}                    last XID error code (0: none)
infermeter_replica_gpu_utilization_ratio          mean utilization of the replica's GPUs
  {replica,model}
infermeter_replica_gpu_power_watts{...}           power of the replica's GPUs
infermeter_replica_gpu_energy_joules_total{...}   energy of the replica's GPUs since start
infermeter_replica_gpu_memory_used_bytes{...}     framebuffer in use on the replica's GPUs
infermeter_replica_gpus{...}                      GPUs or slices attributed to the replica
infermeter_replica_queue_depth{...}               vllm:num_requests_waiting
infermeter_replica_requests_running{...}          vllm:num_requests_running
infermeter_replica_kv_cache_usage_ratio{...}      vllm:kv_cache_usage_perc (0-1)
                                                  (queue and batch summed over the group's
                                                  instances, KV-cache use their mean)
infermeter_instance_queue_depth                   the same three, per engine instance
  {instance_id,replica,model}                     (``instance_id``: the pod; the replica id
infermeter_instance_requests_running{...}         for a fixed replica)
infermeter_instance_kv_cache_usage_ratio{...}
infermeter_instance_preemptions_total{...}        vllm:num_preemptions, per instance
infermeter_instance_prefix_cache_queries_total    vllm:prefix_cache_queries and _hits (prompt
  {...}, ..._prefix_cache_hits_total{...}         tokens looked up, and found), per instance
infermeter_collector_target_up{target,kind}       1 if the last scrape succeeded; ``kind`` is
                                                  ``dcgm``, ``nvml`` or ``vllm``
infermeter_collector_scrape_duration_seconds      duration of the target's last scrape
  {target,kind}
infermeter_collector_scrape_errors_total{...}     failed scrapes of the target
infermeter_collector_refused_values_total{...}    values sent that cannot be true (NaN, inf,
                                                  negative), not used
infermeter_collector_duplicate_gpus_total{...}    boards the target reported that another
                                                  target reports too, sampled there only
infermeter_collector_gaps_total                   GPU intervals recorded as gaps
infermeter_collector_round_errors_total           rounds that failed unexpectedly (a bug)
infermeter_collector_spool_errors_total           batches that could not be spooled
================================================  ===========================================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collectors.attribution import Owner, attribute, owner_of, replica_for_pod
    from collectors.discovery import PodWatcher, RegistryPoller
    from collectors.energy import Energy, Point, counter_increase, interval_energy
    from collectors.loop import Batch, FleetCollector, backoff_seconds
    from collectors.sources import EngineReading, EngineSource, GpuReading, GpuSource, ScrapeError
    from collectors.targets import EngineTarget

__all__ = [
    "Batch",
    "Energy",
    "EngineReading",
    "EngineSource",
    "EngineTarget",
    "FleetCollector",
    "GpuReading",
    "GpuSource",
    "Owner",
    "PodWatcher",
    "Point",
    "RegistryPoller",
    "ScrapeError",
    "attribute",
    "backoff_seconds",
    "counter_increase",
    "interval_energy",
    "owner_of",
    "replica_for_pod",
]

# Each name is imported from its module when first used (PEP 562): ``infermeter --help`` imports
# ``collectors.cli``, hence this package, and must not pay for the scrape loop and the
# configuration's validation on the way.
_HOMES = {
    "attribute": "collectors.attribution",
    "replica_for_pod": "collectors.attribution",
    "Owner": "collectors.attribution",
    "owner_of": "collectors.attribution",
    "PodWatcher": "collectors.discovery",
    "RegistryPoller": "collectors.discovery",
    "EngineTarget": "collectors.targets",
    "Energy": "collectors.energy",
    "Point": "collectors.energy",
    "counter_increase": "collectors.energy",
    "interval_energy": "collectors.energy",
    "Batch": "collectors.loop",
    "FleetCollector": "collectors.loop",
    "backoff_seconds": "collectors.loop",
    "EngineReading": "collectors.sources",
    "EngineSource": "collectors.sources",
    "GpuReading": "collectors.sources",
    "GpuSource": "collectors.sources",
    "ScrapeError": "collectors.sources",
}


def __getattr__(name: str) -> Any:
    """The exported ``name``, imported from its module on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module 'collectors' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
