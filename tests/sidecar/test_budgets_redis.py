"""Budgets when the shared Redis misbehaves: real ``infermeter sidecar`` processes for small-0
and small-1 over HTTP, a real redis-server of this module's own (no persistence, as deployed),
the simulator as their replica and billing's ``GET /v1/spend`` over a spend the test sets.

A team's spend is billing's (the ledger of record), never Redis's, so nothing Redis loses lets a
team past its budget; and Redis holds no override (billing keeps them: ``test_budgets_billing``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.redis_server import RedisServer
from tests.servers import serving
from tests.sidecar.conftest import KEYS
from tests.sidecar.test_budgets import FakeSpend
from tests.sidecar.two_sidecars import TwoSidecars

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SEARCH = {"authorization": f"Bearer {KEYS['search']}"}


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's redis-server, killed and restarted empty by its tests."""
    server = RedisServer(tmp_path_factory.mktemp("redis-budgets"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def fresh(redis: RedisServer) -> RedisServer:
    """The module's redis-server, running and empty."""
    if redis.process is None:
        redis.start()
    redis.flush()
    return redis


@contextlib.asynccontextmanager
async def _fleet(
    tmp_path: Path, redis: RedisServer, spent: float
) -> AsyncIterator[tuple[FakeSpend, list[str], httpx.AsyncClient]]:
    """small-0's and small-1's sidecars, limits shared in ``redis``, search's budget $100 of which
    billing says ``spent``; yields billing's spend, the sidecars' URLs and a client, once both
    sidecars judge search by that spend (429 past the budget, else 200)."""
    spend = FakeSpend()
    spend.spent["search"] = spent
    async with serving(spend.app(), lifespan="off") as billing:
        sidecar = {
            "budgets": {"spend_url": billing, "refresh_seconds": 0.1},
            "shared_limits": {"redis_url": redis.url, "timeout_millis": 500, "retry_seconds": 0.2},
        }
        fleet = TwoSidecars(tmp_path, sidecar, {"budget_usd_per_month": 100.0})
        async with fleet.running() as urls, httpx.AsyncClient(timeout=30) as c:
            await _until(c, urls, [429, 429] if spent > 100 else [200, 200], 10)
            yield spend, urls, c


async def _statuses(c: httpx.AsyncClient, urls: list[str]) -> list[int]:
    """The status of one chat request of team search to each sidecar."""
    return [
        (await c.post(f"{u}/v1/chat/completions", json=CHAT, headers=SEARCH)).status_code
        for u in urls
    ]


async def _until(c: httpx.AsyncClient, urls: list[str], want: list[int], seconds: float) -> float:
    """Seconds until every sidecar answers ``want``; AssertionError with the last answers after
    ``seconds``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    got: list[int] = []
    while loop.time() - start < seconds:
        got = await _statuses(c, urls)
        if got == want:
            return loop.time() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"answers {got}, not {want}, after {seconds} s")


@pytest.mark.timeout(120)
async def test_a_redis_restarted_empty_lifts_no_budget(tmp_path, fresh):
    """search past its budget on both sidecars; Redis killed and started again empty, and its
    keys flushed later: the team is still refused on both, at every request (the spend is
    billing's, read every refresh, and never Redis's)."""
    async with _fleet(tmp_path, fresh, 100.5) as (_, urls, c):
        fresh.kill()
        during = [await _statuses(c, urls) for _ in range(3)]
        fresh.start()
        after = [await _statuses(c, urls) for _ in range(10)]
        fresh.flush()
        flushed = [await _statuses(c, urls) for _ in range(10)]
    assert during == [[429, 429]] * 3
    assert after == [[429, 429]] * 10
    assert flushed == [[429, 429]] * 10


@pytest.mark.timeout(120)
async def test_a_paused_redis_holds_back_no_spend(tmp_path, fresh):
    """Redis stopped (SIGSTOP: connections open, nothing answered) while search is under its
    budget: its spend passing the budget is still enforced on both sidecars within a few
    refreshes (the budgets read nothing from Redis)."""
    async with _fleet(tmp_path, fresh, 50.0) as (spend, urls, c):
        fresh.pause()
        try:
            spend.spent["search"] = 100.5
            refused_in = await _until(c, urls, [429, 429], 10)
        finally:
            fresh.resume()
    assert refused_in < 3.0
