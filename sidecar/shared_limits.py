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
  number of live instances (billing's instance registry, never more than the configuration
  allows: ``live_instances.instance_bound``), so the fleet stays near the limit;
- ``fail_closed``: ``LimitsUnavailable``, which the sidecar answers with 503 and Retry-After.

Either way the transition is logged once, ``infermeter_shared_limits_up`` drops to 0 and
``infermeter_shared_limits_fallback`` counts the requests decided without Redis. Redis is tried
again every ``retry_seconds``.

What one sidecar's outage (a blip, a timeout, a refused connection) may do to the others:
nothing but account for what it served. Each admission carries a unique member that Redis keeps
while the request runs, so every later step is exactly once:

- A call that fails after it was written (a timeout, a lost connection, a cancelled caller) may
  still run, or have run: the sidecar queues an ``UNDO`` of its member, sent once Redis answers
  again. It gives back what the admission took if it ran, and bars the member if it has not, so
  a late run does nothing. A call never written (``resp.NotSent``) needs nothing.
- Settlements that fail are sent again: a settlement acts only on the member it removes, so a
  second one changes nothing.
- Recovery: while it could not reach Redis, the sidecar admitted requests from its local
  buckets. It owes the fleet exactly those: the requests it admitted and the tokens they used
  (counted when they settle) in the last minute, the span over which a bucket remembers
  anything, since by then it has refilled whole. Its next admission of each scope carries that
  debt, taken at most one bucket deep and never below empty. The shared buckets are never reset:
  resetting them on recovery (as this module once did) emptied every bucket the sidecar touched,
  so one sidecar's blip gave every other sidecar 429s, N times for N sidecars; and forgiving the
  debt instead would let the fleet exceed its limit by what the recovering sidecar served. Taking
  what was really served keeps the fleet within its limit over the window (the local admissions
  plus the shared ones); when the whole fleet was cut off, the debts of all sidecars add up to
  what the fleet served in the last minute of the outage. Requests still running on local slots
  when Redis returns are not moved to Redis (their tokens are owed when they end), so the fleet
  may run up to one local share above ``max_concurrent`` until they do.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from infermeter.config import SharedLimitsSettings, TeamLimits, env_value
from sidecar.limits import (
    Admission,
    LimitExceeded,
    LimitsUnavailable,
    RateLimiter,
    bucket_headers,
)
from sidecar.live_instances import LiveInstances
from sidecar.resp import NoScriptError, NotSent, ReplyError, RespClient, Script, parse_url
from sidecar.shared_scripts import ADMIT, RENEW, SETTLE, UNDO

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
_ADMIT, _SETTLE, _UNDO, _RENEW = Script(ADMIT), Script(SETTLE), Script(UNDO), Script(RENEW)
# Settlements wait this long for others to share their write: at hundreds of requests a second
# that is several per system call instead of one, which measured a little less CPU and admission
# latency (a slot is freed 5 ms later, against a lease of seconds).
_SETTLE_GATHER_SECONDS = 0.005
# Local admissions are owed to the shared buckets this long: a bucket refills whole in a minute.
_OWED_SECONDS = 60
# Settlements and withdrawals kept for Redis while it does not answer; past this the oldest go
# (their slots then come free when their lease ends).
_MAX_QUEUED = 100_000


@dataclass(eq=False)
class SharedAdmission(Admission):
    """An admission granted by Redis: where to settle it."""

    scope: str = ""
    member: str = ""


@dataclass(eq=False)
class _LocalAdmission(Admission):
    """An admission from the local buckets while Redis was out of reach, and when it was made."""

    at: float = 0.0  # time.monotonic()


