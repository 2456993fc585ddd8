"""The interface through which the sidecar admits requests against team limits.

Two implementations stand behind it: ``LocalTeamLimiter``, the per-process token buckets of
``sidecar.limits`` (each sidecar counts for itself), and ``SharedTeamLimiter`` in
``sidecar.shared_limits``, which holds the limits for the whole fleet in Redis. ``team_limiter``
picks one from ``sidecar.shared_limits.redis_url``.

Admission is awaited (a shared limiter asks Redis); settling is not, because it happens after the
response and must never delay it: a shared limiter queues it and sends it in the background.
A request refused for any reason takes nothing from any bucket: the sidecar asks for admission
only once everything that can refuse before it has passed (key, body, model, budget), and an
admission whose request is refused afterwards (fair share, draining) is refunded, not settled.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry

from infermeter.config import Config, TeamLimits
from sidecar.limits import Admission, LimitsUnavailable, RateLimiter

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = [
    "LimitsUnavailable",
    "LocalTeamLimiter",
    "TeamLimiter",
    "team_limiter",
    "team_limits",
]


class TeamLimiter(Protocol):
    """Admission against each team's requests/min, tokens/min and concurrent requests."""

    # The shared store's client, for state the fleet shares beside limits; None when local.
    redis: aioredis.Redis | None

    async def admit(self, team: str, reserve_tokens: int) -> Admission:
        """Admit, or raise LimitExceeded (or LimitsUnavailable for a shared store that is down)."""
        ...

    def settle(self, admission: Admission, used_tokens: int) -> None:
        """Replace the reservation by the real usage and free the slot, exactly once."""
        ...

    def refund(self, admission: Admission) -> None:
        """Give back the request, the whole reservation and the slot of an admission whose
        request was refused before it was forwarded; exactly once, like ``settle``."""
        ...

    def configure(self, limits: dict[str, TeamLimits]) -> None:
        """Apply new limits (a reload)."""
        ...

    async def start(self) -> None:
        """Start background work (settlement, lease renewal)."""
        ...

    async def close(self) -> None:
        """Stop background work and flush what is queued."""
        ...


class LocalTeamLimiter:
    """The per-process limiter behind the shared interface: limits hold per sidecar."""

    def __init__(self, limits: dict[str, TeamLimits]) -> None:
        self.redis: aioredis.Redis | None = None
        self.limiter = RateLimiter(limits, time.monotonic())

    async def admit(self, team: str, reserve_tokens: int) -> Admission:
        """Admit from this process's buckets."""
        return self.limiter.admit(team, reserve_tokens, time.monotonic())

    def settle(self, admission: Admission, used_tokens: int) -> None:
        """Settle in this process's buckets."""
        self.limiter.settle(admission, used_tokens, time.monotonic())

    def refund(self, admission: Admission) -> None:
        """Give everything back to this process's buckets."""
        self.limiter.refund(admission, time.monotonic())

    def configure(self, limits: dict[str, TeamLimits]) -> None:
        """Apply new limits, keeping levels."""
        self.limiter.configure(limits, time.monotonic())

    async def start(self) -> None:
        """Nothing runs in the background."""

    async def close(self) -> None:
        """Nothing to flush."""


def team_limits(config: Config) -> dict[str, TeamLimits]:
    """Every team's limits by name."""
    return {t.name: t.limits for t in config.teams}


def team_limiter(config: Config, replica_id: str, registry: CollectorRegistry) -> TeamLimiter:
    """The shared limiter when Redis is configured, the per-process one otherwise.

    The shared one's module (and redis-py, 3.2 MB) is loaded only when it is configured.
    """
    settings = config.sidecar.shared_limits
    if settings.redis_url is None:
        return LocalTeamLimiter(team_limits(config))
    from sidecar.live_instances import instance_bound
    from sidecar.shared_limits import SharedTeamLimiter

    group = replica_id if settings.scope == "team_replica" else None
    return SharedTeamLimiter(
        settings, team_limits(config), replica_id, registry, max_live=instance_bound(config, group)
    )
