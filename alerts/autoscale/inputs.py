"""The policy's inputs, from /metrics pages (collector and sidecars) or from Prometheus.

Parsing and arithmetic are pure: ``read_page`` turns one page's exposition text into samples
(``PageError`` when it is not that format), ``scrape_of`` turns the pages' samples into a
``Scrape`` (gauges plus cumulative counters), and ``observations`` turns two consecutive scrapes into one
``Observation`` per model: rates and the TTFT p95 come from the counters' increase between the
two, so they describe the last interval, not the process lifetime. ``PrometheusSource`` asks a
Prometheus server the same questions in PromQL instead. Fetching lives in ``service``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from alerts.autoscale.policy import Observation
from infermeter.records import MAX_ENGINE_REQUESTS, MAX_SCALED_REPLICAS

__all__ = [
    "PROMQL",
    "PageError",
    "PrometheusSource",
    "Sample",
    "Scrape",
    "histogram_quantile",
    "measured",
    "observations",
    "observations_from_vectors",
    "parse_pages",
    "queue_depth",
    "read_page",
    "scrape_of",
]

TTFT_BUCKET = "infermeter_time_to_first_token_seconds_bucket"
# A sidecar counter; prometheus_client's parser reports it with the ``_total`` suffix.
COMPLETION_TOKENS = "infermeter_completion_tokens_total"

# One instant query per input, each answering one value per ``model``.
PROMQL = {
    "current": "count by (model) (infermeter_instance_queue_depth)",
    "queue": "sum by (model) (infermeter_instance_queue_depth)",
    "utilization": "avg by (model) (infermeter_replica_gpu_utilization_ratio)",
    "ttft_p95": (
        "histogram_quantile(0.95, sum by (model, le) "
        "(rate(infermeter_time_to_first_token_seconds_bucket[{window}])))"
    ),
    "tokens_per_gpu": (
        "sum by (model) (rate(infermeter_completion_tokens_total[{window}])) "
        "/ sum by (model) (infermeter_replica_gpus)"
    ),
}

Key = tuple[str, str]  # (sidecar page, model): counters are per process


@dataclass(frozen=True)
class Scrape:
    """What one round of scrapes saw, per model; counters are cumulative."""

    time: float
    replicas: Mapping[str, int] = field(default_factory=dict)
    queue: Mapping[str, float] = field(default_factory=dict)
    utilization: Mapping[str, float] = field(default_factory=dict)
    gpus: Mapping[str, float] = field(default_factory=dict)
    completion_tokens: Mapping[Key, float] = field(default_factory=dict)
    ttft_buckets: Mapping[Key, Mapping[float, float]] = field(default_factory=dict)


Sample = tuple[str, dict[str, str], float]


class PageError(ValueError):
    """A page that is not the Prometheus text format the autoscaler reads; the message says why."""


def read_page(text: str) -> list[Sample]:
    """Every sample of one page, or ``PageError`` for the whole page.

    A page is read whole or not at all: an HTML error page answered with 200 by a proxy, or a
    TTFT bucket whose bound is not a number, says nothing trustworthy about the rest of it.
    """
    try:
        samples = [
            (sample.name, sample.labels, float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    except ValueError as exc:  # the parser's one error, for any line it cannot read
        raise PageError(f"not the Prometheus text format: {str(exc)[:120]}") from None
    for name, labels, _ in samples:
        if name == TTFT_BUCKET:
            _bound(labels)
    return samples


def _bound(labels: Mapping[str, str]) -> float:
    """A histogram bucket's ``le``; ``PageError`` when it is absent or not a number."""
    try:
        return float(labels["le"])
    except (KeyError, ValueError):
        raise PageError(f"a {TTFT_BUCKET} sample with le={labels.get('le')!r}") from None


def parse_pages(time: float, collector_page: str, sidecar_pages: Sequence[str | None]) -> Scrape:
    """Read the collector's fleet view and each sidecar's counters (``None``: page missing).

    A sidecar page that cannot be read counts as missing; a collector page that cannot be read
    raises ``PageError``, since without it there is nothing to decide on.
    """
    return scrape_of(time, read_page(collector_page), [_readable(p) for p in sidecar_pages])


