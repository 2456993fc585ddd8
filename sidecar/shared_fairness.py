"""Fair-share state shared by the sidecars of one replica group, through Redis.

Each sidecar's ``FairShare`` orders the teams waiting for a batch slot by priority, then by the
requests they have in flight. Alone, it sees only its own replica: a team that fills three pods
of the group and has one request here would go ahead of a team with two requests here and none
elsewhere. So every ``interval_seconds`` each sidecar publishes its per-team in-flight counts
(``<prefix>:{fair:<replica>}:<instance>``, expiring after three intervals) and reads the other
live instances' counts into ``FairShare.remote_in_flight``, which the ordering adds. This is off
the request path (one pipeline, then one more, per interval); when Redis fails the remote counts
are dropped and each replica orders by its own counts, as without Redis.

What another pod wrote is not trusted: any holder of the Redis password can write these keys.
A count is taken only when it is a whole number an instance of this group can have in flight
(1 to its ``max_num_seqs``, the same for every instance of the group) for a team of the
configuration; anything else is left out, with one warning until the counts are clean again,
and at most ``_MAX_INSTANCES`` other instances are read. So a malformed or impossible value
neither stops the sharing nor moves a team to the front or the back of the queue by more than
real instances could.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sidecar.fairness import FairShare

__all__ = ["FairShareSync", "sum_remote"]

log = logging.getLogger("infermeter.sidecar")

# Other instances of one replica group read per interval, at most (a group is a few to a few
# hundred pods; members past this are a flood, not a fleet).
_MAX_INSTANCES = 1024


def sum_remote(
    hashes: list[dict[bytes, bytes]], teams: Collection[str], capacity: int
) -> tuple[dict[str, int], int]:
    """Per-team totals over the other instances' published counts, and how many counts were
    left out: not a whole number from 1 to ``capacity``, or not of one of ``teams``."""
    out: dict[str, int] = {}
    dropped = 0
    for counts in hashes:
        for raw_team, raw_n in counts.items():
            try:
                team, n = raw_team.decode(), int(raw_n)
            except (UnicodeDecodeError, ValueError):
                dropped += 1
                continue
            if team not in teams or not 0 < n <= capacity:
                dropped += 1
                continue
            out[team] = out.get(team, 0) + n
    return out, dropped


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
        *,
        teams: Callable[[], Collection[str]],
    ) -> None:
        """``teams``: the configuration's team names now (reloads change them)."""
        self.redis, self.fair, self.instance = redis, fair, instance
        self.teams = teams
        self._dropping = False
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
        others = [m for m in results[-1] if m != self.instance.encode()][:_MAX_INSTANCES]
        async with self.redis.pipeline(transaction=False) as pipe:
            for other in others:
                pipe.hgetall(f"{self.base}:".encode() + other)
            hashes = cast("list[dict[bytes, bytes]]", await pipe.execute()) if others else []
        totals, dropped = sum_remote(hashes, self.teams(), self.fair.capacity)
        if dropped and not self._dropping:
            log.warning(
                "fair-share counts of other instances left out: %d not a count from 1 to %d "
                "of a configured team",
                dropped,
                self.fair.capacity,
            )
        self._dropping = bool(dropped)
        self.fair.remote_in_flight = totals

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
