"""A bounded memory of gateway nonces, so a signed request is accepted once.

A signature is valid for ``window_seconds`` either side of its timestamp, so a nonce need only be
remembered that long; one stamped longer ago than that is refused as stale here too, whatever
window the signature check was given (a reload may widen it; this memory keeps its own).
Memory is bounded: past ``max_entries`` live nonces, the one with the oldest timestamp is
forgotten and the ``floor`` rises to its timestamp; any signature stamped at or before the floor
is then refused as stale. A forgotten nonce can therefore never be replayed; the price of a
flood is that the window narrows, never that replays get through.

Pure and in memory: ``sidecar.nonces`` keeps it on disk across restarts and shares it in Redis.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["ReplayCache"]


@dataclass
class ReplayCache:
    """Nonces seen within the window, at most ``max_entries`` of them."""

    window_seconds: float
    max_entries: int
    floor: float = float("-inf")
    _seen: set[str] = field(default_factory=set)
    _by_time: list[tuple[int, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: str, timestamp: int, now: float) -> Literal["stale", "replayed"] | None:
        """Remember ``nonce``; the reason to refuse it ("stale" or "replayed"), or None."""
        self._expire(now)
        if timestamp <= self.floor or timestamp < now - self.window_seconds:
            return "stale"
        if nonce in self._seen:
            return "replayed"
        while len(self._seen) >= self.max_entries:
            stamp, old = heapq.heappop(self._by_time)
            self._seen.discard(old)
            self.floor = max(self.floor, stamp)
            if timestamp <= self.floor:
                return "stale"
        self._seen.add(nonce)
        heapq.heappush(self._by_time, (timestamp, nonce))
        return None

    def entries(self) -> list[tuple[int, str]]:
        """Every nonce remembered, with its timestamp (a copy, in no particular order)."""
        return list(self._by_time)

    def _expire(self, now: float) -> None:
        # Nonces stamped before now - window are refused by the clock check: no need to keep them.
        while self._by_time and self._by_time[0][0] < now - self.window_seconds:
            self._seen.discard(heapq.heappop(self._by_time)[1])
