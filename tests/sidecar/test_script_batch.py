"""Script calls of one event-loop tick sent as one pipeline to a real redis-server."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from sidecar.script_batch import ScriptBatcher
from tests.redis_server import RedisServer

INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


async def test_calls_of_one_tick_each_get_their_own_result(redis_server: RedisServer) -> None:
    """Fifty concurrent calls each see their own increment, in one round trip."""
    client = aioredis.Redis.from_url(redis_server.url)
    batcher = ScriptBatcher(client, INCR)
    results = await asyncio.gather(*(batcher.call(["k"], [1]) for _ in range(50)))
    assert sorted(results) == list(range(1, 51))
    await client.aclose()


async def test_a_forgotten_script_is_loaded_again(redis_server: RedisServer) -> None:
    """After SCRIPT FLUSH, single and batched calls still run the script."""
    client = aioredis.Redis.from_url(redis_server.url)
    batcher = ScriptBatcher(client, INCR)
    await client.script_flush()
    assert await batcher.call(["k"], [5]) == 5
    await client.script_flush()
    assert sorted(await asyncio.gather(batcher.call(["k"], [1]), batcher.call(["k"], [1]))) == [
        6,
        7,
    ]
    await client.aclose()


async def test_a_script_error_reaches_only_its_caller(redis_server: RedisServer) -> None:
    """A call whose script fails raises; the others in its batch get their results."""
    client = aioredis.Redis.from_url(redis_server.url)
    batcher = ScriptBatcher(client, INCR)
    results: list[object] = await asyncio.gather(
        batcher.call(["k"], [1]), batcher.call(["k"], ["x"]), return_exceptions=True
    )
    good, bad = results
    assert good == 1
    assert isinstance(bad, aioredis.ResponseError)
    await client.aclose()
