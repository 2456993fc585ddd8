"""The demo's front door: vLLM's router, one base URL routing each request by model to a sidecar."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import yaml
from openai import AsyncOpenAI

from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.local_fleet import LocalFleet, LocalInstance
from infermeter.serving import free_port
from launcher.front_door import FrontDoor, workers
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.ports import off_demo_ports
from tests.servers import serving

TEAM_KEY = "im-demo-search"
METRICS = {"authorization": "Bearer im-demo-metrics"}
GROUPS = ("large-0", "small-0")


def _config() -> Config:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["replicas"] = [r for r in data["replicas"] if r["id"] in GROUPS]
    return Config.model_validate(off_demo_ports(data))


def test_the_workers_are_the_sidecars_and_the_live_local_instances():
    """Fixed sidecars by their listen address; the hook's live instances by theirs; stopped and
    draining ones not."""
    config = _config()
    live = LocalInstance(
        "vllm-small-0-1",
        "small-0",
        "chat-small",
        "node-b",
        (2,),
        "local",
        "http://127.0.0.1:1",
        "http://127.0.0.1:2/",
        1.0,
    )
    gone = LocalInstance(
        "vllm-small-0-0",
        "small-0",
        "chat-small",
        "node-b",
        (3,),
        "local",
        "http://127.0.0.1:3",
        "http://127.0.0.1:4",
        1.0,
        stopped_at=2.0,
    )
    draining = dataclasses.replace(
        live, instance="vllm-small-0-2", sidecar_url="http://127.0.0.1:6", draining=True
    )
    assert workers(config, LocalFleet((live, gone, draining))) == {
        f"http://{config.replica('large-0').sidecar_listen}": "chat-large",
        f"http://{config.replica('small-0').sidecar_listen}": "chat-small",
        "http://127.0.0.1:2": "chat-small",
    }


@contextlib.asynccontextmanager
async def _fleet(config: Config, tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    """Each group's simulated engine and its sidecar, served; group -> sidecar URL."""
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for group in GROUPS:
            replica = config.replica(group)
            await stack.enter_async_context(
                serving(
                    ReplicaSim(replica_spec(config, group)),
                    int(replica.upstream_url.rsplit(":", 1)[1]),
                )
            )
            sidecar = Sidecar(config, group, spool_dir=tmp_path / group)
            port = int((replica.sidecar_listen or "").rsplit(":", 1)[1])
            urls[group] = await stack.enter_async_context(serving(sidecar, port))
        yield urls


async def _requests_of(sidecar: str, model: str) -> float:
    async with httpx.AsyncClient() as client:
        page = (await client.get(f"{sidecar}/metrics", headers=METRICS)).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("infermeter_requests_total{")
        and f'model="{model}"' in line
        and 'status="ok"' in line
    )


async def test_one_base_url_serves_every_model_through_its_own_sidecar(tmp_path: Path) -> None:
    """Streamed and whole requests for both models through the router reach each model's sidecar,
    which meters them under the caller's own key."""
    config = _config()
    async with _fleet(config, tmp_path) as sidecars:
        door = FrontDoor(config, f"127.0.0.1:{free_port()}", free_port())
        try:
            await asyncio.to_thread(door.start)
            await asyncio.to_thread(door.sync, workers(config, LocalFleet()))
            assert set(door.registered.values()) == {"chat-large", "chat-small"}
            client = AsyncOpenAI(base_url=f"{door.url}/v1", api_key=TEAM_KEY, max_retries=0)
            for model in ("chat-large", "chat-small"):
                whole = await client.chat.completions.create(
                    model=model, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                )
                assert whole.choices[0].message.content
                stream = await client.chat.completions.create(
                    model=model,
                    max_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                    messages=[{"role": "user", "content": "hi"}],
                )
                chunks = [c async for c in stream]
                assert chunks[-1].usage is not None
                assert chunks[-1].usage.completion_tokens == 8
            async with httpx.AsyncClient() as http:
                refused = await http.post(
                    f"{door.url}/v1/chat/completions",
                    json={"model": "chat-small", "messages": []},
                    headers={"authorization": "Bearer not-a-key"},
                )
            assert refused.status_code == 401, "the router passes the caller's key to the sidecar"
            await client.close()
        finally:
            await asyncio.to_thread(door.stop)
        assert await _requests_of(sidecars["large-0"], "chat-large") == 2
        assert await _requests_of(sidecars["small-0"], "chat-small") == 2
        assert await _requests_of(sidecars["large-0"], "chat-small") == 0
