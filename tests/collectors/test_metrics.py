"""The collector's /metrics: the joined fleet view, valid for promtool, read at scrape time."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
from prometheus_client import CollectorRegistry, generate_latest

from collectors.loop import FleetCollector
from collectors.metrics import FleetMetrics, create_app
from collectors.serve import serve_collector
from infermeter.config import Config
from infermeter.serving import free_port
from tests.collectors.conftest import targets_down
from tests.collectors.fakes import FakeEngine, FakeGpuSource, FakeInstance, reading


async def _collector(config: Config) -> FleetCollector:
    gpus = [
        reading(node="node-a", gpu="0", uuid="GPU-a0", utilization=0.2, power_watts=100.0),
        reading(
            node="node-a", gpu="1", uuid="GPU-a1", utilization=0.6, power_watts=300.0, xid_errors=79
        ),
        reading(node="node-a", gpu="2", uuid="GPU-a2", utilization=0.0, power_watts=60.0),
    ]
    collector = FleetCollector(config, [FakeGpuSource("node-a", [gpus])], [FakeEngine()])
    await collector.scrape_once()
    return collector


async def test_fleet_view_per_gpu_and_per_replica(config):
    """Per-GPU series carry replica and model; replica series aggregate its GPUs and engine."""
    registry = CollectorRegistry()
    registry.register(FleetMetrics(await _collector(config)))
    gpu1 = {
        "node": "node-a",
        "gpu": "1",
        "uuid": "GPU-a1",
        "replica": "large-0",
        "model": "chat-large",
    }
    idle = {"node": "node-a", "gpu": "2", "uuid": "GPU-a2", "replica": "", "model": ""}
    large = {"replica": "large-0", "model": "chat-large"}
    small = {"replica": "small-0", "model": "chat-small"}
    get = registry.get_sample_value
    assert get("infermeter_gpu_utilization_ratio", gpu1) == 0.6
    assert get("infermeter_gpu_xid_errors", gpu1) == 79
    assert get("infermeter_gpu_power_watts", idle) == 60.0
    assert get("infermeter_replica_gpu_utilization_ratio", large) == 0.4
    assert get("infermeter_replica_gpu_power_watts", large) == 400.0
    assert get("infermeter_replica_gpus", large) == 2
    assert get("infermeter_replica_queue_depth", small) == 5
    assert get("infermeter_replica_requests_running", small) == 12
    assert get("infermeter_replica_kv_cache_usage_ratio", small) == 0.4
    assert get("infermeter_collector_target_up", {"target": "node-a", "kind": "fake"}) == 1


async def test_instances_of_a_group_add_up_and_each_has_its_own_series(config):
    """Two pods of small-0: one replica series (queues summed), one instance series per pod."""
    collector = FleetCollector(
        config, [], [FakeInstance("vllm-small-0-a"), FakeInstance("vllm-small-0-b")]
    )
    await collector.scrape_once()
    registry = CollectorRegistry()
    registry.register(FleetMetrics(collector))
    get = registry.get_sample_value
    small = {"replica": "small-0", "model": "chat-small"}
    assert get("infermeter_replica_queue_depth", small) == 10
    assert get("infermeter_replica_requests_running", small) == 24
    assert get("infermeter_replica_kv_cache_usage_ratio", small) == 0.4
    for pod in ("vllm-small-0-a", "vllm-small-0-b"):
        assert get("infermeter_instance_queue_depth", {"instance_id": pod, **small}) == 5


def test_exposition_passes_promtool(config):
    """``promtool check metrics`` finds no problem in the collector's page."""
    registry = CollectorRegistry()
    registry.register(FleetMetrics(asyncio.run(_collector(config))))
    text = generate_latest(registry)
    assert b"infermeter_replica_gpu_energy_joules_total" in text
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


async def test_app_serves_metrics_and_healthz(config):
    """The ASGI app answers /metrics with the fleet view and /healthz with ok."""
    app = create_app(await _collector(config))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
        metrics = await client.get("/metrics")
        health = await client.get("/healthz")
    assert (
        'infermeter_replica_queue_depth{model="chat-small",replica="small-0"} 5.0' in metrics.text
    )
    assert (health.status_code, health.text) == (200, "ok\n")


SCRAPER = {"authorization": "Bearer im-demo-metrics"}


async def test_serve_collector_runs_with_every_target_down(config, tmp_path):
    """``infermeter collect`` with nothing to scrape still serves /metrics, all targets down."""
    cfg = targets_down(config, tmp_path)
    listen = f"127.0.0.1:{free_port()}"
    task = asyncio.create_task(serve_collector(cfg, listen))
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                await asyncio.sleep(0.05)
                try:
                    text = (await client.get(f"http://{listen}/metrics", headers=SCRAPER)).text
                except httpx.ConnectError:
                    continue
                if (
                    'infermeter_collector_scrape_errors_total{kind="vllm",target="small-1"} 1.0'
                    in text
                ):
                    break
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert 'infermeter_collector_target_up{kind="dcgm",target="node-a"} 0.0' in text
    assert (tmp_path / "gpu_samples").is_dir()


async def test_refused_values_are_counted_per_target(config):
    """A NaN utilization and a negative counter from one node: two refused values on its series."""
    gpus = [
        reading(gpu="0", uuid="GPU-a0", utilization=float("nan")),
        reading(gpu="1", uuid="GPU-a1", energy_mj=-1.0),
    ]
    collector = FleetCollector(config, [FakeGpuSource("node-a", [gpus])], [])
    batch = await collector.scrape_once()
    registry = CollectorRegistry()
    registry.register(FleetMetrics(collector))
    target = {"target": "node-a", "kind": "fake"}
    assert registry.get_sample_value("infermeter_collector_refused_values_total", target) == 2
    assert [(s.gpu, s.energy_joules) for s in batch.gpus] == [("1", 0.0)]
