"""Team limits that hold across every sidecar of the fleet, kept in Redis.

Admission is one round trip: one ``EVALSHA`` of ``shared_scripts.ADMIT`` checks and takes the
concurrency slot, the request and the token reservation atomically on the server. It goes
through ``sidecar.resp``, a small pipelined client on one connection, because redis-py's asyncio
client costs more than the round trip itself; redis-py stays for what is off the hot path
(``TeamLimiter.redis``: budget overrides, fair-share state). Settlement (giving back the unused
reservation, freeing the slot) is queued and sent in the background on the same connection,
together with the other settlements of the next 5 ms, so it never delays a response: two Redis
commands per request in all, plus one lease renewal per team per third of a lease.

When Redis fails or answers slower than ``timeout_millis``, ``on_failure`` decides:

- ``fail_open``: each sidecar admits against local buckets holding the limit divided by the
  number of live instances (billing's instance registry), so the fleet stays near the limit;
- ``fail_closed``: ``LimitsUnavailable``, which the sidecar answers with 503 and Retry-After.

Either way the transition is logged once, ``infermeter_shared_limits_up`` drops to 0 and
``infermeter_shared_limits_fallback`` counts the requests decided without Redis. Redis is tried
again every ``retry_seconds``; the first admission of each scope after an outage drains the
shared buckets, which then refill at the limit, so recovery brings no burst above it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from infermeter.config import SharedLimitsSettings, TeamLimits
from sidecar.limits import (
    Admission,
    LimitExceeded,
    LimitsUnavailable,
    RateLimiter,
    bucket_headers,
)
from sidecar.live_instances import LiveInstances
from sidecar.resp import NoScriptError, ReplyError, RespClient, Script, parse_url
from sidecar.shared_scripts import ADMIT, RENEW, SETTLE

__all__ = [
    "LimitsUnavailable",
    "SharedAdmission",
    "SharedLimitsMetrics",
    "SharedTeamLimiter",
    "fallback_limits",
]

log = logging.getLogger("infermeter.sidecar")

_REASONS = {1: "concurrency", 2: "requests", 3: "tokens"}
_STORE_ERRORS = (RedisError, ReplyError, OSError, TimeoutError)
_ADMIT, _SETTLE, _RENEW = Script(ADMIT), Script(SETTLE), Script(RENEW)
# Settlements wait this long for others to share their write: at hundreds of requests a second
# that is several per system call instead of one, which measured a little less CPU and admission
# latency (a slot is freed 5 ms later, against a lease of seconds).
_SETTLE_GATHER_SECONDS = 0.005


@dataclass(eq=False)
class SharedAdmission(Admission):
    """An admission granted by Redis: where to settle it."""

    scope: str = ""
    member: str = ""


def fallback_limits(limits: dict[str, TeamLimits], live: int) -> dict[str, TeamLimits]:
    """Each team's share of its fleet-wide limits for one of ``live`` sidecars (at least 1)."""

    def part(value: int | None) -> int | None:
        return None if value is None else max(1, value // max(1, live))

    return {
        team: TeamLimits(
            requests_per_minute=part(lim.requests_per_minute),
            tokens_per_minute=part(lim.tokens_per_minute),
            max_concurrent=part(lim.max_concurrent),
        )
        for team, lim in limits.items()
    }


def shared_headers(lim: TeamLimits, requests: float, tokens: float) -> tuple[tuple[str, str], ...]:
    """``x-ratelimit-*`` headers from the fleet-wide bucket levels."""
    out: list[tuple[str, str]] = []
    for name, cap, level in (("requests", lim.requests_per_minute, requests),
                             ("tokens", lim.tokens_per_minute, tokens)):  # fmt: skip
        if cap is not None:
            out += bucket_headers(name, cap, level, max(0.0, (cap - level) * 60.0 / cap))
    return tuple(out)


class SharedLimitsMetrics:
    """The metrics of the shared limiter: store health, fallbacks and what teams have left."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge("infermeter_shared_limits_up",
                        "1 while team limits are decided in the shared store, 0 while it is down.", registry=registry)  # fmt: skip
        self.fallback = Counter("infermeter_shared_limits_fallback",
                                "Admissions decided without the shared store, by the policy applied.", ("policy",), registry=registry)  # fmt: skip
        self.errors = Counter("infermeter_shared_limits_errors",
                              "Calls to the shared limit store that failed or timed out.", ("call",), registry=registry)  # fmt: skip
        self.remaining = Gauge("infermeter_team_limit_remaining",
                               "What a team has left of a fleet-wide limit, as last seen by this sidecar.", ("team", "limit"), registry=registry)  # fmt: skip
        self.up.set(1)


class SharedTeamLimiter:
    """The fleet-wide limiter: Redis when it answers, ``on_failure`` when it does not."""

    def __init__(self, settings: SharedLimitsSettings, limits: dict[str, TeamLimits],
                 replica_id: str, registry: CollectorRegistry,
                 client: aioredis.Redis | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.replica_id = replica_id
        timeout = settings.timeout_millis / 1000
        assert settings.redis_url is not None
        password = os.environ.get(settings.password_env) or None
        # Connection attempts back off up to retry_seconds, so Redis is still tried that often.
        self.resp = RespClient(parse_url(settings.redis_url, password), timeout,
                               max_backoff_seconds=settings.retry_seconds)  # fmt: skip
        # redis-py for the state shared off the hot path; it connects on its first command.
        self.redis = client or aioredis.Redis.from_url(
            settings.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout,
            retry_on_timeout=False, health_check_interval=0, password=password)  # fmt: skip
        self.registry = registry
        self.metrics = SharedLimitsMetrics(registry)
        self._gauges: dict[tuple[str, str], Gauge] = {}
        group = replica_id if settings.scope == "team_replica" else None
        self.live = LiveInstances(settings.registry_url, os.environ.get(settings.registry_token_env),
                                  group, settings.instances_refresh_seconds)  # fmt: skip
        self._live_applied = 1
        self.limits = limits
        self.fallback = RateLimiter(fallback_limits(limits, 1), time.monotonic())
        self._id = uuid.uuid4().hex[:12]
        self._seq = itertools.count()
        self._held: dict[str, set[str]] = {}
        self._pending: list[tuple[str, str, list[int | str]]] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._drained: set[str] = set()
        self._draining = False
        self._closing = False

    # -- the interface ---------------------------------------------------------------------------

    def _scope(self, team: str) -> str:
        if self.settings.scope == "team_replica":
            return f"{team}/{self.replica_id}"
        return team

    def _keys(self, scope: str) -> tuple[str, str]:
        base = f"{self.settings.key_prefix}:{{{scope}}}"
        return f"{base}:b", f"{base}:c"

    async def admit(self, team: str, reserve_tokens: int) -> Admission:
        """One atomic round trip to Redis; the failure policy when it does not answer in time."""
        lim = self.limits[team]
        if (lim.requests_per_minute, lim.tokens_per_minute, lim.max_concurrent) == (
            None,
            None,
            None,
        ):
            return Admission(team, reserve_tokens)
        admission = await self._decide(team, lim, reserve_tokens)
        if admission is None:
            return self._fallback_admit(team, reserve_tokens)
        return admission

    async def take_request(self, team: str) -> None:
        """Charge a refused request to the fleet-wide requests bucket (no slot, no tokens)."""
        lim = self.limits.get(team)
        if lim is None or lim.requests_per_minute is None:
            return
        only_requests = TeamLimits(requests_per_minute=lim.requests_per_minute)
        if await self._decide(team, only_requests, 0) is None:
            self._fallback_policy()
            self.fallback.take_request(team, time.monotonic())

    async def _decide(self, team: str, lim: TeamLimits, reserve_tokens: int) -> Admission | None:
        """Redis's decision (an admission, or LimitExceeded), or None when Redis is down."""
        if self._down_since is not None and time.monotonic() < self._retry_at:
            return None
        scope = self._scope(team)
        member = f"{self._id}:{next(self._seq)}"
        drain = self._draining and scope not in self._drained
        lease_ms = int(self.settings.lease_seconds * 1000)
        args: list[int | str] = [lim.requests_per_minute or 0, lim.tokens_per_minute or 0, lim.max_concurrent or 0,
                reserve_tokens, member, lease_ms, 1 if drain else 0]  # fmt: skip
        try:
            result = await self.resp.evalsha(_ADMIT, self._keys(scope), args)
        except _STORE_ERRORS as exc:
            self._went_down(exc, "admit")
            return None
        self._came_back()
        if drain:
            self._drained.add(scope)
        admitted, reason, retry_ms = int(result[0]), int(result[1]), int(result[2])
        requests, tokens, in_flight = float(result[3]), float(result[4]), int(result[5])
        self._observe(team, lim, requests, tokens, in_flight)
        headers = shared_headers(lim, requests, tokens)
        if not admitted:
            raise LimitExceeded(_REASONS[reason], retry_ms / 1000, headers)
        if lim.max_concurrent is not None:
            self._held.setdefault(scope, set()).add(member)
        return SharedAdmission(team, reserve_tokens, headers, scope=scope, member=member)

    def settle(self, admission: Admission, used_tokens: int) -> None:
        """Queue the settlement; a background task sends the queue in one pipeline."""
        if admission.settled:
            return
        if not isinstance(admission, SharedAdmission):
            self.fallback.settle(admission, used_tokens, time.monotonic())
            return
        admission.settled = True
        held = self._held.get(admission.scope)
        if held is not None:
            held.discard(admission.member)
        lim = self.limits.get(admission.team, TeamLimits())
        delta = admission.reserved_tokens - used_tokens if lim.tokens_per_minute else 0
        if lim.max_concurrent is None and delta == 0:
            return
        self._pending.append((admission.scope, admission.member,
                              [lim.requests_per_minute or 0, lim.tokens_per_minute or 0, delta]))  # fmt: skip
        self._wake.set()

    def configure(self, limits: dict[str, TeamLimits]) -> None:
        """Apply new limits; the shared buckets adopt them at their next admission."""
        self.limits = limits
        self.fallback.configure(fallback_limits(limits, self.live.count), time.monotonic())

    async def start(self) -> None:
        """Start settlement, lease renewal and the live-instance count."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._settler()), loop.create_task(self._renewer()),
                       loop.create_task(self.live.run())]  # fmt: skip

    async def close(self) -> None:
        """Send what is queued, stop the tasks, close the connections."""
        self._closing = True
        self._wake.set()
        others = self._tasks[1:]
        if self._tasks:
            settler = self._tasks[0]
            # Not cancelled: it sends what is queued, and ends by itself once closing is set.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(settler), 5.0)
        with contextlib.suppress(*_STORE_ERRORS):
            await self._flush()
        for task in others:
            task.cancel()
        for task in others:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.live.close()
        await self.resp.close()
        await self.redis.aclose()

    # -- failure policy --------------------------------------------------------------------------

    def _fallback_policy(self) -> None:
        """Apply on_failure: raise for fail_closed, size the local buckets for fail_open."""
        policy = self.settings.on_failure
        self.metrics.fallback.labels(policy).inc()
        if policy == "fail_closed":
            raise LimitsUnavailable(self.settings.retry_seconds)
        if self.live.count != self._live_applied:
            self._live_applied = self.live.count
            self.fallback.configure(fallback_limits(self.limits, self.live.count), time.monotonic())

    def _fallback_admit(self, team: str, reserve_tokens: int) -> Admission:
        self._fallback_policy()
        return self.fallback.admit(team, reserve_tokens, time.monotonic())

    def _went_down(self, exc: BaseException, call: str) -> None:
        self.metrics.errors.labels(call).inc()
        now = time.monotonic()
        self._retry_at = now + self.settings.retry_seconds
        if self._down_since is None:
            self._down_since = now
            self.metrics.up.set(0)
            log.error("shared team limits unavailable (%s: %s); now %s with %d live instances",
                      type(exc).__name__, exc, self.settings.on_failure, self.live.count)  # fmt: skip

    def _came_back(self) -> None:
        if self._down_since is None:
            return
        log.warning("shared team limits back after %.1fs; buckets restart empty",
                    time.monotonic() - self._down_since)  # fmt: skip
        self._down_since = None
        self.metrics.up.set(1)
        self._draining = True
        self._drained = set()

    def _observe(self, team: str, lim: TeamLimits, requests: float, tokens: float,
                 in_flight: int) -> None:  # fmt: skip
        if lim.requests_per_minute is not None:
            self._remaining(team, "requests").set(max(0.0, math.floor(requests)))
        if lim.tokens_per_minute is not None:
            self._remaining(team, "tokens").set(max(0.0, math.floor(tokens)))
        if lim.max_concurrent is not None:
            self._remaining(team, "concurrency").set(lim.max_concurrent - in_flight)

    def _remaining(self, team: str, limit: str) -> Gauge:
        """The team's gauge, looked up once: ``labels`` costs more than the rest of admission's
        bookkeeping in Python (profiled).
        """
        child = self._gauges.get((team, limit))
        if child is None:
            child = self._gauges[team, limit] = self.metrics.remaining.labels(team, limit)
        return child

    # -- background work -------------------------------------------------------------------------

    async def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        # On the admissions' connection, in one write: the replies queue behind nothing but
        # each other, and a settlement costs no pool checkout.
        results = await self.resp.pipeline(
            [("EVALSHA", _SETTLE.sha, 2, *self._keys(scope), *args, member)
             for scope, member, args in pending]
        )  # fmt: skip
        if any(isinstance(r, NoScriptError) for r in results):
            # Redis restarted and forgot the script: load it and send those settlements again.
            await self.resp.load(_SETTLE)
            again = [
                p for p, r in zip(pending, results, strict=True) if isinstance(r, NoScriptError)
            ]
            self._pending = again + self._pending
            self._wake.set()

    async def _settler(self) -> None:
        """Send queued settlements as they come, many in one pipeline, until closed."""
        while not self._closing:
            await self._wake.wait()
            await asyncio.sleep(_SETTLE_GATHER_SECONDS)
            self._wake.clear()
            try:
                await self._flush()
            except _STORE_ERRORS as exc:
                # Lost settlements cost at most one lease of a slot and an unreturned reservation.
                self._went_down(exc, "settle")

    async def _renewer(self) -> None:
        """Extend the leases of the slots held here every third of a lease."""
        lease_ms = int(self.settings.lease_seconds * 1000)
        while True:
            await asyncio.sleep(self.settings.lease_seconds / 3)
            for scope, members in list(self._held.items()):
                if not members:
                    continue
                try:
                    await self.resp.evalsha(_RENEW, [self._keys(scope)[1]], [lease_ms, *members])
                except _STORE_ERRORS as exc:
                    self._went_down(exc, "renew")
