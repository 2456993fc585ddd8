"""Fair-share counts shared by the sidecars of a replica group through a real redis-server."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from sidecar.fairness import FairShare
from sidecar.shared_fairness import FairShareSync, sum_remote


def test_sum_remote_adds_the_other_instances_counts():
    """Per-team totals over every published hash."""
    assert sum_remote([{b"a": b"2"}, {b"a": b"1", b"b": b"4"}]) == {"a": 3, "b": 4}


async def test_each_sidecar_sees_the_in_flight_counts_of_the_others(redis_server):
    """After one sync each, a replica's remote counts are the other replica's in-flight ones."""
    client = aioredis.Redis.from_url(redis_server.url)
    one, two = FairShare(4), FairShare(4)
    one.in_flight.update({"a": 3, "b": 0})
    two.in_flight.update({"b": 1})
    syncs = [
        FairShareSync(client, f, "infermeter", "small", name)
        for f, name in ((one, "i1"), (two, "i2"))
    ]
    for sync in syncs + syncs:
        await sync.sync()
    assert two.remote_in_flight == {"a": 3}
    assert one.remote_in_flight == {"b": 1}
    await client.aclose()


async def test_an_instance_that_stops_publishing_drops_out(redis_server):
    """A silent instance's counts expire after three intervals."""
    client = aioredis.Redis.from_url(redis_server.url)
    one, two = FairShare(4), FairShare(4)
    one.in_flight["a"] = 2
    await FairShareSync(client, one, "infermeter", "small", "i1", 0.05).sync()
    reader = FairShareSync(client, two, "infermeter", "small", "i2", 0.05)
    await reader.sync()
    assert two.remote_in_flight == {"a": 2}
    await asyncio.sleep(0.2)
    await reader.sync()
    assert two.remote_in_flight == {}
    await client.aclose()
