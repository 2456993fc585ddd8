"""The collector's /metrics is per-GPU, per-instance telemetry of the whole fleet: scrapers only.

Billing shows that telemetry to the admin only, so the collector serves it only to the metrics
and admin tokens, like every other service's /metrics; the Kubernetes ServiceMonitor passes the
metrics token. A real ``serve_collector`` on loopback, on the demo configuration.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml

from collectors.serve import serve_collector
from infermeter.config import Config
from infermeter.serving import free_port
from tests.collectors.conftest import targets_down

ROOT = Path(__file__).parents[2]


async def _serving(config: Config, tmp_path: Path) -> AsyncIterator[str]:
    listen = f"127.0.0.1:{free_port()}"
    task = asyncio.create_task(serve_collector(targets_down(config, tmp_path), listen))
    url = f"http://{listen}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                try:
                    if (await client.get(f"{url}/healthz")).status_code == 200:
                        break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
        yield url
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def collector(config: Config, tmp_path: Path) -> AsyncIterator[str]:
    """``infermeter collect`` on the demo configuration (metrics and admin tokens set)."""
    async for url in _serving(config, tmp_path):
        yield url


@pytest.mark.parametrize(
    ("key", "status"),
    [
        (None, 401),
        ("im-not-a-key", 401),
        ("im-demo-search", 401),
        ("im-demo-ingest", 401),
        ("im-demo-metrics", 200),
        ("im-demo-admin", 200),
    ],
)
async def test_only_the_metrics_and_admin_tokens_read_the_collectors_metrics(
    collector, key, status
):
    """No token, a team key or the ingest token: 401 in OpenAI's error JSON; scrapers: the page."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient() as client:
        r = await client.get(f"{collector}/metrics", headers=headers)
        health = await client.get(f"{collector}/healthz")
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert "infermeter_gpu" not in r.text
    else:
        assert "infermeter_collector_target_up" in r.text
    assert health.status_code == 200


async def test_without_scraper_tokens_configured_the_page_is_open(config, tmp_path):
    """A configuration with neither token (a lab) serves /metrics to anyone, as the sidecar does."""
    bare = config.model_copy(update={"admin_token_sha256": [], "metrics_token_sha256": []})
    async for url in _serving(bare, tmp_path):
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{url}/metrics")).status_code == 200


def test_the_service_monitor_passes_the_metrics_token():
    """Prometheus scrapes the collector with the metrics token, as it does the sidecars and billing."""
    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/servicemonitors.yaml").read_text()))
    (monitor,) = [d for d in docs if d["metadata"]["name"] == "infermeter-collector"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "infermeter-secrets", "key": "metrics-token"},
    }