class _Owed:
    """What this sidecar served on its own for one scope and has not yet told Redis: requests
    and tokens by the second they were admitted or used, for the last ``_OWED_SECONDS``."""

    def __init__(self) -> None:
        self.slots: dict[int, list[int]] = {}

    def add(self, now: float, requests: int, tokens: int, second: int | None = None) -> None:
        """Count ``requests`` and ``tokens`` at ``second`` (default: now's); older ones go."""
        for old in [s for s in self.slots if s <= now - _OWED_SECONDS]:
            del self.slots[old]
        second = int(now) if second is None else second
        if second <= now - _OWED_SECONDS:
            return
        slot = self.slots.setdefault(second, [0, 0])
        slot[0] += requests
        slot[1] += tokens

    def total(self, now: float) -> tuple[int, int]:
        """What is owed now: the requests and tokens of the last ``_OWED_SECONDS``."""
        recent = [v for s, v in self.slots.items() if s > now - _OWED_SECONDS]
        return sum(v[0] for v in recent), sum(v[1] for v in recent)


class _Recent:
    """What this sidecar admitted through Redis for one scope over the last ``_OWED_SECONDS``:
    requests, and tokens as reserved then settled; running sums, by the second."""

    def __init__(self) -> None:
        self.slots: deque[tuple[int, int, int]] = deque()
        self.requests = 0
        self.tokens = 0

    def add(self, now: float, requests: int, tokens: int) -> None:
        """Count ``requests`` and ``tokens`` at now's second."""
        self.total(now)
        second = int(now)
        if self.slots and self.slots[-1][0] == second:
            _, r, t = self.slots.pop()
            self.slots.append((second, r + requests, t + tokens))
        else:
            self.slots.append((second, requests, tokens))
        self.requests += requests
        self.tokens += tokens

    def total(self, now: float) -> tuple[int, int]:
        """The requests and tokens of the last ``_OWED_SECONDS`` (never below nothing)."""
        while self.slots and self.slots[0][0] <= now - _OWED_SECONDS:
            _, r, t = self.slots.popleft()
            self.requests -= r
            self.tokens -= t
        return max(0, self.requests), max(0, self.tokens)


@dataclass(frozen=True)
class _Queued:
    """A script call to send in the background: a settlement or a withdrawal."""

    script: Script
    scope: str
    args: tuple[int | str, ...]


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
    for name, cap, level in (
        ("requests", lim.requests_per_minute, requests),
        ("tokens", lim.tokens_per_minute, tokens),
    ):
        if cap is not None:
            out += bucket_headers(name, cap, level, max(0.0, (cap - level) * 60.0 / cap))
    return tuple(out)


