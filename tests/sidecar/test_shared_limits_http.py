"""Three real sidecars in front of simulated replicas, sharing team limits through redis-server."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import redis

from tests.sidecar.conftest import Stack, StackFactory
from tests.sidecar.test_shared_limits_fleet import stall

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def shared(redis_url: str, **changes: Any) -> dict[str, Any]:
    """Config changes for a sidecar sharing limits in ``redis_url``."""
    return {
        "sidecar.shared_limits": {
            "redis_url": redis_url,
            "timeout_millis": 2000,
            "retry_seconds": 0.2,
            **changes.pop("shared", {}),
        },
        **changes,
    }


async def fleet(factory: StackFactory, n: int, **changes: Any) -> list[Stack]:
    """``n`` sidecars (each with its replica) started with the same changes."""
    return [await factory(**changes) for _ in range(n)]


async def test_the_fleet_admits_the_limit_not_the_limit_times_the_sidecars(
    stack_factory, redis_server
):
    """Requests spread over three sidecars stop at the team's requests per minute."""
    stacks = await fleet(
        stack_factory,
        3,
        **shared(redis_server.url, **{"teams.0.limits": {"requests_per_minute": 12}}),
    )
    statuses = []
    for i in range(18):
        async with stacks[i % 3].client() as c:
            statuses.append((await c.post("/v1/chat/completions", json=CHAT)).status_code)
    # 12 in the bucket, plus at most a couple refilled (one each 5 s) while these ran.
    assert 12 <= statuses.count(200) <= 13
    assert statuses.count(429) == 18 - statuses.count(200)


async def test_ratelimit_headers_show_the_fleet_wide_state(stack_factory, redis_server):
    """What one sidecar admitted shows in the remaining requests another sidecar reports."""
    changes = shared(redis_server.url, **{"teams.0.limits": {"requests_per_minute": 60}})
    a, b = await fleet(stack_factory, 2, **changes)
    started = time.monotonic()
    async with a.client() as c:
        for _ in range(5):
            await c.post("/v1/chat/completions", json=CHAT)
    async with b.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    refilled = time.monotonic() - started + 1  # one a second
    assert r.headers["x-ratelimit-limit-requests"] == "60"
    assert 54 <= int(r.headers["x-ratelimit-remaining-requests"]) <= 54 + refilled


async def test_streamed_requests_settle_tokens_by_their_real_usage(stack_factory, redis_server):
    """A streamed request takes only the tokens it really used from the fleet's bucket."""
    a, b = await fleet(
        stack_factory,
        2,
        **shared(redis_server.url, **{"teams.0.limits": {"tokens_per_minute": 60000}}),
    )
    body = {**CHAT, "stream": True, "max_tokens": 2000, "stream_options": {"include_usage": True}}
    async with a.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        text = b"".join([chunk async for chunk in r.aiter_bytes()])
    assert b"[DONE]" in text
    used = (await a.records())[-1]["prompt_tokens"] + (await a.records())[-1]["completion_tokens"]
    await asyncio.sleep(0.2)  # settlement is sent after the response
    started = time.monotonic()
    async with b.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    reserve = 60000 - int(r.headers["x-ratelimit-remaining-tokens"]) - used
    refill = 1000 * (time.monotonic() - started + 1.0)
    # What is gone is the first request's real usage plus the second's small reservation.
    assert -refill <= reserve <= 100


async def test_fail_closed_answers_503_with_retry_after_then_recovers(stack_factory, redis_server):
    """With Redis killed, fail_closed is a 503 limits_unavailable; limits return with Redis."""
    stack = await stack_factory(
        **shared(
            redis_server.url,
            shared={"on_failure": "fail_closed"},
            **{"teams.0.limits": {"requests_per_minute": 600}},
        )
    )
    async with stack.client() as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        redis_server.kill()
        down = await c.post("/v1/chat/completions", json=CHAT)
        redis_server.start()
        await asyncio.sleep(0.3)
        statuses = []
        for _ in range(5):
            statuses.append((await c.post("/v1/chat/completions", json=CHAT)).status_code)
            await asyncio.sleep(0.15)
    assert down.status_code == 503
    assert down.json()["error"]["code"] == "limits_unavailable"
    assert int(down.headers["retry-after"]) >= 1
    assert statuses.count(200) >= 4
    assert set(statuses) <= {200, 429}


