"""The sidecar's Prometheus metrics, with fixed names so alert rules can rely on them.

Histograms are kept in plain lists and exposed by a custom collector instead of
``prometheus_client.Histogram``: the per-token path then costs one ``bisect`` and one list
increment, and a block of tokens that arrived together is added in one call.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["FastHistogram", "SidecarMetrics"]

_M = TypeVar("_M", Counter, Gauge)

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
DURATION_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
TPS_BUCKETS = (1, 2, 5, 10, 15, 20, 25, 30, 40, 50, 75, 100, 150, 200, 300, 500, 1000)


class FastHistogram(Collector):
    """A labelled histogram with cheap, batched observations."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, labels: tuple[str, ...], value: float, count: int = 1) -> None:
        """Add ``count`` observations of ``value``."""
        series = self._series.get(labels)
        if series is None:
            # bucket counts (non-cumulative), then +Inf, then sum
            series = self._series[labels] = [0.0] * (len(self.bounds) + 2)
        series[bisect_left(self.bounds, value)] += count
        series[-1] += value * count

    def merge(self, labels: tuple[str, ...], series: Sequence[float]) -> None:
        """Add a histogram kept in this one's layout (bucket counts, +Inf, sum), e.g. a stream's."""
        mine = self._series.get(labels)
        if mine is None:
            mine = self._series[labels] = [0.0] * (len(self.bounds) + 2)
        for i, value in enumerate(series):
            mine[i] += value

    def collect(self) -> Iterator[Metric]:
        """Build the family at scrape time, cumulative as the exposition wants."""
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, series in self._series.items():
            running, buckets = 0.0, []
            for bound, n in zip((*self.bounds, float("inf")), series[:-1], strict=True):
                running += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            family.add_metric(list(labels), buckets, series[-1])
        yield family

    def count(self, labels: tuple[str, ...]) -> float:
        """Observations so far for ``labels`` (for tests and health checks)."""
        series = self._series.get(labels)
        return sum(series[:-1]) if series else 0.0


class SidecarMetrics:
    """Every metric one sidecar exports, registered in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ("team", "model")
        self.ttft = FastHistogram(
            "infermeter_time_to_first_token_seconds",
            "Time from request received to the first chunk carrying generated content.",
            labels,
            TTFT_BUCKETS,
        )
        self.itl = FastHistogram(
            "infermeter_inter_token_latency_seconds",
            "Time between generated tokens as the sidecar relays them.",
            labels,
            ITL_BUCKETS,
        )
        self.duration = FastHistogram(
            "infermeter_request_duration_seconds",
            "Time from request received to the end of the response.",
            labels,
            DURATION_BUCKETS,
        )
        self.tps = FastHistogram(
            "infermeter_output_tokens_per_second",
            "Decode speed of a request: completion tokens after the first, over the time since the first.",
            labels,
            TPS_BUCKETS,
        )
        for h in (self.ttft, self.itl, self.duration, self.tps):
            self.registry.register(h)
        r = self.registry
        self.prompt_tokens = Counter(
            "infermeter_prompt_tokens", "Prompt tokens, as vLLM counted them.", labels, registry=r
        )
        self.cached_prompt_tokens = Counter(
            "infermeter_cached_prompt_tokens",
            "Prompt tokens served from vLLM's prefix cache.",
            labels,
            registry=r,
        )
        self.completion_tokens = Counter(
            "infermeter_completion_tokens",
            "Completion tokens, as vLLM counted them.",
            labels,
            registry=r,
        )
        self.requests = Counter(
            "infermeter_requests", "Requests by how they ended.", (*labels, "status"), registry=r
        )
        self.rate_limited = Counter(
            "infermeter_rate_limited",
            "Requests refused by a team limit.",
            ("team", "reason"),
            registry=r,
        )
        self.inexact = Counter(
            "infermeter_usage_inexact",
            "Requests whose token counts could not be read exactly from vLLM (aborted before any usage).",
            labels,
            registry=r,
        )
        self.in_flight = Gauge(
            "infermeter_requests_in_flight", "Requests being served now.", labels, registry=r
        )
        self.fair_waiting = Gauge(
            "infermeter_fair_queue_waiting",
            "Requests waiting for a batch slot of this replica.",
            ("team",),
            registry=r,
        )
        self.spool_backlog = Gauge(
            "infermeter_usage_spool_backlog",
            "Usage records written to the spool and not yet acknowledged by billing.",
            registry=r,
        )
        self.spool_errors = Counter(
            "infermeter_usage_spool_errors", "Failures to make a usage record durable.", registry=r
        )
        self._children: dict[tuple[int, tuple[str, ...]], Counter | Gauge] = {}

    def child(self, metric: _M, *labels: str) -> _M:
        """``metric.labels(*labels)``, looked up once and then kept.

        ``labels()`` validates and locks on every call: five of them per request cost more
        than the counters themselves. A child is still made on first use, so a series appears
        in the exposition only once something was counted in it. Labels only ever take
        configured names (``bounds``), so this holds a bounded number of entries.
        """
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return cast(_M, found)
