"""The collector's GPU readings over OTLP, in OpenTelemetry's hardware conventions.

Built at export time from the fleet view that ``/metrics`` reads (``collectors.metrics``), so
both say the same thing: one series per GPU (or MIG slice), named by the conventions where they
exist, with our own attributes where they do not.

| metric | instrument, unit | Prometheus twin |
|---|---|---|
| ``hw.gpu.utilization`` | gauge, ``1`` | ``infermeter_gpu_utilization_ratio`` |
| ``hw.power`` | gauge, ``W`` | ``infermeter_gpu_power_watts`` |
| ``hw.energy`` | counter, ``J`` (since the collector started, gaps excluded) | ``infermeter_gpu_energy_joules`` |
| ``hw.gpu.memory.usage`` | up-down counter, ``By`` | ``infermeter_gpu_memory_used_bytes`` |
| ``hw.gpu.memory.limit`` | up-down counter, ``By`` | used plus free |

Attributes: ``hw.id`` (the GPU's UUID), ``hw.type`` (``gpu``), ``hw.name`` (its index on the
node), ``hw.model``, and ``infermeter.node``, ``infermeter.replica``, ``infermeter.model`` (the
replica group and model it serves, when one does); ``hw.gpu.utilization`` also ``hw.gpu.task``
(``general``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from collectors.loop import FleetCollector
from infermeter.otlp_export import Attributes, gauge, monotonic_sum, up_down_sum

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import Metric

    from infermeter.records import GpuSample

__all__ = ["SCHEMA_URL", "GpuExport"]

# The semantic conventions release whose hardware metrics these are.
SCHEMA_URL = "https://opentelemetry.io/schemas/1.41.0"
MIB = 2**20


def gpu_attributes(s: GpuSample) -> dict[str, str | int | float | bool]:
    """The conventions' attributes of one GPU, and ours for what it serves."""
    attrs: dict[str, str | int | float | bool] = {
        "hw.id": s.uuid,
        "hw.type": "gpu",
        "hw.name": s.gpu,
        "hw.model": s.gpu_model,
        "infermeter.node": s.node,
    }
    if s.replica:
        attrs["infermeter.replica"] = s.replica
    if s.model:
        attrs["infermeter.model"] = s.model
    return attrs


class GpuExport:
    """The producer of the collector's points (``infermeter.otlp_export.Producer``)."""

    def __init__(self, collector: FleetCollector) -> None:
        self.collector = collector

    async def produce(self, start_ns: int, now_ns: int) -> Sequence[Metric]:
        """The latest reading of every GPU, read now from the collector's view."""
        c = self.collector
        samples = [(gpu_attributes(s), s) for group in c.gpus.values() for s in group]
        util: list[tuple[Attributes, float]] = [
            ({**a, "hw.gpu.task": "general"}, s.utilization) for a, s in samples
        ]
        energy = [(a, c.gpu_energy_joules.get((s.node, s.gpu), 0.0)) for a, s in samples]
        return [
            gauge(
                "hw.gpu.utilization",
                "1",
                "Fraction of time spent in a specific task.",
                util,
                now_ns,
            ),
            gauge(
                "hw.power",
                "W",
                "Instantaneous power consumed by the component.",
                [(a, s.power_watts) for a, s in samples],
                now_ns,
            ),
            monotonic_sum(
                "hw.energy", "J", "Energy consumed by the component.", energy, start_ns, now_ns
            ),
            up_down_sum(
                "hw.gpu.memory.usage",
                "By",
                "GPU memory used.",
                [(a, s.memory_used_mib * MIB) for a, s in samples],
                start_ns,
                now_ns,
            ),
            up_down_sum(
                "hw.gpu.memory.limit",
                "By",
                "Size of the GPU memory.",
                [(a, (s.memory_used_mib + s.memory_free_mib) * MIB) for a, s in samples],
                start_ns,
                now_ns,
            ),
        ]
