"""The issue's fleet scenarios at their scale: three real sidecars on loopback sharing redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import redis

from tests.redis_server import RedisServer
from tests.sidecar.conftest import KEYS, Stack, StackFactory

ROOT = Path(__file__).parents[2]
CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
AUTH = {"authorization": f"Bearer {KEYS['search']}"}


def shared(redis_url: str, limits: dict[str, int], lease_seconds: float = 30.0) -> dict[str, Any]:
    """Config changes: team search limited by ``limits``, shared in ``redis_url``."""
    return {
        "sidecar.shared_limits": {
            "redis_url": redis_url,
            "timeout_millis": 2000,
            "retry_seconds": 0.2,
            "lease_seconds": lease_seconds,
        },
        "teams.0.limits": limits,
        "sidecar.drain_seconds": 0,
        "sidecar.drain_ship_seconds": 0,
    }


def fallbacks(stacks: list[Stack]) -> list[float | None]:
    """Admissions each sidecar decided without Redis (a slow answer counts as Redis down)."""
    return [
        s.sidecar.metrics.registry.get_sample_value(
            "infermeter_shared_limits_fallback_total", {"policy": "fail_open"}
        )
        for s in stacks
    ]


async def stall(scope: Any, receive: Any, send: Any) -> None:
    """An upstream that never answers: each request forwarded to it holds its slot."""
    await asyncio.sleep(3600)


async def test_three_sidecars_at_rpm_600_admit_the_bucket_and_its_refill_within_1_percent(
    stack_factory: StackFactory, redis_server: RedisServer
) -> None:
    """Over HTTP through three sidecars, one team at RPM 600 gets 600 plus 10 a second, within 1%.

    A token bucket admits exactly its capacity plus its refill over any window, so a window that
    drains the 600-request bucket through all three sidecars and then runs 3 s on the refill
    checks both terms of the per-minute bound; a full minute would only add more seconds of the
    same refill term, at a minute of the test machine's cores.
    """
    stacks = [
        await stack_factory(**shared(redis_server.url, {"requests_per_minute": 600}))
        for _ in range(3)
    ]
    counts = [0, 0, 0]
    refused: list[float] = []
    codes: list[str] = []
    # Each admitted request's send and answer times: its admission happened in between.
    admitted: list[tuple[float, float]] = []
    give_up = time.monotonic() + 60

    def running() -> bool:
        """Until 3 s of refill after the bucket first ran dry (however long draining it took)."""
        now = time.monotonic()
        return now < give_up and not (refused and now > refused[0] + 3.0)

    async def hammer(i: int) -> None:
        async with httpx.AsyncClient(base_url=stacks[i].url, headers=AUTH, timeout=30) as c:
            while running():
                sent = time.monotonic()
                r = await c.post("/v1/chat/completions", json=CHAT)
                assert r.status_code in (200, 429), r.text
                if r.status_code == 200:
                    counts[i] += 1
                    admitted.append((sent, time.monotonic()))
                else:
                    codes.append(r.json()["error"]["code"])
                    refused.append(time.monotonic())

    await asyncio.gather(*(hammer(i % 3) for i in range(12)))
    # The first and last admissions lie within these bounds; the bucket refills 10 a second.
    sent, answered = zip(*admitted, strict=True)
    least = 600 + 10 * (max(sent) - min(answered)) - 1
    most = 600 + 10 * (max(answered) - min(sent)) + 1
    assert refused, "the bucket never ran dry"
    assert all(n > 0 for n in counts), counts
    assert least * 0.99 <= sum(counts) <= most * 1.01, (
        least,
        most,
        counts,
        Counter(codes),
        fallbacks(stacks),
    )


_SIDECAR = """
import asyncio, sys
from pathlib import Path
from sidecar.app import Sidecar
from tests.servers import serving
from tests.sidecar.test_shared_limits_fleet import shared, stall
from tests.sidecar.conftest import make_config

async def main():
    async with serving(stall, lifespan="off") as upstream:
        changes = shared(sys.argv[1], {"max_concurrent": 8}, lease_seconds=1.0)
        sidecar = Sidecar(make_config(upstream, **changes), "small-0", spool_dir=Path(sys.argv[2]))
        async with serving(sidecar, limits=sidecar.server_limits) as url:
            print(url, flush=True)
            await asyncio.sleep(3600)

asyncio.run(main())
"""


async def held(url: str, n: int) -> list[asyncio.Task[Any]]:
    """``n`` requests sent to the sidecar at ``url``, left running (its upstream stalls)."""

    async def one() -> None:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=3600) as c:
            await c.post("/v1/chat/completions", json=CHAT)

    return [asyncio.get_running_loop().create_task(one()) for _ in range(n)]


async def status(url: str) -> int:
    """The status of one request to the sidecar at ``url``."""
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as c:
        return (await c.post("/v1/chat/completions", json=CHAT)).status_code


async def test_slots_of_a_sidecar_process_killed_with_sigkill_come_back_within_the_lease(
    stack_factory: StackFactory, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Concurrency 8 over three sidecars; kill -9 the process holding four: they return in a lease."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", _SIDECAR, redis_server.url, str(tmp_path / "p")],
        stdout=subprocess.PIPE,
        env=env,
    )
    tasks: list[asyncio.Task[Any]] = []
    try:
        assert process.stdout is not None
        url = (await asyncio.to_thread(process.stdout.readline)).decode().strip()
        changes = shared(redis_server.url, {"max_concurrent": 8}, lease_seconds=1.0)
        holding = await stack_factory(upstream_app=stall, **changes)
        serving_one = await stack_factory(**changes)
        tasks = await held(url, 4) + await held(holding.url, 4)
        store = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 10
        # The team's slots, leased in Redis (redis-py types its commands for sync and asyncio).
        while int(store.zcard("infermeter:{search}:c")) < 8:  # type: ignore[arg-type]
            assert time.monotonic() < deadline, "the eight slots were never all taken"
            await asyncio.sleep(0.05)
        assert not [t.exception() for t in tasks if t.done()]
        await asyncio.sleep(1.5)  # past one lease: the living process renewed its slots
        assert await status(serving_one.url) == 429
        process.send_signal(signal.SIGKILL)
        process.wait()
        killed = time.monotonic()
        while await status(serving_one.url) != 200:
            assert time.monotonic() - killed < 1.5, "slots of the dead sidecar never came back"
            await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks[4:])  # the other sidecar's four still run
    finally:
        process.kill()
        process.wait()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