async def test_fail_open_keeps_serving_while_redis_is_down(stack_factory, redis_server):
    """With Redis killed, fail_open serves on local limits: no 5xx reaches the client."""
    stack = await stack_factory(
        **shared(redis_server.url, **{"teams.0.limits": {"requests_per_minute": 600}})
    )
    async with stack.client() as c:
        redis_server.kill()
        statuses = [
            (await c.post("/v1/chat/completions", json=CHAT)).status_code for _ in range(10)
        ]
        metrics = await c.get("/metrics", headers={"authorization": "Bearer im-demo-metrics"})
    assert statuses == [200] * 10
    assert "infermeter_shared_limits_up 0.0" in metrics.text


# Slow to refill (a request every 10 s): the buckets stay in Redis (a bucket's key expires when
# it would be full again) for as long as these tests look at them.
LIMITS = {"requests_per_minute": 6, "tokens_per_minute": 60_000, "max_concurrent": 4}


def stored(store: redis.Redis) -> dict[bytes, Any]:
    """Every key of team search's limits, as ``DUMP`` serializes it (its value, byte for byte)."""
    keys: list[bytes] = store.keys("infermeter:{search}:*")  # type: ignore[assignment]
    return {key: store.dump(key) for key in sorted(keys)}


async def test_refused_requests_leave_every_key_in_redis_as_it_was(stack_factory, redis_server):
    """A 413, a 400, a 404 and a 401 through a real sidecar write nothing to the shared limits."""
    stack = await stack_factory(
        **shared(redis_server.url, **{"teams.0.limits": LIMITS, "sidecar.max_body_bytes": 65_536})
    )
    store = redis.Redis.from_url(redis_server.url)
    async with stack.client() as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        await asyncio.sleep(0.2)  # its settlement is sent after the response
        before = stored(store)
        statuses = [
            (await c.post("/v1/chat/completions", content=b"x" * 70_000)).status_code,
            (await c.post("/v1/chat/completions", content=b"{not json")).status_code,
            (await c.post("/v1/chat/completions", json={**CHAT, "model": "made-up"})).status_code,
        ]
    async with httpx.AsyncClient(base_url=stack.url, headers={"authorization": "Bearer nope"}) as c:
        statuses.append((await c.post("/v1/chat/completions", json=CHAT)).status_code)
    await asyncio.sleep(0.2)
    assert statuses == [413, 400, 404, 401]
    assert before  # the served request's buckets
    assert stored(store) == before


def levels_at(bucket: dict[bytes, bytes], at_ms: float) -> tuple[float, float]:
    """The requests and tokens levels of a stored bucket, refilled to ``at_ms`` (Redis time)."""
    out = []
    for level, when, cap in ((b"r", b"rt", 6), (b"t", b"tt", 60_000)):
        since = at_ms - float(bucket[when])
        out.append(min(cap, float(bucket[level]) + since * cap / 60_000))
    return out[0], out[1]


async def test_a_request_refused_after_admission_gives_its_admission_back(
    stack_factory, redis_server
):
    """A fair-share 503 after admission leaves the fleet's buckets and slots as they were."""
    stack = await stack_factory(
        upstream_app=stall,
        **shared(
            redis_server.url,
            **{
                "teams.0.limits": LIMITS,
                "replicas.1.max_num_seqs": 1,
                "sidecar.fair_headroom": 0,
                "sidecar.fair_wait_timeout_seconds": 0.3,
                "sidecar.drain_seconds": 0,
            },
        ),
    )
    store = redis.Redis.from_url(redis_server.url)
    async with stack.client() as c:
        holding = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
        deadline = time.monotonic() + 10
        while store.zcard("infermeter:{search}:c") != 1:
            assert time.monotonic() < deadline, "the first request was never admitted"
            await asyncio.sleep(0.02)
        before = store.hgetall("infermeter:{search}:b")
        refused = await c.post("/v1/chat/completions", json=CHAT)
        await asyncio.sleep(0.2)  # the refund is sent in the background
        after = store.hgetall("infermeter:{search}:b")
        slots = store.zcard("infermeter:{search}:c")
        holding.cancel()
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "replica_busy")
    assert slots == 1  # the first request's slot only
    at = float(after[b"rt"])  # type: ignore[index]
    now = levels_at(after, at)  # type: ignore[arg-type]
    then = levels_at(before, at)  # type: ignore[arg-type]
    # Equal but for the refill in the fraction of a millisecond the two writes' clocks differ by
    # (1 ms refills 0.0001 of a request and 1 token here); a missed refund is a whole request.
    assert now[0] == pytest.approx(then[0], abs=1e-4)
    assert now[1] == pytest.approx(then[1], abs=1)
