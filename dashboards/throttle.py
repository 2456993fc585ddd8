"""Sign-in throttling per client address: a few failed keys, then a lockout with a clear message.

A key is a bearer credential for billing, so a sign-in form that answers as fast as it is asked
is an oracle for guessing keys. After ``max_failures`` failed sign-ins from one address within
``window_seconds``, that address is refused for ``lockout_seconds`` without billing being asked.
A sign-in that succeeds clears no failures: a holder of one valid key could otherwise guess
others for ever, a few at a time, signing in with its own between them. The failures run out
with their window.

The address is the TCP peer the WSGI server reports: behind a reverse proxy every viewer shares
the proxy's address unless the operator wraps the app in a trusted proxy-header middleware.

State is bounded: at most ``max_addresses`` addresses are remembered and the one seen least
recently is forgotten first, so a flood of addresses costs capped memory (at the price of
forgetting the oldest lockout).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Attempts", "SignInThrottle", "ThrottlePolicy", "after_failure", "locked_message"]


@dataclass(frozen=True, slots=True)
class ThrottlePolicy:
    """How many failures an address may make, over what window, and how long it then waits."""

    max_failures: int = 5
    window_seconds: float = 300.0
    lockout_seconds: float = 60.0
    max_addresses: int = 10_000


@dataclass(frozen=True, slots=True)
class Attempts:
    """Failed sign-ins from one address: how many since ``first_at``, and when a lockout ends."""

    failures: int = 0
    first_at: float = 0.0
    locked_until: float = 0.0

    def retry_after(self, now: float) -> float:
        """Seconds until this address may try again (0: it may try now)."""
        return max(0.0, self.locked_until - now)


def after_failure(attempts: Attempts, now: float, policy: ThrottlePolicy) -> Attempts:
    """The attempts after one more failure at ``now``: the last one allowed starts a lockout."""
    fresh = attempts.failures == 0 or now - attempts.first_at > policy.window_seconds
    failures, first_at = (1, now) if fresh else (attempts.failures + 1, attempts.first_at)
    if failures >= policy.max_failures:
        # The count starts again once the lockout is over, so a guesser gets a few tries a lockout.
        return Attempts(0, now, now + policy.lockout_seconds)
    return Attempts(failures, first_at, attempts.locked_until)


def locked_message(retry_after_seconds: float) -> str:
    """What the sign-in form says to an address that is locked out."""
    seconds = max(1, math.ceil(retry_after_seconds))
    return f"Too many failed sign-ins from your address: try again in {seconds} s."


class SignInThrottle:
    """The attempts of every recent address, shared by the server's threads."""

    def __init__(
        self, policy: ThrottlePolicy | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policy = policy or ThrottlePolicy()
        self._clock = clock
        self._lock = threading.Lock()
        self._by_address: OrderedDict[str, Attempts] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_address)

    def now(self) -> float:
        """The throttle's clock: the time its lockouts are measured in."""
        return self._clock()

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try a key again (0: it may try now)."""
        with self._lock:
            attempts = self._by_address.get(address)
        return attempts.retry_after(self._clock()) if attempts else 0.0

    def failed(self, address: str) -> Attempts:
        """Count a failed sign-in from ``address``; its attempts now."""
        now = self._clock()
        with self._lock:
            attempts = after_failure(self._by_address.pop(address, Attempts()), now, self.policy)
            self._by_address[address] = attempts
            while len(self._by_address) > self.policy.max_addresses:
                self._by_address.popitem(last=False)
        return attempts
