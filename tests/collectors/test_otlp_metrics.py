"""The collector's GPU readings reach a real OTLP receiver, in the hardware conventions, equal
to what its /metrics says."""

from __future__ import annotations

import os

import pytest
from prometheus_client import CollectorRegistry

from collectors.loop import FleetCollector
from collectors.metrics import FleetMetrics
from collectors.serve import metrics_export
from infermeter.config import Config
from tests.collectors.fakes import FakeGpuSource, reading
from tests.otlp_receiver import OtlpHttpReceiver

MIB = 2**20


async def _scraped(config: Config) -> FleetCollector:
    """Two rounds over three GPUs of node-a (two serving large-0, one idle), 10 s apart."""
    t = [1000.0]

    def board(gpu: str, energy_mj: float, utilization: float) -> object:
        return reading(
            node="node-a",
            gpu=gpu,
            uuid=f"GPU-a{gpu}",
            utilization=utilization,
            power_watts=100.0 + 100 * int(gpu),
            energy_mj=energy_mj,
        )

    rounds = [
        [board("0", 1e6, 0.2), board("1", 2e6, 0.6), board("2", 3e6, 0.0)],
        [board("0", 2e6, 0.3), board("1", 5e6, 0.7), board("2", 3.5e6, 0.0)],
    ]
    collector = FleetCollector(
        config,
        [FakeGpuSource("node-a", rounds)],  # type: ignore[arg-type]
        [],
        clock=lambda: t[0],
        monotonic=lambda: t[0],
    )
    await collector.scrape_once()
    t[0] += 10
    await collector.scrape_once()
    return collector


async def test_gpu_utilization_power_and_energy_in_the_hardware_conventions(config, monkeypatch):
    """hw.gpu.utilization, hw.power, hw.energy and GPU memory per GPU, as /metrics has them."""
    collector = await _scraped(config)
    prometheus = CollectorRegistry()
    prometheus.register(FleetMetrics(collector))
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    with OtlpHttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        export = metrics_export(collector, CollectorRegistry(), os.environ)
        assert export is not None
        assert await export.export_once()
        points = receiver.latest()
    units = {p.name: (p.unit, p.kind, p.monotonic) for p in points}
    assert units == {
        "hw.gpu.utilization": ("1", "gauge", False),
        "hw.power": ("W", "gauge", False),
        "hw.energy": ("J", "sum", True),
        "hw.gpu.memory.usage": ("By", "sum", False),
        "hw.gpu.memory.limit": ("By", "sum", False),
    }
    get = prometheus.get_sample_value
    twins = {
        "hw.gpu.utilization": "infermeter_gpu_utilization_ratio",
        "hw.power": "infermeter_gpu_power_watts",
        "hw.energy": "infermeter_gpu_energy_joules_total",
        "hw.gpu.memory.usage": "infermeter_gpu_memory_used_bytes",
    }
    seen = set()
    for p in points:
        a = p.attributes
        assert (a["hw.type"], a["infermeter.node"], a["hw.model"]) == (
            "gpu",
            "node-a",
            "H100",  # the price book's name for the board
        )
        labels = {
            "node": "node-a",
            "gpu": a["hw.name"],
            "uuid": a["hw.id"],
            "replica": a.get("infermeter.replica", ""),
            "model": a.get("infermeter.model", ""),
        }
        if p.name in twins:
            assert p.value == pytest.approx(get(twins[p.name], labels)), (p.name, labels)
        seen.add((p.name, a["hw.id"]))
    assert len(seen) == 15  # five metrics for each of three GPUs
    energy = {p.attributes["hw.id"]: p.value for p in points if p.name == "hw.energy"}
    assert energy == {
        "GPU-a0": pytest.approx(1000.0),
        "GPU-a1": pytest.approx(3000.0),
        "GPU-a2": pytest.approx(500.0),
    }
    serving = {p.attributes.get("infermeter.replica") for p in points if p.name == "hw.power"}
    assert serving == {"large-0", None}
    assert [p.attributes["hw.gpu.task"] for p in points if p.name == "hw.gpu.utilization"] == [
        "general"
    ] * 3
    assert receiver.resources()[-1]["service.name"] == "infermeter-collector"


def test_without_the_variables_the_collector_exports_nothing(config):
    """No OTEL_* variable: no export is made (and no SDK is needed for one)."""
    collector = FleetCollector(config, [], [])
    assert metrics_export(collector, CollectorRegistry(), {}) is None
    assert metrics_export(collector, CollectorRegistry(), {"OTEL_METRICS_EXPORTER": "none"}) is None
