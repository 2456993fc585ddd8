"""The allocation explorer's months, built from the ledger and reused between requests.

A month's cells (``billing.explorer.spread``) are made from its statement split by instance, which
costs about two statement computations on a large ledger (seconds), and from its hourly
profiles (tens of milliseconds from the hourly rollups). Every request of the explorer page
groups them again, which takes milliseconds; so each month's cells are kept:

- built from the statement cache's entry (``billing.statement_cache``), so they are the
  statement of that moment, and carry its ``as_of``;
- served as they are while younger than ``ttl_seconds``: the statement cache's lifetime, but
  at least ``MIN_TTL_SECONDS`` (a minute), since a rebuild costs a statement's allocation again
  and the explorer is for looking back, not for watching the last seconds;
- older, but younger than ``stale_seconds`` (five lifetimes): served as they are while one
  rebuild runs in the background, so no request waits seconds for a month being looked at;
- older still, or not built yet: built while the request waits (requests for a month being
  built share that build);
- at most ``max_months`` months kept, the least recently used dropped first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import polars as pl

from billing import queries
from billing.explorer import Cells, spread
from billing.ledger import Ledger
from billing.rollups import Rollups
from billing.statement_cache import CachedChargeback
from infermeter.months import month_bounds

__all__ = ["MIN_TTL_SECONDS", "Month", "Months"]

log = logging.getLogger("infermeter.billing")

MIN_TTL_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Month:
    """A month's cells as the ledger had them at ``as_of`` (its statement's), and what else the
    statement says: whether the month is closed, and its adjustments for earlier months per
    team (cents), which are on the statement but are no use of this month."""

    month: str
    cells: Cells
    as_of: float
    closed: bool
    adjustments: dict[str, int]
    built_at: float


class Months:
    """Each month's cells, reused within ``ttl_seconds`` and rebuilt as the module says."""

    def __init__(
        self,
        statements: CachedChargeback,
        rollups: Rollups,
        ttl_seconds: float,
        max_months: int = 4,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._statements = statements
        self._ledger: Ledger = statements.ledger
        self._rollups = rollups
        self.ttl_seconds = max(ttl_seconds, MIN_TTL_SECONDS)
        self.stale_seconds = 5 * self.ttl_seconds
        self._max = max_months
        self._clock = clock
        self._lock = threading.Lock()
        self._months: OrderedDict[str, Month] = OrderedDict()
        self._building: dict[str, Future[Month]] = {}
        self.builds = 0

    def get(self, month: str) -> Month:
        """``month``'s cells: kept, kept while a rebuild runs, or built now (see the module)."""
        now = self._clock()
        with self._lock:
            kept = self._months.get(month)
            if kept is not None:
                self._months.move_to_end(month)
        if kept is None or now - kept.as_of >= self.stale_seconds:
            return self._build(month)
        if now - kept.as_of >= self.ttl_seconds:
            self._rebuild_later(month)
        return kept

    def _rebuild_later(self, month: str) -> None:
        with self._lock:
            if month in self._building:
                return
        thread = threading.Thread(
            target=self._quietly, args=(month,), daemon=True, name=f"explorer {month}"
        )
        thread.start()

    def _quietly(self, month: str) -> None:
        try:
            self._build(month)
        except Exception:  # the kept cells stay served; the next request tries again
            log.exception("allocation explorer: rebuilding %s failed", month)

    def _build(self, month: str) -> Month:
        with self._lock:
            pending = self._building.get(month)
            mine = pending is None
            if pending is None:
                pending = self._building[month] = Future()
                self.builds += 1
        if not mine:
            return pending.result()
        try:
            built = self._compute(month)
        except BaseException as exc:
            with self._lock:
                del self._building[month]
            pending.set_exception(exc)
            raise
        with self._lock:
            self._months[month] = built
            self._months.move_to_end(month)
            while len(self._months) > self._max:
                self._months.popitem(last=False)
            del self._building[month]
        pending.set_result(built)
        return built

    def _compute(self, month: str) -> Month:
        """The month's cells from its cached statement, split by instance, and its profiles."""
        entry = self._statements.cached(month)
        statement = entry.statement
        split = self._statements.by_instance(statement)
        own = split.lines.filter(pl.col("for_month") == month)
        later = statement.lines.filter(pl.col("for_month") != month)
        adjustments = {
            str(t): int(c)
            for t, c in later.group_by("team").agg(pl.col("total_cents").sum()).iter_rows()
        }
        start, end = month_bounds(month)
        gpus, usage = self._profiles(start, end)
        cells = spread(month, own, gpus, usage, int(start) // 3600)
        return Month(month, cells, entry.as_of, statement.closed, adjustments, self._clock())

    def _profiles(self, start: float, end: float) -> tuple[pl.DataFrame, pl.DataFrame]:
        """The month's hourly cost and usage profiles, from the hourly rollups where they hold it."""
        config = self._statements.config
        prices = config.prices
        self._rollups.refresh_if_due(self._clock())
        # (The calendar served ends an hour before the month 2999-12 does: ``queries.LAST_SECOND``.)
        end = min(end, queries.LAST_SECOND)
        params = queries.params_from(start, end, 3600, coverage=self._rollups.coverage())
        gpu_sql = queries.explorer_gpu_sql(
            params, prices.usd_per_gpu_hour, prices.usd_per_kwh * prices.pue
        )
        usage_sql = queries.explorer_usage_sql(params)
        with self._ledger.reader() as cur:
            gpus: pl.DataFrame = cur.sql(gpu_sql[0], params=gpu_sql[1]).pl()
            usage: pl.DataFrame = cur.sql(usage_sql[0], params=usage_sql[1]).pl()
        if gpus.height == 0:
            gpus = pl.DataFrame(
                schema={
                    "replica": pl.String,
                    "instance": pl.String,
                    "hour": pl.Int64,
                    "node": pl.String,
                    "gpu_model": pl.String,
                    "cost_usd": pl.Float64,
                }
            )
        return gpus, usage
