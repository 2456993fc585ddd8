"""Prometheus gauges for money: month-to-date spend, budget and forecast per team.

Computed at scrape time from the ledger (a custom collector, as client_python recommends for
values that live elsewhere), and cached briefly so that several scrapers in a row do not each
recompute the month.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from billing.chargeback import Chargeback, Spend

__all__ = ["SpendCollector"]


class SpendCollector(Collector):
    """infermeter_team_spend_usd, infermeter_team_budget_usd, infermeter_team_spend_forecast_usd."""

    def __init__(self, chargeback: Chargeback, cache_seconds: float = 15.0) -> None:
        self.chargeback = chargeback
        self.cache_seconds = cache_seconds
        self._cached: tuple[float, list[Spend]] | None = None

    def _spend(self) -> list[Spend]:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > self.cache_seconds:
            self._cached = (now, self.chargeback.spend())
        return self._cached[1]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per team for each of the three gauges."""
        rows = self._spend()
        spend = GaugeMetricFamily(
            "infermeter_team_spend_usd",
            "Month-to-date cost charged to the team, USD.",
            labels=["team"],
        )
        budget = GaugeMetricFamily(
            "infermeter_team_budget_usd", "The team's monthly budget, USD.", labels=["team"]
        )
        forecast = GaugeMetricFamily("infermeter_team_spend_forecast_usd",
                                     "Month-to-date spend extrapolated to the end of the month, USD.", labels=["team"])  # fmt: skip
        for s in rows:
            spend.add_metric([s.team], s.spent_usd)
            budget.add_metric([s.team], s.budget_usd)
            forecast.add_metric([s.team], s.forecast_usd)
        yield spend
        yield budget
        yield forecast
