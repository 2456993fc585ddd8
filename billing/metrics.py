"""Prometheus metrics of the billing service: money per team, and how ingest is doing.

Read at scrape time (a custom collector, as client_python recommends for values that live
elsewhere) from the chargeback it is given; the service gives it the statement cache its query
routes use, so a scrape never recomputes the month while the scraper waits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from billing.chargeback import Chargeback
from billing.ledger import IngestResult, Ledger
from billing.statement import error_lines
from billing.statement_cache import CachedChargeback
from infermeter.months import month_of

__all__ = [
    "IngestCounters",
    "InstanceCollector",
    "LedgerCollector",
    "SpendCollector",
    "StatementCollector",
]


class SpendCollector(Collector):
    """infermeter_team_spend_usd, infermeter_team_budget_usd, infermeter_team_spend_forecast_usd.

    And infermeter_billing_statement_error_lines: lines of this month's statement that could not
    be priced (a GPU model missing from the price book), which an operator should alert on.
    """

    def __init__(self, chargeback: Chargeback) -> None:
        self.chargeback = chargeback

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per team for each of the three gauges; the month's error lines."""
        rows = self.chargeback.spend()
        # The statement spend() just read (a cached chargeback serves it again without work).
        statement = self.chargeback.statement(month_of(time.time()))
        errors = GaugeMetricFamily(
            "infermeter_billing_statement_error_lines",
            "Lines of this month's statement that could not be priced (zero cost; the line's model says why).",
            labels=["reason"],
        )
        errors.add_metric(["unpriced_gpu_model"], error_lines(statement.lines).height)
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
        yield errors


class LedgerCollector(Collector):
    """Ingest transactions and the records they kept; batches waiting for the writer."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Read at scrape time from the ledger's own counters."""
        yield CounterMetricFamily(
            "infermeter_billing_ingest_transactions",
            "Committed ingest transactions (several batches share one under load).",
            value=self.ledger.ingest_transactions,
        )
        yield CounterMetricFamily(
            "infermeter_billing_ingest_transaction_records",
            "Records kept by those transactions; divided by the transactions, the group size.",
            value=self.ledger.ingest_records,
        )
        yield GaugeMetricFamily(
            "infermeter_billing_ingest_waiting_batches",
            "Batches parsed and queued for the next ingest transaction.",
            value=self.ledger.waiting_batches,
        )


class InstanceCollector(Collector):
    """infermeter_billing_live_instances: the dynamic fleet's live instances per replica group.

    From the instance registry (``billing.lifetimes``), which reads only the recent end of the
    instance events, so a scrape stays cheap however long the fleet has run.
    """

    def __init__(self, ledger: Ledger, heartbeat_seconds: float) -> None:
        self.ledger = ledger
        self.heartbeat_seconds = heartbeat_seconds

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per replica group and model with a live instance."""
        family = GaugeMetricFamily(
            "infermeter_billing_live_instances",
            "Instances of the replica group that announced themselves within three heartbeats.",
            labels=["replica", "model"],
        )
        for replica, model, count in self.ledger.live_instances(
            time.time(), self.heartbeat_seconds
        ):
            family.add_metric([replica, model], count)
        yield family


class StatementCollector(Collector):
    """Statements computed, and months held in the statement cache."""

    def __init__(self, cache: CachedChargeback) -> None:
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Read at scrape time from the cache's own counters."""
        yield CounterMetricFamily(
            "infermeter_billing_statement_computations",
            "Statements computed from the ledger (concurrent asks for one month share one).",
            value=self.cache.computations,
        )
        yield GaugeMetricFamily(
            "infermeter_billing_statement_cache_entries",
            "Months whose statement is cached (at most billing.statement_cache_entries).",
            value=len(self.cache),
        )


class IngestCounters:
    """infermeter_billing_ingest_records (by outcome) and _batches (by wire format)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.records = Counter("infermeter_billing_ingest_records", "Records received by ingest, by outcome.",
                               ["kind", "outcome"], registry=registry)  # fmt: skip
        self.batches = Counter("infermeter_billing_ingest_batches", "Batches acknowledged by ingest, by wire format.",
                               ["kind", "format"], registry=registry)  # fmt: skip

    def count(self, result: IngestResult, wire_format: str) -> None:
        """Count one acknowledged batch and what became of its records."""
        self.batches.labels(result.kind, wire_format).inc()
        self.records.labels(result.kind, "accepted").inc(result.accepted)
        self.records.labels(result.kind, "duplicate").inc(result.duplicates)
        self.records.labels(result.kind, "rejected").inc(len(result.rejected))
