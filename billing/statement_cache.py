"""Statements reused for a few minutes, so pages and scrapes that refresh often do not recompute them."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from billing.chargeback import Chargeback
from billing.ledger import Ledger
from infermeter.config import Config
from infermeter.statement import Statement

__all__ = ["CachedChargeback"]


class CachedChargeback(Chargeback):
    """Statements reused for ``ttl_seconds``, at most ``max_entries`` months of them.

    A statement is computed from a month of minute rollups, which takes seconds on a large
    ledger; the teams and chargeback pages ask for it on every refresh. A fresh entry is served
    as is; a stale one is served too, and recomputed after the response (``stale`` says so);
    only a month not cached is computed while the caller waits. ``spend`` reads the same
    cached statement of the current month.

    Any team key may ask for any month, so the cache is bounded: past ``max_entries`` months
    the least recently used is dropped. Callers asking for a month that is being computed wait
    for that computation instead of starting their own, so a burst of identical requests
    costs one computation (``computations`` counts them).
    """

    def __init__(self, ledger: Ledger, config: Config, ttl_seconds: float = 300.0,
                 max_entries: int = 36) -> None:  # fmt: skip
        super().__init__(ledger, config)
        self._ttl = ttl_seconds
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, Statement]] = OrderedDict()
        self._computing: dict[str, Future[Statement]] = {}
        self.computations = 0

    def __len__(self) -> int:
        """Months cached now."""
        with self._lock:
            return len(self._entries)

    def statement(self, month: str) -> Statement:
        """The cached statement of ``month`` (computed now if there is none)."""
        with self._lock:
            entry = self._entries.get(month)
            if entry is not None:
                self._entries.move_to_end(month)
                return entry[1]
        return self.recompute(month)

    def stale(self, month: str, now: float) -> bool:
        """True when ``month``'s entry is older than the TTL and nobody is recomputing it."""
        with self._lock:
            entry = self._entries.get(month)
            return (
                entry is not None and now - entry[0] >= self._ttl and month not in self._computing
            )

    def recompute(self, month: str) -> Statement:
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
            started = time.monotonic()
            statement = super().statement(month)
        except BaseException as exc:
            with self._lock:
                del self._computing[month]
            pending.set_exception(exc)
            raise
        with self._lock:
            self._entries[month] = (started, statement)
            self._entries.move_to_end(month)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
            del self._computing[month]
        pending.set_result(statement)
        return statement
