"""Fair-share counts shared by the sidecars of a replica group through a real redis-server."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from sidecar.fairness import FairShare
from sidecar.shared_fairness import FairShareSync, sum_remote

TEAMS = frozenset({"a", "b"})


def teams() -> frozenset[str]:
    return TEAMS


def test_sum_remote_adds_the_other_instances_counts():
    """Per-team totals over every published hash."""
    assert sum_remote([{b"a": b"2"}, {b"a": b"1", b"b": b"4"}], TEAMS, 4) == ({"a": 3, "b": 4}, 0)


def test_sum_remote_leaves_out_what_no_instance_could_have_published():
    """Not a number, not whole, below 1, above the group's capacity, not a configured team, not
    UTF-8: each left out and counted, the rest still added."""
    hashes = [
        {b"a": b"2", b"b": b"lots", b"nobody": b"1"},
        {b"a": b"-1000", b"b": b"1.5", b"\xff": b"1"},
        {b"a": b"5", b"b": b"0", b"a ": b"1"},
        {b"b": b"4"},
    ]
    assert sum_remote(hashes, TEAMS, 4) == ({"a": 2, "b": 4}, 8)


async def test_each_sidecar_sees_the_in_flight_counts_of_the_others(redis_server):
    """After one sync each, a replica's remote counts are the other replica's in-flight ones."""
    client = aioredis.Redis.from_url(redis_server.url)
    one, two = FairShare(4), FairShare(4)
    one.in_flight.update({"a": 3, "b": 0})
    two.in_flight.update({"b": 1})
    syncs = [
        FairShareSync(client, f, "infermeter", "small", name, teams=teams)
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
    await FairShareSync(client, one, "infermeter", "small", "i1", 0.05, teams=teams).sync()
    reader = FairShareSync(client, two, "infermeter", "small", "i2", 0.05, teams=teams)
    await reader.sync()
    assert two.remote_in_flight == {"a": 2}
    await asyncio.sleep(0.2)
    await reader.sync()
    assert two.remote_in_flight == {}
    await client.aclose()


async def test_a_pod_writing_garbage_neither_stops_the_sharing_nor_jumps_the_queue(redis_server):
    """Another holder of the Redis password publishes, as a member of the group, a count that is
    no number, one of minus a million for its team and one past the replica's capacity: the
    honest instances' counts are still read, and nothing of the forged hash is."""
    client = aioredis.Redis.from_url(redis_server.url)
    honest, reader = FairShare(4), FairShare(4)
    honest.in_flight["a"] = 2
    await FairShareSync(client, honest, "infermeter", "small", "i1", teams=teams).sync()
    base = "infermeter:{fair:small}"
    await client.zadd(f"{base}:members", {"rogue": time.time()})
    await client.hset(f"{base}:rogue", mapping={"a": "x", "b": "-1000000", "c": "3"})
    await client.hset(f"{base}:rogue2", mapping={"a": "99"})
    await client.zadd(f"{base}:members", {"rogue2": time.time()})
    sync = FairShareSync(client, reader, "infermeter", "small", "i2", teams=teams)
    await sync.sync()
    assert reader.remote_in_flight == {"a": 2}
    await client.aclose()
