"""Coarse copies of the ledger's minute rollups, kept fresh for the dashboards' queries.

The dashboards ask for hours and days of series every few seconds; reading minutes for that is
slow on a large ledger, so 5-minute and hourly copies are kept and read when they cover the
range (``billing.queries`` chooses).

The copies are not the ledger's: they live in an in-memory database attached to the ledger's
connection (``billing.queries.rollup_setup_sql``), rebuilt from the minute rollups after a
restart. Their transactions therefore run on a reader's cursor (``Ledger.reader``), outside the
writer's lock: they write nothing ingest writes, and a refresh never makes a batch wait.
"""

from __future__ import annotations

import logging
import threading

import duckdb

from billing import queries
from billing.ledger import Ledger

__all__ = ["Rollups"]

log = logging.getLogger("infermeter.billing")


class Rollups:
    """The coarse copies of the minute rollups (see ``billing.queries``) and what they cover.

    Built from the whole ledger the first time, then every ``interval_seconds`` the periods that
    ended in the last ``reroll_minutes`` are recomputed, so records that arrive a little late are
    included; only periods that ended ``settle_seconds`` ago are copied. The 5-minute copy keeps
    ``keep_5m_days`` days (ranges that use it span at most ``MAX_POINTS`` x 5 minutes). Refreshes
    run inside a query (one at a time; a query that finds one running does not wait) and
    cost tens of milliseconds; the first, over the whole ledger, runs when the app is made.
    """

    def __init__(
        self,
        ledger: Ledger,
        interval_seconds: float = 60.0,
        settle_seconds: float = 120.0,
        reroll_minutes: int = 180,
        keep_5m_days: int = 3,
    ) -> None:
        self._ledger = ledger
        self._interval = interval_seconds
        self._settle = settle_seconds
        self._reroll = reroll_minutes
        self._keep_5m = keep_5m_days * 1440
        self._lock = threading.Lock()
        self._running = threading.Lock()
        self._spans: dict[tuple[str, int], tuple[int, int]] = {}
        self._last = float("-inf")

    def coverage(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(table, period) -> [first, after-last) slots each coarse copy holds now."""
        with self._lock:
            return dict(self._spans)

    def refresh_if_due(self, now: float) -> None:
        """Refresh when ``interval_seconds`` have passed, unless another caller is refreshing."""
        if now - self._last < self._interval or not self._running.acquire(blocking=False):
            return
        try:
            self._last = now
            self._refresh(now)
        except duckdb.Error as exc:  # the copies stay as they were; answers stay right
            log.warning("dashboard rollups not refreshed: %s", exc)
        finally:
            self._running.release()

    def refresh(self, now: float) -> None:
        """Bring every coarse copy up to the periods that ended ``settle_seconds`` before ``now``."""
        with self._running:
            self._last = now
            self._refresh(now)

    def _refresh(self, now: float) -> None:
        # Records that arrived since the last refresh, however old their time: their periods
        # are recomputed too, not only the last ``reroll_minutes``.
        touched = self._ledger.take_touched()
        try:
            with self._ledger.reader() as cur:
                for statement in queries.rollup_setup_sql():
                    cur.execute(statement)
                for name, copy in queries.COPIES.items():
                    first_row = cur.execute(copy.first).fetchone()
                    if first_row is None or first_row[0] is None:
                        continue
                    for period in queries.PERIODS:
                        self._refresh_one(cur, name, period, int(first_row[0]), now, touched)
        except BaseException:
            if touched is not None:
                self._ledger.retouch(touched)
            raise

    def _refresh_one(
        self,
        cur: duckdb.DuckDBPyConnection,
        name: str,
        period: int,
        first: int,
        now: float,
        touched: tuple[float, float] | None = None,
    ) -> None:
        done = int((now - self._settle) // 60) // period * period
        old = self.coverage().get((name, period))
        start = first // period * period
        if period < max(queries.PERIODS):
            start = max(start, (done - self._keep_5m) // period * period)
        lo = start if old is None else max(start, (old[1] - self._reroll) // period * period)
        if touched is not None and old is not None:
            lo = min(lo, max(start, int(touched[0] // 60) // period * period))
        if lo >= done:
            return
        cur.execute("BEGIN TRANSACTION")
        try:
            for statement in queries.rollup_sql(name, period, lo, done):
                cur.execute(statement)
            # Rows below the new start are dropped a day late: a query that read the old
            # coverage a moment ago may still be reading them.
            cur.execute(queries.trim_sql(name, period, start - 1440))
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        with self._lock:
            self._spans[(name, period)] = (start, done)