def _readable(page: str | None) -> list[Sample] | None:
    if page is None:
        return None
    try:
        return read_page(page)
    except PageError:
        return None


def scrape_of(
    time: float,
    collector: Iterable[Sample],
    sidecars: Sequence[Iterable[Sample] | None],
    pages: Sequence[str] | None = None,
) -> Scrape:
    """The collector's fleet view and each sidecar's counters, from pages already read.

    ``pages`` names each sidecar page (its URL), so a counter is compared with the same
    sidecar's at the next scrape however the list changes; without it, the page's position.
    """
    replicas: dict[str, set[str]] = defaultdict(set)
    queue: dict[str, float] = defaultdict(float)
    utils: dict[str, list[float]] = defaultdict(list)
    gpus: dict[str, float] = defaultdict(float)
    for name, labels, reading in collector:
        model = labels.get("model", "")
        value = measured(reading)
        if not model:
            continue
        if name == "infermeter_instance_queue_depth":
            # Engines are counted one by one: a replica group of N pods is N replicas serving.
            replicas[model].add(labels.get("instance_id", ""))
            waiting = queue_depth(reading)
            if waiting is not None:
                queue[model] += waiting
        elif name == "infermeter_replica_gpu_utilization_ratio" and value is not None:
            utils[model].append(min(value, 1.0))
        elif name == "infermeter_replica_gpus" and value is not None:
            gpus[model] += value
    tokens: dict[Key, float] = defaultdict(float)
    buckets: dict[Key, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for index, page in enumerate(sidecars):
        for name, labels, reading in page or ():
            page_name = pages[index] if pages is not None else str(index)
            key, value = (page_name, labels.get("model", "")), measured(reading)
            if value is None:
                continue
            if name == COMPLETION_TOKENS:
                tokens[key] += value
            elif name == TTFT_BUCKET and not math.isnan(bound := _bound(labels)):
                buckets[key][bound] += value
    return Scrape(
        time=time,
        replicas={m: len(r) for m, r in replicas.items()},
        queue=dict(queue),
        utilization={m: sum(u) / len(u) for m, u in utils.items()},
        gpus=dict(gpus),
        completion_tokens=dict(tokens),
        ttft_buckets={k: dict(v) for k, v in buckets.items()},
    )


def measured(value: float) -> float | None:
    """``value`` as a count or a ratio, or None (not measured) when it cannot be one.

    A queue, a GPU count, a utilization or a counter is never negative, NaN or infinite: one
    engine reporting NaN or -1e9 waiting requests would hide its group's queue, and +Inf would
    force a scale-up, so such a reading counts as that instance's signal missing.
    """
    return value if math.isfinite(value) and value >= 0 else None


def queue_depth(value: float, engines: int = 1) -> float | None:
    """``value`` as the requests waiting on ``engines`` engines, or None (not measured) when it
    cannot be a count or is more than they could hold.

    A finite queue no engine holds (1e300 from a broken or hostile page) passed ``measured``:
    it held the sustained-queue rule on, which added a replica at each cool-down's end up to the
    cap. Past ``MAX_ENGINE_REQUESTS`` per engine (the bound billing's ingest holds an engine
    sample's gauges to) it is that instance's signal missing, as NaN is.
    """
    waiting = measured(value)
    if waiting is None or waiting > MAX_ENGINE_REQUESTS * max(1, engines):
        return None
    return waiting


def _increase(before: float | None, after: float) -> float:
    """A counter's increase; a decrease means the process restarted and counted from zero."""
    if before is None or after < before:
        return after
    return after - before


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus's ``histogram_quantile`` over cumulative ``{le: count}``: linear in a bucket."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # Prometheus answers the highest finite bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def observations(
    previous: Scrape | None, current: Scrape, models: Iterable[str]
) -> dict[str, Observation]:
    """One observation per model; rates and TTFT need ``previous`` and are None without it."""
    elapsed = current.time - previous.time if previous is not None else 0.0
    result = {}
    for model in models:
        tokens_per_gpu = ttft = None
        if previous is not None and elapsed > 0:
            keys = [k for k in current.completion_tokens if k[1] == model]
            made = sum(
                _increase(previous.completion_tokens.get(k), current.completion_tokens[k])
                for k in keys
            )
            if keys and current.gpus.get(model):
                tokens_per_gpu = made / elapsed / current.gpus[model]
            ttft = histogram_quantile(0.95, _bucket_increase(previous, current, model))
        result[model] = Observation(
            time=current.time,
            current_replicas=current.replicas.get(model, 0),
            queue_depth=current.queue.get(model, 0.0),
            ttft_p95_seconds=ttft,
            gpu_utilization=current.utilization.get(model),
            tokens_per_second_per_gpu=tokens_per_gpu,
        )
    return result


