"""Fleet-wide team limits in a real redis-server: exactness, leases, failure policy, recovery."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from infermeter.config import SharedLimitsSettings, TeamLimits
from sidecar.limits import LimitExceeded
from sidecar.live_instances import count_live, instance_bound
from sidecar.shared_limits import LimitsUnavailable, SharedAdmission, SharedTeamLimiter
from sidecar.team_limits import team_limiter
from tests.redis_server import RedisServer
from tests.servers import serving

ROOT = Path(__file__).parents[2]


def make(redis: RedisServer, limits: TeamLimits, **settings: object) -> SharedTeamLimiter:
    """A shared limiter of team ``t`` on the test's redis-server, with its own registry."""
    # Generous timeout: the test machine is shared, and a slow answer here would mean fail_open.
    s = SharedLimitsSettings.model_validate(
        {"redis_url": redis.url, "timeout_millis": 2000, **settings}
    )
    return SharedTeamLimiter(s, {"t": limits}, "small-0", CollectorRegistry())


async def hammer(limiter: SharedTeamLimiter, seconds: float) -> int:
    """Admit as fast as Redis answers for ``seconds``; the number admitted (settled at once)."""
    admitted = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            admission = await limiter.admit("t", 1)
        except LimitExceeded:
            await asyncio.sleep(0.002)
            continue
        admitted += 1
        limiter.settle(admission, 1)
    return admitted


async def test_three_sidecars_share_one_requests_per_minute_limit(redis_server):
    """Three limiters hammering one team at RPM 600 admit the bucket plus its refill within 1%."""
    limiters = [make(redis_server, TeamLimits(requests_per_minute=600)) for _ in range(3)]
    for lim in limiters:
        await lim.start()
    started = time.monotonic()
    counts = await asyncio.gather(*(hammer(lim, 3.0) for lim in limiters))
    elapsed = time.monotonic() - started
    for lim in limiters:
        await lim.close()
    expected = 600 + 600 / 60 * elapsed
    assert all(n > 0 for n in counts)
    assert expected * 0.99 <= sum(counts) <= expected * 1.01 + 1, (counts, elapsed)


async def test_tokens_are_reserved_at_admission_and_settled_by_real_usage(redis_server):
    """A settled request leaves only its real usage taken from the fleet's tokens bucket."""
    a, b = (make(redis_server, TeamLimits(tokens_per_minute=6000)) for _ in range(2))
    for lim in (a, b):
        await lim.start()
    first = await a.admit("t", 1000)
    assert dict(first.headers)["x-ratelimit-remaining-tokens"] in {"5000", "5001"}
    a.settle(first, 120)
    await asyncio.sleep(0.1)
    second = await b.admit("t", 10)
    remaining = int(dict(second.headers)["x-ratelimit-remaining-tokens"])
    # 6000 - 120 - 10, plus at most two seconds of refill (100 tokens a second).
    assert 5870 <= remaining <= 5870 + 200
    for lim in (a, b):
        await lim.close()


async def test_a_request_larger_than_the_bucket_passes_only_when_it_is_full(redis_server):
    """Like the local limiter, a reservation above the capacity waits for a full bucket."""
    lim = make(redis_server, TeamLimits(tokens_per_minute=100))
    await lim.admit("t", 500)
    with pytest.raises(LimitExceeded) as refused:
        await lim.admit("t", 500)
    assert refused.value.reason == "tokens"
    assert refused.value.retry_after_seconds > 59
    await lim.close()


async def test_concurrency_holds_across_sidecars(redis_server):
    """Eight slots over three limiters: the ninth request anywhere is refused until one ends."""
    limiters = [make(redis_server, TeamLimits(max_concurrent=8)) for _ in range(3)]
    held = [await limiters[i % 3].admit("t", 1) for i in range(8)]
    for lim in limiters:
        with pytest.raises(LimitExceeded) as refused:
            await lim.admit("t", 1)
        assert refused.value.reason == "concurrency"
    await limiters[0].start()
    limiters[0].settle(held[0], 1)
    await asyncio.sleep(0.1)
    assert isinstance(await limiters[2].admit("t", 1), SharedAdmission)
    for lim in limiters:
        await lim.close()


