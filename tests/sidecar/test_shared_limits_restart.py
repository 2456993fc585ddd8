"""A Redis restarted empty in the middle of a team's minute: real ``infermeter sidecar``
processes for small-0 and small-1 over HTTP sharing a real redis-server of this module's own (no
persistence, as deployed), the simulator as their replica.

A restart loses the buckets, which Redis then reads as full. Each sidecar pays, with its first
admission after, what it admitted through Redis in the last minute, so the fleet does not get a
second bucket in that minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from simulator.replica import ReplicaSim, replica_spec
from tests.redis_server import RedisServer
from tests.servers import serving, sidecar_process
from tests.sidecar.conftest import KEYS

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SEARCH = {"authorization": f"Bearer {KEYS['search']}"}
RPM = 20


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's redis-server, killed and restarted empty by its tests."""
    server = RedisServer(tmp_path_factory.mktemp("redis-restart"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


class _Fleet:
    """small-0's and small-1's sidecars as processes, one simulated replica, search limited to
    ``RPM`` requests a minute fleet-wide."""

    def __init__(self, tmp_path: Path, redis: RedisServer) -> None:
        self.up_port = free_port()
        self.urls: list[str] = []
        data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
        for r in data["replicas"]:
            if r["id"] in ("small-0", "small-1"):
                port = free_port()
                r.update(
                    upstream_url=f"http://127.0.0.1:{self.up_port}",
                    sidecar_listen=f"127.0.0.1:{port}",
                )
                self.urls.append(f"http://127.0.0.1:{port}")
        data["teams"][0]["limits"] = {"requests_per_minute": RPM}
        data["sidecar"] = {
            "spool_dir": str(tmp_path / "spool"),
            "shared_limits": {"redis_url": redis.url, "timeout_millis": 2000, "retry_seconds": 0.2},
        }
        self.config = Config.model_validate(data)
        self.path = tmp_path / "infermeter.yaml"
        self.path.write_text(yaml.safe_dump(data))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[list[str]]:
        """Both sidecars up in front of the simulated replica; yields their URLs."""
        procs: list[subprocess.Popen[bytes]] = []
        async with serving(ReplicaSim(replica_spec(self.config, "small-0")), self.up_port):
            try:
                for replica, url in zip(("small-0", "small-1"), self.urls, strict=True):
                    procs.append(
                        await asyncio.to_thread(sidecar_process, str(self.path), url, replica)
                    )
                yield self.urls
            finally:
                for p in procs:
                    p.kill()
                    await asyncio.to_thread(p.wait)


async def _served(c: httpx.AsyncClient, urls: list[str], requests: int) -> int:
    """How many of ``requests`` chat requests of search, sent to the sidecars in turn, got 200."""
    served = 0
    for i in range(requests):
        r = await c.post(f"{urls[i % 2]}/v1/chat/completions", json=CHAT, headers=SEARCH)
        assert r.status_code in (200, 429), r.text
        served += r.status_code == 200
    return served


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss", ["restart", "flushall"])
async def test_a_redis_restarted_empty_gives_no_second_bucket_in_the_minute(tmp_path, redis, loss):
    """search spends its whole minute (20) through both sidecars; Redis is killed and started
    again empty (or its keys flushed), between two requests: in the same minute the fleet serves
    at most what the bucket refilled meanwhile, not a second bucket of 20."""
    redis.flush()
    fleet = _Fleet(tmp_path, redis)
    async with fleet.running() as urls, httpx.AsyncClient(timeout=30) as c:
        loop = asyncio.get_running_loop()
        start = loop.time()
        before = await _served(c, urls, 2 * RPM)
        if loss == "restart":
            redis.kill()
            redis.start()
        else:
            redis.flush()
        after = await _served(c, urls, 2 * RPM)
        elapsed = loop.time() - start
    assert before == RPM
    # The refill over the test's seconds, and one request of slack for rounding.
    assert after <= int(elapsed * RPM / 60) + 1, (after, elapsed)
