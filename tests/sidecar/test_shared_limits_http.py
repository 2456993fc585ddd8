"""Three real sidecars in front of simulated replicas, sharing team limits through redis-server."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.sidecar.conftest import Stack, StackFactory

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def shared(redis_url: str, **changes: Any) -> dict[str, Any]:
    """Config changes for a sidecar sharing limits in ``redis_url``."""
    return {"sidecar.shared_limits": {"redis_url": redis_url, "timeout_millis": 2000,
                                      "retry_seconds": 0.2, **changes.pop("shared", {})}, **changes}  # fmt: skip


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
    used = a.records()[-1]["prompt_tokens"] + a.records()[-1]["completion_tokens"]
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
    stack = await stack_factory(**shared(redis_server.url, shared={"on_failure": "fail_closed"},
                                         **{"teams.0.limits": {"requests_per_minute": 600}}))  # fmt: skip
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
