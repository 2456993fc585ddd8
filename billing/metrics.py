"""Prometheus metrics of the billing service: money per team, and how ingest is doing.

Read at scrape time (a custom collector, as client_python recommends for values that live
elsewhere) from the chargeback it is given; the service gives it the statement cache its query
routes use, so a scrape never recomputes the month while the scraper waits.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Final

import polars as pl
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from billing import overrides, quarantine, reconciled, registry
from billing.chargeback import Chargeback
from billing.ledger import IngestResult, Ledger
from billing.lifetimes import LiveBound
from billing.reconciliation import HOUR_SECONDS
from billing.statement import error_counts
from billing.statement_cache import CachedChargeback
from infermeter.months import month_of
from infermeter.records import KINDS

__all__ = [
    "IngestCounters",
    "InstanceCollector",
    "LedgerCollector",
    "OverrideCollector",
    "QuarantineCollector",
    "ReconciliationCollector",
    "SpendCollector",
    "StatementCollector",
    "rejection_label",
]


class SpendCollector(Collector):
    """infermeter_team_spend_usd, infermeter_team_budget_usd, infermeter_team_spend_forecast_usd.

    And infermeter_billing_statement_error_lines{reason}: lines of this month's statement that
    could not be priced (``billing.statement.ERROR_REASONS``: a GPU model missing from the price
    book, an instance whose measured cost is out of range, a line that could not be rounded),
    which an operator should alert on.
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
        for reason, count in error_counts(statement.lines).items():
            errors.add_metric([reason], count)
        spend = GaugeMetricFamily(
            "infermeter_team_spend_usd",
            "Month-to-date cost charged to the team, USD.",
            labels=["team"],
        )
        budget = GaugeMetricFamily(
            "infermeter_team_budget_usd", "The team's monthly budget, USD.", labels=["team"]
        )
        forecast = GaugeMetricFamily(
            "infermeter_team_spend_forecast_usd",
            "Month-to-date spend extrapolated to the end of the month, USD.",
            labels=["team"],
        )
        for s in rows:
            spend.add_metric([s.team], s.spent_usd)
            budget.add_metric([s.team], s.budget_usd)
            forecast.add_metric([s.team], s.forecast_usd)
        yield spend
        yield budget
        yield forecast
        yield errors


class ReconciliationCollector(Collector):
    """The last whole hour's reconciliation per replica group: engine, unattributed, share.

    infermeter_reconciliation_engine_tokens, _difference_tokens (engine - ledger, signed),
    _hangup_tokens (the hang-up tails charged to the teams that hung up), _unattributed_tokens
    (the rest of the positive part, prompt and completion apart, summed over the group's
    instances), _unattributed_share (of the engine's tokens), _unreconciled_tokens and
    _unreconciled_requests (billed with no engine reading around them), and _hour_start_seconds.
    The hour is a whole one so that the alert on the share compares like with like; it is
    read from the ledger at scrape time, at most once per ``max_age_seconds`` (it reads the raw
    tables), so records that arrive late lower it again.
    """

    def __init__(
        self, ledger: Ledger, clock: Callable[[], float] = time.time, max_age_seconds: float = 60.0
    ) -> None:
        self.ledger = ledger
        self.clock = clock
        self.max_age_seconds = max_age_seconds
        # (read at, the hour's end, its rows): several scrapers share one read.
        self._last: tuple[float, float, pl.DataFrame] | None = None

    def _hour(self, now: float) -> tuple[float, pl.DataFrame]:
        end = now // HOUR_SECONDS * HOUR_SECONDS
        last = self._last
        if last is not None and last[1] == end and now - last[0] < self.max_age_seconds:
            return end, last[2]
        frame = reconciled.reconciled(self.ledger, end - HOUR_SECONDS, end)
        self._last = (now, end, frame)
        return end, frame

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per replica group and model for each gauge."""
        end, frame = self._hour(self.clock())
        summed = (
            "engine_tokens",
            "difference_tokens",
            "hangup_tokens",
            "unattributed_tokens",
            "unreconciled_tokens",
            "unreconciled_requests",
        )
        groups = (
            frame.group_by("replica", "model").agg(pl.col(*summed).sum()).sort("replica", "model")
        )
        labels = ["replica", "model"]

        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"infermeter_reconciliation_{name}", text, labels=labels)

        engine = gauge(
            "engine_tokens", "Tokens the group's engines counted in the last whole hour."
        )
        difference = gauge(
            "difference_tokens",
            "Engine tokens minus the ledger's in the last whole hour (negative: reported, not billed).",
        )
        hangup = gauge(
            "hangup_tokens",
            "Tokens vLLM generated after a client hung up, charged to that team, last whole hour.",
        )
        lost = gauge(
            "unattributed_tokens",
            "Tokens the engines counted that no usage record carries, last whole hour.",
        )
        share = gauge(
            "unattributed_share", "Unattributed tokens over the engines' tokens, last whole hour."
        )
        missed = gauge(
            "unreconciled_tokens",
            "Billed tokens with no engine reading before (or, once the instance went unread, after) them, by first token, last whole hour.",
        )
        missed_requests = gauge(
            "unreconciled_requests",
            "Billed requests with no engine reading around their first token, last whole hour.",
        )
        for replica, model, tokens, diff, tails, unattributed, unrec, unrec_n in groups.iter_rows():
            at = [replica, model]
            engine.add_metric(at, tokens)
            difference.add_metric(at, diff)
            hangup.add_metric(at, tails)
            lost.add_metric(at, unattributed)
            share.add_metric(at, unattributed / tokens if tokens else 0.0)
            missed.add_metric(at, unrec)
            missed_requests.add_metric(at, unrec_n)
        yield from (engine, difference, hangup, lost, share, missed, missed_requests)
        yield GaugeMetricFamily(
            "infermeter_reconciliation_hour_start_seconds",
            "Start of the hour the reconciliation gauges describe, Unix seconds.",
            value=end - HOUR_SECONDS,
        )


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


class QuarantineCollector(Collector):
    """infermeter_billing_quarantined_records_total{kind, reason}: records billing kept but does
    not bill (``billing.trust_sql``), by kind and reason category.

    Counted from the ``quarantine`` table at scrape time, so it survives a restart of billing and
    a batch sent twice counts once; the rendered rules alert on any increase.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[CounterMetricFamily]:
        """One sample per kind and reason with any quarantined record."""
        family = CounterMetricFamily(
            "infermeter_billing_quarantined_records",
            "Records kept in quarantine and never billed: an untrusted writer, an unknown team, "
            "model, replica group or node, or a spool line whose seal does not verify.",
            labels=["kind", "reason"],
        )
        for kind, reason, count in quarantine.quarantine_counts(self.ledger):
            family.add_metric([kind, reason], count)
        yield family


