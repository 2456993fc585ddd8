"""Fleet-wide limits through Redis blips, pauses and timeouts: nothing distorts the buckets.

Each test runs real limiters against a real redis-server. One sidecar's outage is made real with
a loopback TCP proxy between it and Redis that stops passing bytes (a stalled network path: the
sidecar's calls time out) and, when it passes them again, delivers what it held, so Redis runs
commands the sidecar has long given up on, as it does after a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from infermeter.config import SharedLimitsSettings, TeamLimits
from infermeter.serving import free_port
from sidecar.limits import Admission, LimitExceeded
from sidecar.shared_limits import SharedAdmission, SharedTeamLimiter
from tests.redis_server import RedisServer


class StallingProxy:
    """A loopback TCP proxy to Redis that can hold every byte in either direction."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        """The redis:// URL through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        """Listen on the proxy's port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    def stall(self) -> None:
        """Hold what either side sends from now on."""
        self.flowing.clear()

    def resume(self) -> None:
        """Deliver what was held, and pass bytes again."""
        self.flowing.set()

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        for pump in pumps:
            pump.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy bytes one way; a chunk read while stalled is delivered when flowing again, even
        if its sender has hung up meanwhile (the other side then gets it, and the end)."""
        try:
            while chunk := await reader.read(65536):
                await self.flowing.wait()
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def stalling_proxy(redis_server: RedisServer) -> AsyncIterator[StallingProxy]:
    """A StallingProxy to the test's redis-server, closed at the end."""
    proxy = StallingProxy(redis_server.port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


def limiter(
    url: str, limits: dict[str, TeamLimits], timeout_millis: int = 2000
) -> SharedTeamLimiter:
    """A fail_open limiter on ``url`` retrying every 0.2 s, with its own registry."""
    s = SharedLimitsSettings(
        redis_url=url, timeout_millis=timeout_millis, retry_seconds=0.2, lease_seconds=30.0
    )
    return SharedTeamLimiter(s, limits, "small-0", CollectorRegistry())


def fallbacks(lim: SharedTeamLimiter) -> float:
    """Admissions the limiter decided without Redis."""
    value = lim.registry.get_sample_value(
        "infermeter_shared_limits_fallback_total", {"policy": "fail_open"}
    )
    return value or 0.0


def in_flight(store: redis.Redis, team: str) -> int:
    """Members of the team's in-flight set in Redis (held slots)."""
    return int(store.zcard(f"infermeter:{{{team}}}:c"))  # type: ignore[arg-type]


def bucket(store: redis.Redis, team: str) -> dict[bytes, bytes]:
    """The team's buckets hash in Redis, as stored."""
    return store.hgetall(f"infermeter:{{{team}}}:b")  # type: ignore[return-value]


async def steady(lim: SharedTeamLimiter, team: str, until: float, refused: list[str]) -> int:
    """Admit one request every 0.1 s (reserving 2000 tokens, using 10) until ``until``."""
    served = 0
    while time.monotonic() < until:
        try:
            admission = await lim.admit(team, 2000)
        except LimitExceeded as exc:
            refused.append(f"{team}: {exc.reason}")
        else:
            served += 1
            await asyncio.sleep(0.02)
            lim.settle(admission, 10)
        await asyncio.sleep(0.08)
    return served


async def test_one_sidecars_blip_costs_no_team_a_single_429(redis_server: RedisServer) -> None:
    """Three sidecars serve two teams; one loses Redis for 0.4 s and returns: no 429 anywhere."""
    limits = {
        team: TeamLimits(requests_per_minute=6000, tokens_per_minute=60_000, max_concurrent=8)
        for team in ("t", "u")
    }
    async with stalling_proxy(redis_server) as proxy:
        blipping = limiter(proxy.url, limits, timeout_millis=100)
        others = [limiter(redis_server.url, limits) for _ in range(2)]
        fleet = [blipping, *others]
        for lim in fleet:
            await lim.start()
        refused: list[str] = []
        until = time.monotonic() + 2.5
        work = [
            asyncio.create_task(steady(lim, team, until, refused))
            for lim in fleet
            for team in ("t", "u")
        ]
        await asyncio.sleep(0.8)
        proxy.stall()
        await asyncio.sleep(0.4)
        proxy.resume()
        served = await asyncio.gather(*work)
        await asyncio.sleep(0.5)  # the settlements and withdrawals go out
        store = redis.Redis.from_url(redis_server.url)
        held = {team: in_flight(store, team) for team in ("t", "u")}
        for lim in fleet:
            await lim.close()
    assert fallbacks(blipping) > 0, "the blip never reached the sidecar"
    assert [fallbacks(lim) for lim in others] == [0, 0]
    assert refused == []
    assert all(n >= 15 for n in served), served
    assert held == {"t": 0, "u": 0}


async def test_a_sidecar_back_from_its_outage_owes_what_it_served_locally(
    redis_server: RedisServer,
) -> None:
    """Five requests served on local limits are taken from the shared bucket on return, once."""
    limits = {"t": TeamLimits(requests_per_minute=60, tokens_per_minute=6000)}
    async with stalling_proxy(redis_server) as proxy:
        cut_off = limiter(proxy.url, limits, timeout_millis=100)
        other = limiter(redis_server.url, limits)
        for lim in (cut_off, other):
            await lim.start()
        started = time.monotonic()
        for _ in range(10):
            other.settle(await other.admit("t", 100), 40)
        proxy.stall()
        local = [await cut_off.admit("t", 100) for _ in range(5)]
        assert not any(isinstance(a, SharedAdmission) for a in local)
        for admission in local:
            cut_off.settle(admission, 40)
        proxy.resume()
        await asyncio.sleep(0.5)  # past retry_seconds; the withdrawal of the timed-out call
        back = await cut_off.admit("t", 100)
        after = await other.admit("t", 100)
        refill = time.monotonic() - started  # one request a second, 100 tokens a second
        for lim in (cut_off, other):
            await lim.close()
    assert isinstance(back, SharedAdmission)
    requests = int(dict(after.headers)["x-ratelimit-remaining-requests"])
    tokens = int(dict(after.headers)["x-ratelimit-remaining-tokens"])
    # 60 less 10 and 5 served, and the two admissions just now; the timed-out call took nothing.
    assert 60 - 17 <= requests <= 60 - 17 + refill + 1
    # 6000 less the 15 requests' 40 tokens used, and the two reservations of 100 still held.
    assert 6000 - 15 * 40 - 200 <= tokens <= 6000 - 15 * 40 - 200 + 100 * refill + 1


async def test_a_debt_never_takes_the_shared_bucket_below_empty(redis_server: RedisServer) -> None:
    """Thirty requests owed to a bucket holding five leave it empty, not thirty in debt."""
    limits = {"t": TeamLimits(requests_per_minute=60)}
    async with stalling_proxy(redis_server) as proxy:
        cut_off = limiter(proxy.url, limits, timeout_millis=100)
        other = limiter(redis_server.url, limits)
        for _ in range(55):
            await other.admit("t", 1)
        proxy.stall()
        for _ in range(30):
            await cut_off.admit("t", 1)
        proxy.resume()
        await asyncio.sleep(0.3)
        with pytest.raises(LimitExceeded) as refused:
            await cut_off.admit("t", 1)  # the debt is taken, then this one finds it empty
        level = float(bucket(redis.Redis.from_url(redis_server.url), "t")[b"r"])
        for lim in (cut_off, other):
            await lim.close()
    assert refused.value.reason == "requests"
    assert 0 <= level < 1
    assert refused.value.retry_after_seconds <= 1.0


@pytest.mark.parametrize("pause", ["client_pause", "sigstop"])
async def test_no_slot_is_left_after_redis_pauses_while_admissions_run(
    redis_server: RedisServer, pause: str
) -> None:
    """Two 300 ms pauses of Redis under load: afterwards no slot is held, and max_concurrent
    requests are admitted at once.

    ``client_pause`` is ``CLIENT PAUSE 300 WRITE``; ``sigstop`` stops the server for 300 ms, as
    ``DEBUG SLEEP 0.3`` does (Debian's redis-server refuses DEBUG). Either way the admissions
    time out at 100 ms, and Redis runs them when it resumes.
    """
    limits = {"t": TeamLimits(max_concurrent=5, tokens_per_minute=60_000)}
    lim = limiter(redis_server.url, limits, timeout_millis=100)
    await lim.start()
    store = redis.Redis.from_url(redis_server.url)
    stop = time.monotonic() + 2.0

    async def worker() -> None:
        while time.monotonic() < stop:
            try:
                admission = await lim.admit("t", 100)
            except LimitExceeded:
                await asyncio.sleep(0.01)
                continue
            await asyncio.sleep(0.02)
            lim.settle(admission, 10)

    work = [asyncio.create_task(worker()) for _ in range(5)]
    for _ in range(2):
        await asyncio.sleep(0.3)
        if pause == "client_pause":
            store.client_pause(300, all=False)  # CLIENT PAUSE 300 WRITE
        else:
            redis_server.pause()
            await asyncio.sleep(0.3)
            redis_server.resume()
        await asyncio.sleep(0.3)
    await asyncio.gather(*work)
    await asyncio.sleep(0.5)  # past retry_seconds: the withdrawals and settlements go out
    held = in_flight(store, "t")
    burst = await asyncio.gather(*(lim.admit("t", 100) for _ in range(5)), return_exceptions=True)
    await lim.close()
    assert fallbacks(lim) > 0, "the pauses never timed an admission out"
    assert held == 0
    assert all(isinstance(a, SharedAdmission) for a in burst), burst
    remaining = [
        int(dict(a.headers)["x-ratelimit-remaining-tokens"])
        for a in burst
        if isinstance(a, Admission)
    ]
    # Nothing reset the tokens bucket: what was used (10 a request) and the burst are all it lost.
    assert min(remaining) > 30_000
