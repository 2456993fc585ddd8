"""Reads per caller: a token bucket per principal, so one team cannot hog the service.

Statements, files and queries cost the service real work (a month of rollups per statement),
and any team key may ask for them. Each caller (the admin, or a team: every key of a team
shares its team's bucket) holds ``burst`` tokens, refilled at ``rate_per_second``; a read takes
one, and a caller with none left is refused (429) with the seconds until its next token.
Ingest and ``/metrics`` are not read through here: shippers and Prometheus have their own
pacing, and a team's reads must not starve them.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

__all__ = ["Bucket", "RateLimitedError", "ReadLimiter", "take"]


class RateLimitedError(Exception):
    """A caller asked faster than its read rate (429); ``retry_after_seconds`` says when to retry."""

    def __init__(self, message: str, retry_after_seconds: int) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


@dataclass(frozen=True, slots=True)
class Bucket:
    """Tokens a caller holds at ``at`` (a monotonic time)."""

    tokens: float
    at: float


def take(bucket: Bucket | None, now: float, rate: float, burst: int) -> tuple[Bucket, float]:
    """The bucket after one read at ``now``, and 0.0, or the unchanged bucket and the wait.

    A caller never seen starts with a full bucket; the wait is the seconds until one token.
    """
    held = float(burst) if bucket is None else min(burst, bucket.tokens + (now - bucket.at) * rate)
    if held >= 1.0:
        return Bucket(held - 1.0, now), 0.0
    return Bucket(held, now), (1.0 - held) / rate


class ReadLimiter:
    """The buckets of every caller seen; one per principal, so the map is as small as the keyring."""

    def __init__(self, rate_per_second: float, burst: int) -> None:
        self._rate = rate_per_second
        self._burst = burst
        self._lock = threading.Lock()
        self._buckets: dict[str, Bucket] = {}

    def admit(self, caller: str, now: float) -> None:
        """Take one of ``caller``'s tokens; RateLimitedError when it has none."""
        with self._lock:
            bucket, wait = take(self._buckets.get(caller), now, self._rate, self._burst)
            self._buckets[caller] = bucket
        if wait:
            raise RateLimitedError(
                f"too many requests: at most {self._rate:g} a second after a burst of "
                f"{self._burst} (billing.read_rate_per_second, billing.read_burst)",
                max(1, math.ceil(wait)),
            )