class OverrideCollector(Collector):
    """infermeter_team_budget_override_until_seconds{team}: when the override letting a team
    past its budget ends (Unix seconds), for each team whose last grant is in force.

    Read from the ledger at scrape time (``billing.overrides.last_grants``): a revocation or a
    grant that ran out removes the team's sample, as it ends the override on every sidecar.
    """

    def __init__(self, ledger: Ledger, clock: Callable[[], float] = time.time) -> None:
        self.ledger = ledger
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per team with an override in force."""
        family = GaugeMetricFamily(
            "infermeter_team_budget_override_until_seconds",
            "When the admin's override letting the team past its budget ends, Unix seconds "
            "(teams with none in force have no sample).",
            labels=["team"],
        )
        now = self.clock()
        with self.ledger.reader() as cur:
            grants = overrides.last_grants(cur, now)
        for team, grant in sorted(grants.items()):
            if grant["until"] > now:
                family.add_metric([team], grant["until"])
        yield family


class InstanceCollector(Collector):
    """infermeter_billing_live_instances: the dynamic fleet's live instances per replica group.

    From the instance registry (``billing.lifetimes``), which reads the ``lifetimes`` table (one
    row per lifetime, kept at ingest), so a scrape stays cheap however long the fleet has run.
    """

    def __init__(
        self, ledger: Ledger, heartbeat_seconds: float, bound: LiveBound | None = None
    ) -> None:
        """``bound``: count no more than the configuration lets each group run."""
        self.ledger = ledger
        self.heartbeat_seconds = heartbeat_seconds
        self.bound = bound

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per replica group and model with a live instance."""
        family = GaugeMetricFamily(
            "infermeter_billing_live_instances",
            "Instances of the replica group that announced themselves within three heartbeats.",
            labels=["replica", "model"],
        )
        for replica, model, count in registry.live_instances(
            self.ledger, time.time(), self.heartbeat_seconds, self.bound
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


# Rejection reasons that do not begin with a field name, by how they begin: the label they count
# under. Anything else is "other", so no caller can grow the label's values.
_REASON_LABELS: Final = (
    ("not valid JSON", "not_json"),
    ("not a JSON object", "not_an_object"),
    ("duplicate key", "duplicate_key"),
    ("unknown key", "unknown_key"),
    ("unknown team", "team"),
    ("token counts", "tokens"),
    ("request counts", "requests"),
    ("memory", "memory"),
    ("replica counts", "replica_counts"),
)
_LEADING_NAME: Final = re.compile(r"[a-z_]+")


def rejection_label(kind: str, reason: str) -> str:
    """The bounded label a rejection ``reason`` counts under: the field it names, or its rule.

    Reasons name their field first (``power_watts: 5000 W is more than the board can draw``);
    the rest begin with one of a few fixed phrases. Values and names a caller sent never
    become a label.
    """
    record = KINDS.get(kind)
    match = _LEADING_NAME.match(reason)
    if record is not None and match and match.group() in record.names:
        return match.group()
    return next((label for text, label in _REASON_LABELS if reason.startswith(text)), "other")


class IngestCounters:
    """infermeter_billing_ingest_records (by outcome), _batches (by wire format) and
    _rejections (by the field or rule that refused a record, ``rejection_label``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.records = Counter(
            "infermeter_billing_ingest_records",
            "Records received by ingest, by outcome.",
            ["kind", "outcome"],
            registry=registry,
        )
        self.batches = Counter(
            "infermeter_billing_ingest_batches",
            "Batches acknowledged by ingest, by wire format.",
            ["kind", "format"],
            registry=registry,
        )
        self.rejections = Counter(
            "infermeter_billing_ingest_rejections",
            "Records ingest refused, by kind and the field or rule that refused them.",
            ["kind", "reason"],
            registry=registry,
        )

    def count(self, result: IngestResult, wire_format: str) -> None:
        """Count one acknowledged batch and what became of its records."""
        self.batches.labels(result.kind, wire_format).inc()
        self.records.labels(result.kind, "accepted").inc(result.accepted)
        self.records.labels(result.kind, "duplicate").inc(result.duplicates)
        self.records.labels(result.kind, "rejected").inc(len(result.rejected))
        self.records.labels(result.kind, "quarantined").inc(len(result.quarantined))
        for rejection in result.rejected:
            self.rejections.labels(
                result.kind, rejection_label(result.kind, rejection.reason)
            ).inc()
