"""vLLM's own /metrics reaches the cluster only through the sidecar, behind the metrics token."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from collectors.serve import build_collector
from collectors.sources import ScrapeError
from collectors.vllm import engine_reading
from infermeter.serving import free_port
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import serving
from tests.sidecar.conftest import KEYS, METRICS_TOKEN, make_config

ADMIN_TOKEN = "im-demo-admin"


@dataclass
class Pod:
    """A simulated vLLM replica and its sidecar, both on loopback, like one vLLM pod."""

    upstream: str
    sidecar: str


@contextlib.asynccontextmanager
async def _pod(tmp_path: Path) -> AsyncIterator[Pod]:
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    config = make_config(upstream)
    async with (
        serving(ReplicaSim(replica_spec(config, "small-0")), port),
        serving(Sidecar(config, "small-0", spool_dir=tmp_path / "spool")) as url,
    ):
        yield Pod(upstream, url)


@pytest.mark.parametrize(
    "authorization",
    [None, f"Bearer {KEYS['search']}", "Bearer im-demo-wrong", "Basic aW0tZGVtby1tZXRyaWNz"],
    ids=["none", "team key", "unknown key", "not bearer"],
)
async def test_engine_metrics_need_the_metrics_or_admin_token(tmp_path, authorization):
    """Without the metrics or admin token /engine/metrics is 401, and a team key is not enough."""
    headers = {"authorization": authorization} if authorization else {}
    async with _pod(tmp_path) as pod, httpx.AsyncClient() as client:
        r = await client.get(f"{pod.sidecar}/engine/metrics", headers=headers)
    assert r.status_code == 401
    assert b"vllm:" not in r.content
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("token", [METRICS_TOKEN, ADMIN_TOKEN])
async def test_engine_metrics_relay_the_upstream_metrics_page(tmp_path, token):
    """With the token, /engine/metrics is the replica's own /metrics page, families and type intact."""
    async with _pod(tmp_path) as pod, httpx.AsyncClient() as client:
        relayed = await client.get(
            f"{pod.sidecar}/engine/metrics", headers={"authorization": f"Bearer {token}"}
        )
        direct = await client.get(f"{pod.upstream}/metrics")
    assert relayed.status_code == 200
    assert relayed.headers["content-type"] == direct.headers["content-type"]
    assert _vllm_families(relayed.text)
    assert _vllm_families(relayed.text) == _vllm_families(direct.text)
    assert engine_reading(relayed.text).requests_running == 0.0


def _vllm_families(page: str) -> set[str]:
    return {line for line in page.splitlines() if line.startswith("# TYPE vllm:")}


async def test_engine_metrics_of_a_dead_upstream_are_a_502(tmp_path):
    """When vLLM does not answer, the relay says so in OpenAI's error JSON."""
    config = make_config(f"http://127.0.0.1:{free_port()}")
    sidecar = Sidecar(config, "small-0", spool_dir=tmp_path / "spool")
    async with serving(sidecar) as url, httpx.AsyncClient() as client:
        r = await client.get(
            f"{url}/engine/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}
        )
    assert r.status_code == 502
    assert r.json()["error"]["type"]


async def test_collector_scrapes_the_engine_through_the_sidecar_with_its_token(
    tmp_path, monkeypatch
):
    """With engine_metrics_url set, the collector reads vLLM's state from the sidecar's relay."""
    async with _pod(tmp_path) as pod:
        config = make_config(
            pod.upstream, **{"replicas.1.engine_metrics_url": f"{pod.sidecar}/engine/metrics"}
        )
        monkeypatch.setenv(config.collector.metrics_token_env, METRICS_TOKEN)
        async with httpx.AsyncClient() as client:
            (source,) = [
                s for s in build_collector(config, client).engine_sources if s.target == "small-0"
            ]
            reading = await source.read()
            monkeypatch.delenv(config.collector.metrics_token_env)
            (tokenless,) = [
                s for s in build_collector(config, client).engine_sources if s.target == "small-0"
            ]
            with pytest.raises(ScrapeError, match="HTTP 401"):
                await tokenless.read()
    assert reading.requests_waiting == 0.0


async def test_the_metrics_token_is_never_sent_to_a_plain_vllm(tmp_path, monkeypatch):
    """Without engine_metrics_url the collector reads <upstream_url>/metrics and sends no token."""
    seen: list[str | None] = []

    async def upstream(scope, receive, send):
        seen.append(dict(scope["headers"]).get(b"authorization"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"vllm:num_requests_running 0\n"})

    monkeypatch.setenv("INFERMETER_METRICS_TOKEN", METRICS_TOKEN)
    async with serving(upstream, lifespan="off") as url, httpx.AsyncClient() as client:
        config = make_config(url)
        (source,) = [
            s for s in build_collector(config, client).engine_sources if s.target == "small-0"
        ]
        await source.read()
    assert seen == [None]