_HOLDER = """
import asyncio, sys
from prometheus_client import CollectorRegistry
from infermeter.config import SharedLimitsSettings, TeamLimits
from sidecar.shared_limits import SharedTeamLimiter

async def main():
    s = SharedLimitsSettings(redis_url=sys.argv[1], lease_seconds=1.0, timeout_millis=2000)
    lim = SharedTeamLimiter(s, {"t": TeamLimits(max_concurrent=8)}, "small-0", CollectorRegistry())
    await lim.start()
    for _ in range(3):
        await lim.admit("t", 1)
    print("held", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_slots_of_a_sidecar_killed_with_sigkill_come_back_within_the_lease(redis_server):
    """A process holding three slots keeps them while alive and loses them one lease after -9."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, redis_server.url], stdout=subprocess.PIPE, env=env
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == b"held"
        lim = make(redis_server, TeamLimits(max_concurrent=8), lease_seconds=1.0)
        await lim.start()
        mine = [await lim.admit("t", 1) for _ in range(5)]
        await asyncio.sleep(1.5)  # past one lease: the living holder renewed its slots
        with pytest.raises(LimitExceeded):
            await lim.admit("t", 1)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        killed = time.monotonic()
        while True:
            try:
                await lim.admit("t", 1)
                break
            except LimitExceeded:
                assert time.monotonic() - killed < 1.5, "slots of the dead sidecar never came back"
                await asyncio.sleep(0.05)
        assert len(mine) == 5
        await lim.close()
    finally:
        holder.kill()
        holder.wait()


async def registry_app(instances: list[dict[str, str]]) -> Starlette:
    """Billing's instance registry answering ``GET /v1/instances?state=live``."""

    async def handle(request: Request) -> JSONResponse:
        assert request.query_params.get("state") == "live"
        return JSONResponse({"instances": instances})

    return Starlette(routes=[Route("/v1/instances", handle)])


async def test_fail_open_serves_the_limit_over_live_instances_then_shares_again(redis_server):
    """With Redis gone each sidecar takes limit / live instances; on return it owes those."""
    live = [{"instance": f"small-0-{i}", "replica": "small-0", "state": "live"} for i in range(3)]
    async with serving(await registry_app(live), lifespan="off") as registry:
        lim = make(
            redis_server,
            TeamLimits(requests_per_minute=600),
            registry_url=registry,
            retry_seconds=0.2,
        )
        await lim.start()
        await asyncio.sleep(0.2)
        assert lim.live.count == 3
        await lim.admit("t", 1)
        redis_server.kill()
        admitted = await hammer(lim, 0.5)
        assert 200 <= admitted <= 205  # 600 / 3, plus the refill while it ran
        reg = lim.registry
        assert reg.get_sample_value("infermeter_shared_limits_up") == 0
        fallbacks = reg.get_sample_value(
            "infermeter_shared_limits_fallback_total", {"policy": "fail_open"}
        )
        assert (fallbacks or 0) >= 200
        redis_server.start()
        restarted = time.monotonic()
        await asyncio.sleep(0.3)
        back = await hammer(lim, 1.0)
        refill = 600 / 60 * (time.monotonic() - restarted)
        # The restarted Redis lost its keys (a full bucket of 600), and the first admission took
        # what was admitted locally meanwhile: the minute's total stays at 600 plus the refill
        # since the bucket was made again (the hammer may overrun its second on a busy machine).
        assert 600 - admitted <= back <= 600 - admitted + refill + 1
        assert reg.get_sample_value("infermeter_shared_limits_up") == 1
        await lim.close()


@pytest.mark.parametrize(
    ("max_replicas", "replica", "bound"),
    [(None, None, 9), (None, "small-0", 3), (4, None, 15), (4, "large-0", 5)],
    ids=["fleet", "group", "fleet-max-4", "group-max-4"],
)
def test_the_live_count_is_bounded_by_the_configured_groups_and_their_scaling(
    config, max_replicas, replica, bound
):
    """A group runs its replica and up to max_replicas more (else min_replicas, 2); the fleet,
    every one of the demo's three groups."""
    scaling = config.scaling.model_copy(update={"max_replicas": max_replicas})
    assert instance_bound(config.model_copy(update={"scaling": scaling}), replica) == bound


async def test_a_forged_live_count_is_clamped_to_the_configurations_bound(redis_server, config):
    """250 forged live instances split a team's limit by the fleet's bound (9), not by 250."""
    forged = [{"instance": f"x-{i}", "replica": "small-0", "state": "live"} for i in range(250)]
    async with serving(await registry_app(forged), lifespan="off") as registry:
        settings = SharedLimitsSettings(
            redis_url=redis_server.url, timeout_millis=2000, retry_seconds=60, registry_url=registry
        )
        teams = [
            t.model_copy(update={"limits": TeamLimits(requests_per_minute=600)})
            for t in config.teams
        ]
        sidecar = config.sidecar.model_copy(update={"shared_limits": settings})
        lim = team_limiter(
            config.model_copy(update={"teams": teams, "sidecar": sidecar}),
            "small-0",
            CollectorRegistry(),
        )
        assert isinstance(lim, SharedTeamLimiter)
        await lim.start()
        deadline = time.monotonic() + 5
        while lim.live.count == 1:
            assert time.monotonic() < deadline, "the registry was never read"
            await asyncio.sleep(0.05)
        redis_server.kill()
        team = config.teams[0].name
        admitted = []
        for _ in range(30):
            with contextlib.suppress(LimitExceeded):
                admitted.append(await lim.admit(team, 1))
        await lim.close()
    assert lim.live.count == 9
    assert len(admitted) == 30  # 600 / 9 = 66 each; divided by 250 it would be 2


