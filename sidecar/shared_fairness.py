"""Fair-share state shared by the sidecars of one replica group, through Redis.

Each sidecar's ``FairShare`` orders the teams waiting for a batch slot by priority, then by the
requests they have in flight. Alone, it sees only its own replica: a team that fills three pods
of the group and has one request here would go ahead of a team with two requests here and none
elsewhere. So every ``interval_seconds`` each sidecar publishes its per-team in-flight counts
(``<prefix>:{fair:<replica>}:<instance>``, expiring after three intervals) and reads the other
live instances' counts into ``FairShare.remote_in_flight``, which the ordering adds. This is off
the request path (one pipeline, then one more, per interval); when Redis fails the remote counts
are dropped and each replica orders by its own counts, as without Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sidecar.fairness import FairShare

__all__ = ["FairShareSync", "sum_remote"]

log = logging.getLogger("infermeter.sidecar")


def sum_remote(hashes: list[dict[bytes, bytes]]) -> dict[str, int]:
    """Per-team totals over the other instances' published counts."""
    out: dict[str, int] = {}
    for counts in hashes:
        for team, n in counts.items():
            out[team.decode()] = out.get(team.decode(), 0) + int(n)
    return out


class FairShareSync:
    """Publishes this instance's in-flight counts and reads the rest of its replica group's."""

    def __init__(
        self,
        redis: aioredis.Redis,
        fair: FairShare,
        key_prefix: str,
        replica: str,
        instance: str,
        interval_seconds: float = 1.0,
    ) -> None:
        self.redis, self.fair, self.instance = redis, fair, instance
        self.base = f"{key_prefix}:{{fair:{replica}}}"
        self.interval_seconds = interval_seconds
        self._failing = False

    async def sync(self) -> None:
        """One exchange: publish, expire the silent, read the others."""
        ttl_ms = int(self.interval_seconds * 3000)
        now = time.time()
        mine = f"{self.base}:{self.instance}"
        counts = {t: n for t, n in self.fair.in_flight.items() if n > 0}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(mine)
            if counts:
                pipe.hset(mine, mapping=counts)
                pipe.pexpire(mine, ttl_ms)
            pipe.zadd(f"{self.base}:members", {self.instance: now})
            pipe.zremrangebyscore(f"{self.base}:members", "-inf", now - ttl_ms / 1000)
            pipe.pexpire(f"{self.base}:members", ttl_ms)
            pipe.zrange(f"{self.base}:members", 0, -1)
            results: list[Any] = await pipe.execute()
        others = [m.decode() for m in results[-1] if m.decode() != self.instance]
        async with self.redis.pipeline(transaction=False) as pipe:
            for other in others:
                pipe.hgetall(f"{self.base}:{other}")
            hashes = cast("list[dict[bytes, bytes]]", await pipe.execute()) if others else []
        self.fair.remote_in_flight = sum_remote(hashes)

    async def run(self) -> None:
        """Sync every interval until cancelled; on failure order by local counts only."""
        while True:
            try:
                await self.sync()
                if self._failing:
                    log.warning("fair-share state shared again")
                self._failing = False
            except (RedisError, OSError) as exc:
                if not self._failing:
                    log.error(
                        "fair-share state not shared (%s); ordering by this replica only", exc
                    )
                self._failing = True
                self.fair.remote_in_flight = {}
            await asyncio.sleep(self.interval_seconds)
