"""Metric export over OTLP: points built from a service's own figures, sent by the SDK's exporter.

A service keeps its figures as it always does (the sidecar in plain lists at a request's end,
the collector in its fleet view, billing in its statements) and, when an export is due, its
producers turn them into OpenTelemetry's metric points, the way its Prometheus collectors build
families at scrape time. The SDK's ``OTLPMetricExporter`` (http/protobuf or grpc) encodes and
sends them and reads its endpoint, headers, timeout and compression from the environment; this
module adds the interval and what a failure does.

Why not the SDK's instruments and reader: ``Histogram.record`` costs 17-23 µs per call here
(attribute hashing and validation, locks), about 40 times what the sidecar's own histograms cost
(``bench.otel_record``), so five of them per request would cost a short request up to half its
CPU; and the SDK's reader (1.45) takes no data from outside its instruments.

Every figure is exported cumulative (start: when the process started keeping it), so an export
that fails loses nothing: the next one carries the totals. Failures never reach a request: the
send runs on a worker thread, one at a time, bounded by the exporter's own timeout. The first
failure of an outage is logged once (with the exporter's reason), its end once, and every failed
export is counted in ``infermeter_otlp_export_failures_total`` on the service's ``/metrics``;
the exporter's own per-attempt log lines are kept out of the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry, Counter

from infermeter.otlp import OtlpConfigError, OtlpSettings

__all__ = [
    "Attributes",
    "MetricsExport",
    "Producer",
    "gauge",
    "histogram",
    "make_exporter",
    "make_metrics_export",
    "monotonic_sum",
    "up_down_sum",
]

log = logging.getLogger("infermeter.otlp")

Attributes = Mapping[str, str | int | float | bool]
# Builds the points of one export: (start of the figures, now), both in Unix nanoseconds.
Producer = Callable[[int, int], Awaitable[Sequence[Metric]]]

CUMULATIVE = AggregationTemporality.CUMULATIVE
# The SDK exporters log each failed attempt; an outage is told once here instead.
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
)
# The exporter's own timeout bounds each send; the way out waits this long at most for the last.
SHUTDOWN_SECONDS = 5.0


class _LastMessage(logging.Filter):
    """Keeps the last line an exporter logged (the reason an export failed) and drops it: a
    filter, not a handler, so that no logging configuration made later lets the lines through."""

    def __init__(self) -> None:
        super().__init__()
        self.message = ""

    def filter(self, record: logging.LogRecord) -> bool:
        self.message = record.getMessage()
        return False


def _capture_exporter_logs() -> _LastMessage:
    keeper = _LastMessage()
    for name in _EXPORTER_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _LastMessage)]:
            logger.removeFilter(old)
        logger.addFilter(keeper)
    return keeper


def make_exporter(protocol: str) -> MetricExporter:
    """The SDK's OTLP metric exporter for ``protocol``; it reads the rest of its settings itself.

    OtlpConfigError when grpc is asked for and its exporter package is not installed.
    """
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcExporter,
            )
        except ImportError:
            raise OtlpConfigError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the package "
                "opentelemetry-exporter-otlp-proto-grpc"
            ) from None
        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter()


class MetricsExport:
    """Every ``interval_seconds``, the producers' points to the exporter, off the event loop."""

    def __init__(
        self,
        exporter: MetricExporter,
        resource: Resource,
        scope: InstrumentationScope,
        producers: Sequence[Producer],
        interval_seconds: float,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.exporter = exporter
        self.resource = resource
        self.scope = scope
        self.producers = list(producers)
        self.interval_seconds = interval_seconds
        self.start_ns = time.time_ns()
        self.failures = Counter(
            "infermeter_otlp_export_failures",
            "Metric exports over OTLP that failed (receiver down, an error status, a timeout); "
            "figures are cumulative, so the next export carries what a failed one held.",
            registry=registry if registry is not None else CollectorRegistry(),
        )
        self.exports = 0
        self.failing_since: float | None = None
        self._failed_in_row = 0
        self._reason = _capture_exporter_logs()
        self._lock = asyncio.Lock()
        self._sending: asyncio.Future[bool] | None = None

    async def run(self) -> None:
        """Export every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval_seconds)
            await self.export_once()

    async def export_once(self) -> bool:
        """Build the points now and send them; True when the receiver took them.

        Sends never overlap (the SDK's exporters are not made for it): a send whose caller was
        cancelled (the loop stopping) goes on in its thread, and the next export waits for it.
        """
        async with self._lock:
            if self._sending is not None:
                await asyncio.wait([self._sending])
            now = time.time_ns()
            metrics = [
                m for p in self.producers for m in await p(self.start_ns, now) if m.data.data_points
            ]
            data = MetricsData(
                [
                    ResourceMetrics(
                        self.resource,
                        [ScopeMetrics(self.scope, metrics, self.scope.schema_url or "")],
                        self.resource.schema_url,
                    )
                ]
            )
            self._sending = asyncio.ensure_future(asyncio.to_thread(self._send, data))
            ok = await asyncio.shield(self._sending)
            self._sending = None
            self._note(ok)
            return ok

    def _send(self, data: MetricsData) -> bool:
        self._reason.message = ""
        try:
            result = self.exporter.export(data)
        except Exception as exc:  # a third-party exporter's failure must not end the loop
            self._reason.message = f"{type(exc).__name__}: {exc}"
            return False
        return result is MetricExportResult.SUCCESS

    def _note(self, ok: bool) -> None:
        self.exports += 1
        if ok:
            if self.failing_since is not None:
                log.warning(
                    "OTLP metric export works again, after %d failed export(s)", self._failed_in_row
                )
            self.failing_since, self._failed_in_row = None, 0
            return
        self.failures.inc()
        self._failed_in_row += 1
        if self.failing_since is None:
            self.failing_since = time.time()
            log.warning(
                "OTLP metric export failing (%s); figures are kept and go with the "
                "next export that succeeds",
                self._reason.message or "no reason given",
            )

    async def close(self, timeout_seconds: float = SHUTDOWN_SECONDS) -> None:
        """One last export, then the exporter closes; at most ``timeout_seconds`` in all."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_seconds):
                await self.export_once()
        await asyncio.to_thread(self.exporter.shutdown)


def make_metrics_export(
    settings: OtlpSettings,
    service_name: str,
    scope_name: str,
    resource_attributes: Mapping[str, str],
    producers: Sequence[Producer],
    registry: CollectorRegistry | None = None,
    schema_url: str = "",
) -> MetricsExport:
    """An export of ``producers`` as ``service_name`` (``OTEL_RESOURCE_ATTRIBUTES`` joins in).

    ``scope_name`` is the instrumentation scope (one per kind of service, such as
    ``infermeter.sidecar``), ``schema_url`` the semantic conventions its points follow.
    """
    resource = Resource.create({**resource_attributes, "service.name": service_name})
    scope = InstrumentationScope(scope_name, schema_url=schema_url)
    return MetricsExport(
        make_exporter(settings.protocol),
        resource,
        scope,
        producers,
        settings.interval_seconds,
        registry,
    )


# -- points from kept figures ------------------------------------------------------------------


def histogram(
    name: str,
    unit: str,
    description: str,
    bounds: Sequence[float],
    series: Iterable[tuple[Attributes, Sequence[float]]],
    start_ns: int,
    now_ns: int,
) -> Metric:
    """A cumulative histogram; each series is (bucket counts, overflow, sum, min, max)."""
    n = len(bounds) + 1
    points = [_histogram_point(attrs, s, n, bounds, start_ns, now_ns) for attrs, s in series]
    return Metric(name, description, unit, Histogram(points, CUMULATIVE))


def _histogram_point(
    attrs: Attributes,
    s: Sequence[float],
    n: int,
    bounds: Sequence[float],
    start_ns: int,
    now_ns: int,
) -> HistogramDataPoint:
    counts = [int(c) for c in s[:n]]
    return HistogramDataPoint(
        dict(attrs), start_ns, now_ns, sum(counts), s[n], counts, list(bounds), s[n + 1], s[n + 2]
    )


def monotonic_sum(
    name: str,
    unit: str,
    description: str,
    values: Iterable[tuple[Attributes, float]],
    start_ns: int,
    now_ns: int,
) -> Metric:
    """A cumulative, monotonic sum (a counter since ``start_ns``)."""
    return Metric(
        name, description, unit, Sum(_numbers(values, start_ns, now_ns), CUMULATIVE, True)
    )


def up_down_sum(
    name: str,
    unit: str,
    description: str,
    values: Iterable[tuple[Attributes, float]],
    start_ns: int,
    now_ns: int,
) -> Metric:
    """A cumulative sum that may also fall (an amount revised as late figures arrive)."""
    return Metric(
        name, description, unit, Sum(_numbers(values, start_ns, now_ns), CUMULATIVE, False)
    )


def gauge(
    name: str, unit: str, description: str, values: Iterable[tuple[Attributes, float]], now_ns: int
) -> Metric:
    """The last value of each series, read now."""
    return Metric(name, description, unit, Gauge(_numbers(values, now_ns, now_ns)))


def _numbers(values: Iterable[tuple[Attributes, float]], start_ns: int, now_ns: int) -> list[Any]:
    return [NumberDataPoint(dict(attrs), start_ns, now_ns, value) for attrs, value in values]