async def test_fail_closed_refuses_while_redis_is_down_and_recovers(redis_server):
    """fail_closed raises LimitsUnavailable (the sidecar's 503) until Redis answers again."""
    lim = make(
        redis_server,
        TeamLimits(requests_per_minute=600),
        on_failure="fail_closed",
        retry_seconds=0.2,
    )
    await lim.admit("t", 1)
    redis_server.kill()
    with pytest.raises(LimitsUnavailable) as down:
        await lim.admit("t", 1)
    assert down.value.retry_after_seconds == 0.2
    redis_server.start()
    await asyncio.sleep(0.25)
    # Nothing was admitted meanwhile, so nothing is owed: the bucket is there at once.
    assert isinstance(await lim.admit("t", 1), SharedAdmission)
    await lim.close()


@pytest.mark.parametrize(
    ("body", "replica", "expected"),
    [
        (
            {
                "instances": [
                    {"instance": "a", "replica": "r1", "state": "live"},
                    {"instance": "b", "replica": "r2", "state": "live"},
                ]
            },
            None,
            2,
        ),
        (
            {
                "instances": [
                    {"instance": "a", "replica": "r1", "state": "live"},
                    {"instance": "b", "replica": "r2", "state": "live"},
                ]
            },
            "r1",
            1,
        ),
        ({"instances": [{"instance": "a", "replica": "r1", "state": "gone"}]}, None, 0),
        ({"nothing": []}, None, None),
    ],
)
def test_count_live_reads_the_registry_answer(body, replica, expected):
    """Live instances are counted from the registry's answer, per replica group when asked."""
    assert count_live(body, replica) == expected


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
async def test_a_server_slower_than_the_timeout_applies_the_policy_then_shares_again(
    redis_server, policy
):
    """A paused Redis times admission out at timeout_millis and the policy decides, until it answers."""
    lim = make(
        redis_server,
        TeamLimits(requests_per_minute=6000),
        on_failure=policy,
        timeout_millis=200,
        retry_seconds=0.2,
    )
    assert isinstance(await lim.admit("t", 1), SharedAdmission)
    redis_server.pause()
    try:
        started = time.monotonic()
        if policy == "fail_closed":
            with pytest.raises(LimitsUnavailable):
                await lim.admit("t", 1)
        else:
            assert not isinstance(await lim.admit("t", 1), SharedAdmission)
        # The deadline (less the loop's clock granularity), plus a loaded machine.
        assert 0.2 - 0.005 <= time.monotonic() - started < 1.0
    finally:
        redis_server.resume()
    reg = lim.registry
    assert reg.get_sample_value("infermeter_shared_limits_up") == 0
    assert reg.get_sample_value("infermeter_shared_limits_errors_total", {"call": "admit"}) == 1
    assert reg.get_sample_value("infermeter_shared_limits_fallback_total", {"policy": policy}) == 1
    await asyncio.sleep(0.25)
    # The bucket of 6000 was never reset: what was admitted meanwhile (one) is all it lost.
    back = await lim.admit("t", 1)
    assert isinstance(back, SharedAdmission)
    assert int(dict(back.headers)["x-ratelimit-remaining-requests"]) >= 6000 - 4
    assert reg.get_sample_value("infermeter_shared_limits_up") == 1
    await lim.close()


async def test_admission_and_settlement_survive_script_flush(redis_server):
    """After SCRIPT FLUSH the limiter loads its scripts again: slots are still taken and freed."""
    lim = make(redis_server, TeamLimits(max_concurrent=1))
    await lim.start()
    first = await lim.admit("t", 1)
    assert await lim.resp.call("SCRIPT", "FLUSH") == b"OK"
    lim.settle(first, 1)  # EVALSHA of the settle script: NOSCRIPT, loaded, sent again
    deadline = time.monotonic() + 2
    while True:
        try:
            second = await lim.admit("t", 1)
            break
        except LimitExceeded:
            assert time.monotonic() < deadline, "the settlement never freed the slot"
            await asyncio.sleep(0.02)
    with pytest.raises(LimitExceeded):
        await lim.admit("t", 1)
    lim.settle(second, 1)
    assert lim.registry.get_sample_value("infermeter_shared_limits_up") == 1
    await lim.close()