class SharedLimitsMetrics:
    """The metrics of the shared limiter: store health, fallbacks and what teams have left."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge(
            "infermeter_shared_limits_up",
            "1 while team limits are decided in the shared store, 0 while it is down.",
            registry=registry,
        )
        self.fallback = Counter(
            "infermeter_shared_limits_fallback",
            "Admissions decided without the shared store, by the policy applied.",
            ("policy",),
            registry=registry,
        )
        self.errors = Counter(
            "infermeter_shared_limits_errors",
            "Calls to the shared limit store that failed or timed out.",
            ("call",),
            registry=registry,
        )
        self.remaining = Gauge(
            "infermeter_team_limit_remaining",
            "What a team has left of a fleet-wide limit, as last seen by this sidecar.",
            ("team", "limit"),
            registry=registry,
        )
        self.up.set(1)


class SharedTeamLimiter:
    """The fleet-wide limiter: Redis when it answers, ``on_failure`` when it does not."""

    def __init__(
        self,
        settings: SharedLimitsSettings,
        limits: dict[str, TeamLimits],
        replica_id: str,
        registry: CollectorRegistry,
        client: aioredis.Redis | None = None,
        max_live: int | None = None,
    ) -> None:
        """``max_live``: the most live instances the configuration allows to share a limit
        (``live_instances.instance_bound``); the registry's count is clamped to it."""
        self.settings = settings
        self.replica_id = replica_id
        timeout = settings.timeout_millis / 1000
        assert settings.redis_url is not None
        password = env_value(settings.password_env) or None
        # Connection attempts back off up to retry_seconds, so Redis is still tried that often.
        self.resp = RespClient(
            parse_url(settings.redis_url, password),
            timeout,
            max_backoff_seconds=settings.retry_seconds,
        )
        # redis-py for the state shared off the hot path; it connects on its first command.
        self.redis = client or aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry_on_timeout=False,
            health_check_interval=0,
            password=password,
        )
        self.registry = registry
        self.metrics = SharedLimitsMetrics(registry)
        self._gauges: dict[tuple[str, str], Gauge] = {}
        group = replica_id if settings.scope == "team_replica" else None
        self.live = LiveInstances(
            settings.registry_url,
            env_value(settings.registry_token_env),
            group,
            settings.instances_refresh_seconds,
            max_count=max_live,
        )
        self._live_applied = 1
        self.limits = limits
        self.fallback = RateLimiter(fallback_limits(limits, 1), time.monotonic())
        self._id = uuid.uuid4().hex[:12]
        self._seq = itertools.count()
        self._lease_ms = int(settings.lease_seconds * 1000)
        # The members of the admissions in flight here, by scope: renewed until settled.
        self._held: dict[str, set[str]] = defaultdict(set)
        self._queued: list[_Queued] = []
        self._owed: dict[str, _Owed] = defaultdict(_Owed)
        # What was admitted through Redis, by scope: paid again if Redis loses the scope's state.
        self._recent: dict[str, _Recent] = defaultdict(_Recent)
        self._wake = asyncio.Event()
        self._closed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._closing = False

    # -- the interface ---------------------------------------------------------------------------

    def _scope(self, team: str) -> str:
        if self.settings.scope == "team_replica":
            return f"{team}/{self.replica_id}"
        return team

    def _keys(self, scope: str) -> tuple[str, str, str, str]:
        """The scope's buckets, its admissions in flight, its withdrawn admissions and the
        sidecars that paid for its state."""
        base = f"{self.settings.key_prefix}:{{{scope}}}"
        return f"{base}:b", f"{base}:c", f"{base}:x", f"{base}:p"

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
            return self._fallback_admit(team, lim, reserve_tokens)
        return admission

    async def _decide(self, team: str, lim: TeamLimits, reserve_tokens: int) -> Admission | None:
        """Redis's decision (an admission, or LimitExceeded), or None when Redis is down."""
        if self._down_since is not None and time.monotonic() < self._retry_at:
            return None
        scope = self._scope(team)
        member = f"{self._id}:{next(self._seq)}"
        owed_requests, owed_tokens = self._take_owed(scope)
        rpm, tpm = lim.requests_per_minute or 0, lim.tokens_per_minute or 0
        recent = self._recent[scope]
        recent_requests, recent_tokens = recent.total(time.monotonic())
        args: list[int | str] = [
            rpm,
            tpm,
            lim.max_concurrent or 0,
            reserve_tokens,
            member,
            self._lease_ms,
            owed_requests,
            owed_tokens,
            self._id,
            recent_requests,
            recent_tokens,
        ]
        try:
            result = await self.resp.evalsha(_ADMIT, self._keys(scope), args)
        except NotSent as exc:
            self._owed[scope].add(time.monotonic(), owed_requests, owed_tokens)
            self._went_down(exc, "admit")
            return None
        except (*_STORE_ERRORS, asyncio.CancelledError) as exc:
            # Written, so Redis may have run it, or run it yet (a pause): withdraw it.
            self._queue(
                _UNDO,
                scope,
                rpm,
                tpm,
                reserve_tokens,
                member,
                self._lease_ms,
                owed_requests,
                owed_tokens,
            )
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._went_down(exc, "admit")
            return None
        self._came_back()
        admitted, reason, retry_ms = int(result[0]), int(result[1]), int(result[2])
        requests, tokens, in_flight = float(result[3]), float(result[4]), int(result[5])
        self._observe(team, lim, requests, tokens, in_flight)
        headers = shared_headers(lim, requests, tokens)
        if not admitted:
            raise LimitExceeded(_REASONS[reason], retry_ms / 1000, headers)
        recent.add(time.monotonic(), 1, reserve_tokens)
        self._held[scope].add(member)
        return SharedAdmission(team, reserve_tokens, headers, scope=scope, member=member)

    def settle(self, admission: Admission, used_tokens: int) -> None:
        """Queue the settlement; a background task sends the queue in one pipeline."""
        if admission.settled:
            return
        lim = self.limits.get(admission.team, TeamLimits())
        if not isinstance(admission, SharedAdmission):
            now = time.monotonic()
            self.fallback.settle(admission, used_tokens, now)
            if isinstance(admission, _LocalAdmission) and lim.tokens_per_minute:
                self._owed[self._scope(admission.team)].add(now, 0, used_tokens)
            return
        admission.settled = True
        self._held[admission.scope].discard(admission.member)
        self._recent[admission.scope].add(
            time.monotonic(), 0, used_tokens - admission.reserved_tokens
        )
        delta = admission.reserved_tokens - used_tokens if lim.tokens_per_minute else 0
        self._queue(
            _SETTLE,
            admission.scope,
            lim.requests_per_minute or 0,
            lim.tokens_per_minute or 0,
            delta,
            admission.member,
        )

    def refund(self, admission: Admission) -> None:
        """Give back the request, the reservation and the slot of an admission never served."""
        if admission.settled:
            return
        lim = self.limits.get(admission.team, TeamLimits())
        if not isinstance(admission, SharedAdmission):
            now = time.monotonic()
            self.fallback.refund(admission, now)
            if isinstance(admission, _LocalAdmission) and lim.requests_per_minute:
                # Taken back where it was counted (given back with the next, if already sent).
                self._owed[self._scope(admission.team)].add(now, -1, 0, int(admission.at))
            return
        admission.settled = True
        self._held[admission.scope].discard(admission.member)
        self._recent[admission.scope].add(time.monotonic(), -1, -admission.reserved_tokens)
        self._queue(
            _UNDO,
            admission.scope,
            lim.requests_per_minute or 0,
            lim.tokens_per_minute or 0,
            admission.reserved_tokens,
            admission.member,
            self._lease_ms,
            0,
            0,
        )

    def configure(self, limits: dict[str, TeamLimits]) -> None:
        """Apply new limits; the shared buckets adopt them at their next admission."""
        self.limits = limits
        self.fallback.configure(fallback_limits(limits, self.live.count), time.monotonic())

    async def start(self) -> None:
        """Start settlement, lease renewal and the live-instance count."""
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._settler()),
            loop.create_task(self._renewer()),
            loop.create_task(self.live.run()),
        ]

    async def close(self) -> None:
        """Send what is queued (for at most 5 s), stop the tasks, close the connections."""
        self._closing = True
        self._closed.set()
        self._wake.set()
        if self._tasks:
            # The settler ends by itself once what is queued is sent (or cannot be).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._tasks[0]), 5.0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(*_STORE_ERRORS):
            await self._flush()  # what a limiter never started has queued
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

    def _fallback_admit(self, team: str, lim: TeamLimits, reserve_tokens: int) -> Admission:
        self._fallback_policy()
        now = time.monotonic()
        local = self.fallback.admit(team, reserve_tokens, now)
        if lim.requests_per_minute:
            self._owed[self._scope(team)].add(now, 1, 0)
        return _LocalAdmission(team, reserve_tokens, local.headers, at=now)

    def _take_owed(self, scope: str) -> tuple[int, int]:
        """What ``scope`` owes for local admissions, to send with its next admission."""
        owed = self._owed.pop(scope, None)
        return (0, 0) if owed is None else owed.total(time.monotonic())

    def _went_down(self, exc: BaseException, call: str) -> None:
        self.metrics.errors.labels(call).inc()
        now = time.monotonic()
        self._retry_at = now + self.settings.retry_seconds
        if self._down_since is None:
            self._down_since = now
            self.metrics.up.set(0)
            log.error(
                "shared team limits unavailable (%s: %s); now %s with %d live instances",
                type(exc).__name__,
                exc,
                self.settings.on_failure,
                self.live.count,
            )

    def _came_back(self) -> None:
        if self._down_since is None:
            return
        log.warning(
            "shared team limits back after %.1fs; what was admitted locally meanwhile "
            "is taken from the shared buckets",
            time.monotonic() - self._down_since,
        )
        self._down_since = None
        self.metrics.up.set(1)
        if self._queued:
            self._wake.set()

    def _observe(
        self, team: str, lim: TeamLimits, requests: float, tokens: float, in_flight: int
    ) -> None:
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

    def _queue(self, script: Script, scope: str, *args: int | str) -> None:
        """Queue a settlement or a withdrawal for the settler."""
        if len(self._queued) >= _MAX_QUEUED:
            del self._queued[0]
            log.error(
                "more than %d settlements wait for Redis; the oldest is dropped (its slot "
                "comes free at the end of its lease)",
                _MAX_QUEUED,
            )
        self._queued.append(_Queued(script, scope, args))
        self._wake.set()

    def _command(self, q: _Queued) -> tuple[int | str, ...]:
        keys = self._keys(q.scope)[: 4 if q.script is _SETTLE else 3]
        return ("EVALSHA", q.script.sha, len(keys), *keys, *q.args)

    async def _flush(self) -> None:
        """Send what is queued in one write; on a failure it stays queued, to be sent again."""
        batch, self._queued = self._queued, []
        if not batch:
            return
        # On the admissions' connection, in one write: the replies queue behind nothing but
        # each other, and a settlement costs no pool checkout.
        try:
            results = await self.resp.pipeline([self._command(q) for q in batch])
        except BaseException:
            # Each is exactly once on the server, so sending it again is safe.
            self._queued = batch + self._queued
            raise
        self._came_back()
        again = [q for q, r in zip(batch, results, strict=True) if isinstance(r, NoScriptError)]
        failed = [
            r for r in results if isinstance(r, ReplyError) and not isinstance(r, NoScriptError)
        ]
        if failed:
            log.error(
                "%d settlement(s) refused by Redis, not sent again: %s", len(failed), failed[0]
            )
        if again:
            # Redis restarted and forgot the scripts: load them and send those again.
            for script in {q.script for q in again}:
                await self.resp.load(script)
            self._queued = again + self._queued
            self._wake.set()

    async def _settler(self) -> None:
        """Send queued settlements as they come, many in one pipeline, until closed; while
        Redis does not answer, keep them and try again every ``retry_seconds``."""
        while True:
            await self._wake.wait()
            if not self._closing:
                await asyncio.sleep(_SETTLE_GATHER_SECONDS)
                wait = self._retry_at - time.monotonic() if self._down_since is not None else 0
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._closed.wait(), wait)
            self._wake.clear()
            try:
                await self._flush()
            except _STORE_ERRORS as exc:
                self._went_down(exc, "settle")
                if self._closing:
                    return
                self._wake.set()
                continue
            if self._closing and not self._queued:
                return

    async def _renewer(self) -> None:
        """Extend the leases of the slots held here every third of a lease."""
        while True:
            await asyncio.sleep(self.settings.lease_seconds / 3)
            for scope, members in list(self._held.items()):
                if not members:
                    continue
                try:
                    await self.resp.evalsha(
                        _RENEW, [self._keys(scope)[1]], [self._lease_ms, *members]
                    )
                except _STORE_ERRORS as exc:
                    self._went_down(exc, "renew")
