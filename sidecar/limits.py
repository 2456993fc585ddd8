"""Per-team admission limits: requests/min, tokens/min and concurrent requests.

Token buckets refill continuously. A request reserves its prompt estimate plus ``max_tokens`` from
the tokens bucket when it is admitted, because the real count is known only when it ends; it
settles with the real usage then, returning what it did not use (or taking what it used beyond
the estimate, which may leave the bucket in debt until it refills). A request refused for any
reason takes nothing: a refusal before admission never reaches the buckets, and one after it
(fair share, draining) is refunded whole. All of this is pure: the clock is an argument, so the
tests drive it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from infermeter.config import TeamLimits

__all__ = [
    "Admission",
    "LimitExceeded",
    "LimitsUnavailable",
    "RateLimiter",
    "bucket_headers",
    "ratelimit_headers",
]


@dataclass
class _Bucket:
    capacity: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(
                self.capacity, self.level + (now - self.updated) * self.capacity / 60.0
            )
            self.updated = now

    def seconds_until(self, amount: float) -> float:
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing * 60.0 / self.capacity

    def reset_seconds(self) -> float:
        return (self.capacity - self.level) * 60.0 / self.capacity


@dataclass
class _TeamState:
    requests: _Bucket | None
    tokens: _Bucket | None
    max_concurrent: int | None
    in_flight: int = 0


# Not frozen: Python assigns __traceback__ and __context__ to exceptions in flight (contextlib's
# @contextmanager does), which a frozen dataclass refuses with FrozenInstanceError.
@dataclass(eq=False)
class LimitExceeded(Exception):
    """A request over one of its team's limits; ``reason`` labels the metric."""

    reason: str
    retry_after_seconds: float
    headers: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        what = {
            "requests": "requests per minute",
            "tokens": "tokens per minute",
            "concurrency": "concurrent requests",
        }[self.reason]
        return (
            f"Rate limit reached for {what}. Please try again in {self.retry_after_seconds:.1f}s."
        )


class LimitsUnavailable(Exception):
    """The shared limit store is down and the policy is fail_closed: answer 503."""

    def __init__(self, retry_after_seconds: float) -> None:
        super().__init__("Team limits are unavailable; the request was not served.")
        self.retry_after_seconds = retry_after_seconds


@dataclass(slots=True)
class Admission:
    """A granted request: what it reserved, to be settled exactly once."""

    team: str
    reserved_tokens: int
    headers: tuple[tuple[str, str], ...] = ()
    settled: bool = field(default=False)


# The header names of each bucket, made once.
_HEADER_NAMES = {
    name: (
        f"x-ratelimit-limit-{name}",
        f"x-ratelimit-remaining-{name}",
        f"x-ratelimit-reset-{name}",
    )
    for name in ("requests", "tokens")
}


def bucket_headers(
    name: str, limit: int, level: float, reset_seconds: float
) -> list[tuple[str, str]]:
    """The three ``x-ratelimit-*`` headers of one bucket (``requests`` or ``tokens``)."""
    limit_name, remaining_name, reset_name = _HEADER_NAMES[name]
    return [
        (limit_name, str(limit)),
        (remaining_name, str(max(0, int(level)))),
        (reset_name, f"{reset_seconds:.3f}s"),
    ]


def ratelimit_headers(state: _TeamState) -> tuple[tuple[str, str], ...]:
    """The ``x-ratelimit-*`` headers OpenAI clients read, for the limits the team has."""
    out: list[tuple[str, str]] = []
    for name, bucket in (("requests", state.requests), ("tokens", state.tokens)):
        if bucket is not None:
            out += bucket_headers(name, int(bucket.capacity), bucket.level, bucket.reset_seconds())
    return tuple(out)


class RateLimiter:
    """The limit state of every team of one sidecar."""

    def __init__(self, limits: dict[str, TeamLimits], now: float) -> None:
        self._teams: dict[str, _TeamState] = {}
        self.configure(limits, now)

    def configure(self, limits: dict[str, TeamLimits], now: float) -> None:
        """Apply (new) limits, keeping each team's current levels and in-flight count."""
        teams = {}
        for team, lim in limits.items():
            old = self._teams.get(team)
            teams[team] = _TeamState(
                requests=_resize(old.requests if old else None, lim.requests_per_minute, now),
                tokens=_resize(old.tokens if old else None, lim.tokens_per_minute, now),
                max_concurrent=lim.max_concurrent,
                in_flight=old.in_flight if old else 0,
            )
        self._teams = teams

    def in_flight(self, team: str) -> int:
        """Requests of ``team`` admitted and not yet settled."""
        state = self._teams.get(team)
        return state.in_flight if state else 0

    def admit(self, team: str, reserve_tokens: int, now: float) -> Admission:
        """Admit a request or raise LimitExceeded with the wait that would let it through."""
        state = self._teams[team]
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
        if state.max_concurrent is not None and state.in_flight >= state.max_concurrent:
            raise LimitExceeded("concurrency", 1.0, ratelimit_headers(state))
        if state.requests is not None and state.requests.level < 1:
            raise LimitExceeded(
                "requests", state.requests.seconds_until(1), ratelimit_headers(state)
            )
        if state.tokens is not None:
            # A request larger than the whole bucket could never pass; let it through when the
            # bucket is full rather than refusing it forever.
            need = min(reserve_tokens, state.tokens.capacity)
            if state.tokens.level < need:
                raise LimitExceeded(
                    "tokens", state.tokens.seconds_until(need), ratelimit_headers(state)
                )
            state.tokens.level -= reserve_tokens
        if state.requests is not None:
            state.requests.level -= 1
        state.in_flight += 1
        return Admission(team, reserve_tokens, ratelimit_headers(state))

    def settle(self, admission: Admission, used_tokens: int, now: float) -> None:
        """Replace the reservation by the real usage and free the concurrency slot."""
        if admission.settled:
            return
        admission.settled = True
        state = self._teams.get(admission.team)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        if state.tokens is not None:
            state.tokens.refill(now)
            state.tokens.level = min(
                state.tokens.capacity, state.tokens.level + admission.reserved_tokens - used_tokens
            )

    def refund(self, admission: Admission, now: float) -> None:
        """Give back all an admission took, its request, reservation and slot: its request was
        refused after admission (fair share, draining), so it was never served.

        Exactly once, like ``settle``; a refund after a settle, or a settle after it, is a no-op.
        """
        if admission.settled:
            return
        admission.settled = True
        state = self._teams.get(admission.team)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        for bucket, amount in ((state.requests, 1), (state.tokens, admission.reserved_tokens)):
            if bucket is not None:
                bucket.refill(now)
                bucket.level = min(bucket.capacity, bucket.level + amount)


def _resize(old: _Bucket | None, per_minute: int | None, now: float) -> _Bucket | None:
    if per_minute is None:
        return None
    if old is None:
        return _Bucket(float(per_minute), float(per_minute), now)
    old.refill(now)
    return _Bucket(float(per_minute), min(float(per_minute), old.level), now)


def estimate_prompt_tokens(body_bytes: int) -> int:
    """A cheap upper-ish estimate of prompt tokens from the request size (~4 bytes a token)."""
    return max(1, math.ceil(body_bytes / 4))
