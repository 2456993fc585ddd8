"""The export loop: sends never overlap, even when one is cut off by a stop, and a stop sends the
last figures."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from infermeter.otlp_export import MetricsExport, monotonic_sum


class SlowExporter(MetricExporter):
    """An exporter (the SDK's interface) that takes 0.3 s per export and notes any overlap."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self.most_at_once = 0
        self.values: list[float] = []
        self.lock = threading.Lock()

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(0.3)
        metric = metrics_data.resource_metrics[0].scope_metrics[0].metrics[0]
        point = metric.data.data_points[0]
        assert isinstance(point, NumberDataPoint)
        self.values.append(point.value)
        with self.lock:
            self.running -= 1
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


async def test_a_stop_during_a_send_waits_for_it_then_sends_the_last_figures():
    """The loop is cancelled mid-send: the closing export waits for that send, never overlaps
    it, and carries the count as it is at the stop."""
    count = [1.0]

    async def produce(start_ns: int, now_ns: int) -> list[Any]:
        return [
            monotonic_sum("requests", "{request}", "Requests.", [({}, count[0])], start_ns, now_ns)
        ]

    exporter = SlowExporter()
    export = MetricsExport(
        exporter, Resource.create({}), InstrumentationScope("test"), [produce], 0.01
    )
    task = asyncio.create_task(export.run())
    while exporter.running == 0:
        await asyncio.sleep(0.005)
    task.cancel()
    count[0] = 2.0
    await export.close()
    assert exporter.most_at_once == 1
    assert exporter.values == [1.0, 2.0]