def _bucket_increase(previous: Scrape, current: Scrape, model: str) -> dict[float, float]:
    total: dict[float, float] = defaultdict(float)
    for key, buckets in current.ttft_buckets.items():
        if key[1] != model:
            continue
        before = previous.ttft_buckets.get(key, {})
        # A restart resets the whole histogram: judge it by the +Inf bucket, then take all.
        restarted = buckets.get(math.inf, 0.0) < before.get(math.inf, 0.0)
        for bound, count in buckets.items():
            total[bound] += _increase(None if restarted else before.get(bound), count)
    return dict(total)


def observations_from_vectors(
    time: float, vectors: Mapping[str, Mapping[str, float]], models: Iterable[str]
) -> dict[str, Observation]:
    """Observations from PromQL answers keyed like ``PROMQL``; absent, NaN, infinite or
    negative means unknown, and a utilization above 1 counts as 1. So does a count of engines
    past ``MAX_SCALED_REPLICAS``, or a queue past what they could hold (``queue_depth``): the
    queue is a sum over the group, so its bound is the engines' together."""

    def value(query: str, model: str) -> float | None:
        v = vectors.get(query, {}).get(model)
        v = None if v is None else measured(v)
        return min(v, 1.0) if v is not None and query == "utilization" else v

    def observation(model: str) -> Observation:
        engines = value("current", model)
        current = int(engines) if engines is not None and engines <= MAX_SCALED_REPLICAS else 0
        queue = vectors.get("queue", {}).get(model)
        return Observation(
            time=time,
            current_replicas=current,
            queue_depth=(None if queue is None else queue_depth(queue, current)) or 0.0,
            ttft_p95_seconds=value("ttft_p95", model),
            gpu_utilization=value("utilization", model),
            tokens_per_second_per_gpu=value("tokens_per_gpu", model),
        )

    return {model: observation(model) for model in models}


@dataclass
class PrometheusSource:
    """Runs ``PROMQL`` (or the configured replacements) against Prometheus's instant-query API."""

    url: str
    client: httpx.AsyncClient
    window: str = "2m"
    overrides: Mapping[str, str] = field(default_factory=dict)

    async def vectors(self) -> dict[str, dict[str, float]]:
        """Every query's answer as ``{model: value}``; raises ``httpx.HTTPError`` on failure."""
        result = {}
        for key, template in PROMQL.items():
            promql = self.overrides.get(key) or template.format(window=self.window)
            result[key] = await self.query(promql)
        return result

    async def query(self, promql: str) -> dict[str, float]:
        """One instant vector, keyed by its ``model`` label."""
        response = await self.client.get(
            self.url.rstrip("/") + "/api/v1/query", params={"query": promql}
        )
        response.raise_for_status()
        data = response.json()
        if data.get("status") != "success":
            raise httpx.HTTPError(f"Prometheus refused {promql!r}: {data.get('error')}")
        return {
            item["metric"].get("model", ""): float(item["value"][1])
            for item in data["data"]["result"]
        }
