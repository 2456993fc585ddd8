"""Statements reused for a few minutes, so pages and scrapes that refresh often do not recompute them."""

from __future__ import annotations

import threading
import time

from billing.chargeback import Chargeback
from billing.ledger import Ledger
from infermeter.config import Config
from infermeter.statement import Statement

__all__ = ["CachedChargeback"]


class CachedChargeback(Chargeback):
    """Statements reused for ``ttl_seconds``, so pages that refresh often do not recompute them.

    A statement is computed from a month of minute rollups, which takes seconds on a large
    ledger; the teams and chargeback pages ask for it on every refresh. A fresh entry is served
    as is; a stale one is served too, and recomputed after the response (``stale`` says so);
    only a month never computed is computed while the caller waits. ``spend`` reads the same
    cached statement of the current month.
    """

    def __init__(self, ledger: Ledger, config: Config, ttl_seconds: float = 300.0) -> None:
        super().__init__(ledger, config)
        self._ttl = ttl_seconds
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, Statement]] = {}
        self._computing: set[str] = set()

    def statement(self, month: str) -> Statement:
        """The cached statement of ``month`` (computed now if there is none)."""
        with self._lock:
            entry = self._entries.get(month)
        return entry[1] if entry is not None else self.recompute(month)

    def stale(self, month: str, now: float) -> bool:
        """True when ``month``'s entry is older than the TTL and nobody is recomputing it."""
        with self._lock:
            entry = self._entries.get(month)
            return (
                entry is not None and now - entry[0] >= self._ttl and month not in self._computing
            )

    def recompute(self, month: str) -> Statement:
        """Compute ``month``'s statement from the ledger and keep it."""
        with self._lock:
            self._computing.add(month)
        try:
            started = time.monotonic()
            statement = super().statement(month)
            with self._lock:
                self._entries[month] = (started, statement)
            return statement
        finally:
            with self._lock:
                self._computing.discard(month)
