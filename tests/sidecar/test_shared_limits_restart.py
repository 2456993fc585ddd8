"""A Redis restarted empty in the middle of a team's minute: real ``infermeter sidecar``
processes for small-0 and small-1 over HTTP sharing a real redis-server of this module's own (no
persistence, as deployed), the simulator as their replica.

A restart loses the buckets, which Redis then reads as full. Each sidecar pays, with its first
admission after, what it admitted through Redis in the last minute, so the fleet does not get a
second bucket in that minute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.redis_server import RedisServer
from tests.sidecar.conftest import KEYS
from tests.sidecar.two_sidecars import TwoSidecars

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


def _fleet(tmp_path: Path, redis: RedisServer) -> TwoSidecars:
    """small-0's and small-1's sidecars, search limited to ``RPM`` requests a minute fleet-wide."""
    sidecar = {
        "shared_limits": {"redis_url": redis.url, "timeout_millis": 2000, "retry_seconds": 0.2}
    }
    return TwoSidecars(tmp_path, sidecar, {"limits": {"requests_per_minute": RPM}})


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
    fleet = _fleet(tmp_path, redis)
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
