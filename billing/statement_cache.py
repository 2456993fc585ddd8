"""Statements reused within one dashboard refresh, so pages and scrapes do not recompute them.

Every answer served from here says when the ledger was read (``as_of``) and until when it is
served (``expires_at``); the lifetime is at most the dashboard's refresh interval
(``Config.statement_ttl_seconds``), so the dashboard, ``/v1/spend`` and the command line agree
within one refresh.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from billing.chargeback import Chargeback, Spend, spend_of
from billing.ledger import Ledger
from infermeter.config import Config
from infermeter.months import month_of
from infermeter.statement import Statement

__all__ = ["Cached", "CachedChargeback"]


@dataclass(frozen=True)
class Cached:
    """A statement as the ledger had it at ``as_of``, served until ``expires_at`` (Unix seconds)."""

    statement: Statement
    as_of: float
    expires_at: float

    def spend(self, config: Config) -> list[Spend]:
        """The month-to-date spend this statement gives, forecast from ``as_of`` (not from now).

        A forecast from now over a statement read earlier would move while "spent" stands still.
        """
        return spend_of(self.statement, self.as_of, config)


class CachedChargeback(Chargeback):
    """Statements reused for ``ttl_seconds``, at most ``max_entries`` months of them.

    A statement is computed from a month of minute rollups, which takes seconds on a large
    ledger; the pages and the scrapes ask for it on every refresh. An entry younger than the
    TTL is served as is; an older one is recomputed while the caller waits, so no answer is
    older than the TTL. A refresh of many pages and users thus costs one computation.

    Any team key may ask for any month, so the cache is bounded: past ``max_entries`` months
    the least recently used is dropped. Callers asking for a month that is being computed wait
    for that computation instead of starting their own, so a burst of identical requests
    costs one computation (``computations`` counts them).
    """

    def __init__(
        self,
        ledger: Ledger,
        config: Config,
        ttl_seconds: float,
        max_entries: int = 36,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(ledger, config)
        self.ttl_seconds = ttl_seconds
        self._max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Cached] = OrderedDict()
        self._computing: dict[str, Future[Cached]] = {}
        self.computations = 0

    def reconfigure(self, config: Config) -> None:
        """Price by ``config`` from now on; every kept statement is dropped (it was priced by
        the configuration before)."""
        with self._lock:
            super().reconfigure(config)
            self._entries.clear()

    def forget(self) -> None:
        """Drop every kept statement: the ledger changed in a way records do not signal (an
        imported invoice changes a month's basis and the adjustments of the months after it)."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        """Months cached now."""
        with self._lock:
            return len(self._entries)

    def cached(self, month: str) -> Cached:
        """``month``'s entry while it is younger than the TTL, else one computed now."""
        now = self._clock()
        with self._lock:
            entry = self._entries.get(month)
            if entry is not None and now < entry.expires_at:
                self._entries.move_to_end(month)
                return entry
        return self.compute(month)

    def statement(self, month: str) -> Statement:
        """``month``'s statement, at most ``ttl_seconds`` old."""
        return self.cached(month).statement

    def spend(self, now: float | None = None) -> list[Spend]:
        """Month-to-date spend from the current month's cached statement (see ``Cached.spend``)."""
        return self.current(now).spend(self.config)

    def current(self, now: float | None = None) -> Cached:
        """The entry of the month ``now`` is in (default: the clock's now)."""
        return self.cached(month_of(self._clock() if now is None else now))

    def recompute(self, month: str) -> Statement:
        """``month``'s statement computed from the ledger now, and kept (see ``compute``)."""
        return self.compute(month).statement

    def compute(self, month: str) -> Cached:
        """Compute ``month``'s statement from the ledger and keep it.

        When the month is being computed already, its result is awaited and returned instead.
        """
        with self._lock:
            pending = self._computing.get(month)
            mine = pending is None
            if pending is None:
                pending = self._computing[month] = Future()
                self.computations += 1
        if not mine:
            return pending.result()
        try:
            # The ledger is read from here on: what the statement says is true as of now.
            as_of = self._clock()
            entry = Cached(super().statement(month), as_of, as_of + self.ttl_seconds)
        except BaseException as exc:
            with self._lock:
                del self._computing[month]
            pending.set_exception(exc)
            raise
        with self._lock:
            self._entries[month] = entry
            self._entries.move_to_end(month)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
            del self._computing[month]
        pending.set_result(entry)
        return entry
