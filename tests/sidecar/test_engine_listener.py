"""The sidecar's second listener: vLLM's own /metrics for an endpoint picker, and nothing else."""

from __future__ import annotations

import httpx
import pytest

from sidecar.engine_listener import EngineMetricsOnly
from sidecar.pool import UpstreamClosed

PAGE = b'vllm:num_requests_waiting{model_name="m"} 2.0\n'


async def _page() -> tuple[int, bytes, bytes]:
    return 200, b"text/plain; version=0.0.4", PAGE


async def _down() -> tuple[int, bytes, bytes]:
    raise UpstreamClosed("refused")


def _client(app: EngineMetricsOnly) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pod")


async def test_get_metrics_is_the_engines_page_without_a_token():
    """A picker reads vLLM's gauges as vLLM serves them, with no credentials."""
    async with _client(EngineMetricsOnly(_page)) as client:
        r = await client.get("/metrics")
    assert (r.status_code, r.content) == (200, PAGE)
    assert r.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v1/chat/completions", 404),
        ("GET", "/v1/models", 404),
        ("GET", "/invocations", 404),
        ("GET", "/engine/metrics", 404),
        ("GET", "/metrics/../v1/models", 404),
        ("POST", "/metrics", 405),
    ],
)
async def test_nothing_of_the_engines_api_is_reachable(method, path, status):
    """Every other path is 404 and another method 405: the port opens the gauges only."""
    async with _client(EngineMetricsOnly(_page)) as client:
        r = await client.request(method, path, json={"model": "m"})
    assert r.status_code == status
    assert PAGE not in r.content


async def test_an_engine_that_does_not_answer_is_503():
    """The picker sees the pod as unreadable, not a page of nothing."""
    async with _client(EngineMetricsOnly(_down)) as client:
        r = await client.get("/metrics")
    assert r.status_code == 503
