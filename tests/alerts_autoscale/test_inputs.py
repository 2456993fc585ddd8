"""Policy inputs from the collector's and sidecars' /metrics, and from Prometheus's query API."""

from __future__ import annotations

import math
from dataclasses import replace

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from alerts.autoscale.inputs import (
    PROMQL,
    PrometheusSource,
    histogram_quantile,
    observations,
    observations_from_vectors,
    parse_pages,
    read_page,
    scrape_of,
)
from alerts.autoscale.policy import ModelState, evaluate, model_limits, params_from_config
from collectors.loop import FleetCollector
from collectors.metrics import FleetMetrics
from collectors.sources import EngineReading
from infermeter.config import Config
from sidecar.metrics import SidecarMetrics
from tests.collectors.fakes import FakeInstance
from tests.servers import serving

COLLECTOR_PAGE = """\
# HELP infermeter_replica_gpu_utilization_ratio Mean utilization of the replica's GPUs, 0 to 1.
# TYPE infermeter_replica_gpu_utilization_ratio gauge
infermeter_replica_gpu_utilization_ratio{model="chat-small",replica="small-0"} 0.2
infermeter_replica_gpu_utilization_ratio{model="chat-small",replica="small-1"} 0.4
infermeter_replica_gpu_utilization_ratio{model="chat-large",replica="large-0"} 0.9
# HELP infermeter_replica_gpus GPUs (or MIG slices) attributed to the replica.
# TYPE infermeter_replica_gpus gauge
infermeter_replica_gpus{model="chat-small",replica="small-0"} 1.0
infermeter_replica_gpus{model="chat-small",replica="small-1"} 1.0
infermeter_replica_gpus{model="chat-large",replica="large-0"} 2.0
# HELP infermeter_replica_queue_depth Requests waiting in the engine's queue.
# TYPE infermeter_replica_queue_depth gauge
infermeter_replica_queue_depth{model="chat-small",replica="small-0"} 5.0
infermeter_replica_queue_depth{model="chat-small",replica="small-1"} 7.0
infermeter_replica_queue_depth{model="chat-large",replica="large-0"} 0.0
# HELP infermeter_instance_queue_depth Requests waiting in one engine instance's queue.
# TYPE infermeter_instance_queue_depth gauge
infermeter_instance_queue_depth{instance_id="small-0",model="chat-small",replica="small-0"} 5.0
infermeter_instance_queue_depth{instance_id="small-1",model="chat-small",replica="small-1"} 7.0
infermeter_instance_queue_depth{instance_id="large-0",model="chat-large",replica="large-0"} 0.0
"""
MODELS = ("chat-small", "chat-large", "idle-model")


def _page(metrics: SidecarMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_gauges_are_summed_averaged_and_counted_per_model():
    """Queue depth is summed, utilization averaged, replicas counted, per model."""
    obs = observations(None, parse_pages(100.0, COLLECTOR_PAGE, []), MODELS)
    small = obs["chat-small"]
    assert (small.current_replicas, small.queue_depth) == (2, 12.0)
    assert small.gpu_utilization == pytest.approx(0.3)
    assert (small.ttft_p95_seconds, small.tokens_per_second_per_gpu) == (None, None)
    assert obs["idle-model"].current_replicas == 0
    assert obs["idle-model"].gpu_utilization is None


async def test_every_instance_of_a_group_counts_as_a_replica_serving(config: Config) -> None:
    """Three pods of small-0, as the collector itself shows them: three replicas serving."""
    pods = [FakeInstance(f"vllm-small-0-{n}") for n in "abc"]
    collector = FleetCollector(config, [], pods)
    await collector.scrape_once()
    registry = CollectorRegistry()
    registry.register(FleetMetrics(collector))
    page = generate_latest(registry).decode()
    small = observations(None, parse_pages(100.0, page, []), MODELS)["chat-small"]
    assert (small.current_replicas, small.queue_depth) == (3, 15.0)


def _two_instances(queue: str, util: str) -> str:
    """A group of two engines: one waiting 50, the other reporting ``queue`` and ``util``."""
    return (
        'infermeter_instance_queue_depth{instance_id="a",model="chat-small",replica="small-0"} 50\n'
        f'infermeter_instance_queue_depth{{instance_id="b",model="chat-small",replica="small-1"}} {queue}\n'
        'infermeter_replica_gpu_utilization_ratio{model="chat-small",replica="small-0"} 0.4\n'
        f'infermeter_replica_gpu_utilization_ratio{{model="chat-small",replica="small-1"}} {util}\n'
    )


@pytest.mark.parametrize("bad", ["NaN", "-1e9", "+Inf", "-Inf", "-1"])
def test_a_reading_no_count_can_be_is_that_instances_signal_missing(bad):
    """NaN, infinite or negative queue and utilization are not measured; the instance counts."""
    small = observations(None, parse_pages(100.0, _two_instances(bad, bad), []), MODELS)
    assert (small["chat-small"].current_replicas, small["chat-small"].queue_depth) == (2, 50.0)
    assert small["chat-small"].gpu_utilization == pytest.approx(0.4)


@pytest.mark.parametrize("absurd", ["1e300", "1.7976931348623157e308", "1e15", "1000001"])
def test_a_queue_no_engine_could_hold_is_that_instances_signal_missing(absurd):
    """A finite queue past what one engine holds (1e300 from a broken or hostile page) is not
    measured, as NaN is: it cannot hold the sustained-queue rule on; the instance counts."""
    small = observations(None, parse_pages(100.0, _two_instances(absurd, "0.4"), []), MODELS)
    assert (small["chat-small"].current_replicas, small["chat-small"].queue_depth) == (2, 50.0)
    most = observations(None, parse_pages(100.0, _two_instances("1000000", "0.4"), []), MODELS)
    assert most["chat-small"].queue_depth == 1_000_050.0


async def test_a_queue_no_engine_could_hold_does_not_scale_the_group(config: Config) -> None:
    """Through the collector's own page and ten minutes of ticks: one of three engines saying
    1e15 requests wait (its page passes the collector: under 2**53) asks for no replica."""
    pods = [FakeInstance(f"vllm-small-0-{n}") for n in "abc"]
    hostile = pods[2]

    async def absurd() -> EngineReading:
        return replace(await FakeInstance.read(hostile), requests_waiting=1e15)

    hostile.read = absurd  # type: ignore[method-assign]
    collector = FleetCollector(config, [], pods)
    registry = CollectorRegistry()
    registry.register(FleetMetrics(collector))
    params = params_from_config(config)
    limits = {"chat-small": model_limits(config, "chat-small")}
    states: dict[str, ModelState] = {}
    desired = set()
    for tick in range(41):
        await collector.scrape_once()
        page = generate_latest(registry).decode()
        obs = observations(None, parse_pages(tick * 15.0, page, []), ["chat-small"])
        decisions, states = evaluate(params, limits, states, obs)
        desired.add(decisions["chat-small"].desired)
    assert obs["chat-small"].queue_depth == 10.0  # the other two engines' 5 each
    assert desired == {3}


def test_a_utilization_above_one_counts_as_one():
    """A ratio is at most 1: a 700% engine raises the mean as a full one would, no more."""
    small = observations(None, parse_pages(100.0, _two_instances("0", "7"), []), MODELS)
    assert small["chat-small"].gpu_utilization == pytest.approx((0.4 + 1.0) / 2)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -3.0])
def test_prometheus_answers_no_count_can_be_are_unknown(bad):
    """From Prometheus too: such an answer is not measured, and a utilization above 1 is 1."""
    vectors = {key: {"chat-large": bad} for key in PROMQL}
    obs = observations_from_vectors(50.0, vectors, ["chat-large"])["chat-large"]
    assert (obs.current_replicas, obs.queue_depth, obs.gpu_utilization) == (0, 0.0, None)
    assert (obs.ttft_p95_seconds, obs.tokens_per_second_per_gpu) == (None, None)
    over = observations_from_vectors(50.0, {"utilization": {"chat-large": 3.0}}, ["chat-large"])
    assert over["chat-large"].gpu_utilization == 1.0


def test_prometheus_queues_and_counts_no_group_could_have_are_unknown():
    """A summed queue past what the group's engines together hold is unknown, and so is a
    count of engines past any fleet; a queue within the group's bound is taken."""
    obs = observations_from_vectors(
        50.0,
        {"current": {"a": 2.0, "b": 2.0, "c": 1e300}, "queue": {"a": 1e300, "b": 1.5e6, "c": 5}},
        ["a", "b", "c"],
    )
    assert [(o.current_replicas, o.queue_depth) for o in obs.values()] == [
        (2, 0.0),
        (2, 1.5e6),
        (0, 5.0),
    ]


def test_a_sidecar_counter_no_count_can_be_is_not_counted():
    """A NaN or negative token counter or TTFT bucket adds nothing to the interval's rates."""
    metrics = SidecarMetrics()
    labels = ("search", "chat-small")
    before = parse_pages(100.0, COLLECTOR_PAGE, [_page(metrics)])
    metrics.completion_tokens.labels(*labels).inc(1000)
    metrics.ttft.observe(labels, 0.3, count=10)
    bad = _page(metrics).replace(" 1000.0", " NaN") + (
        'infermeter_completion_tokens_total{model="chat-small",team="x"} -1e12\n'
    )
    after = parse_pages(110.0, COLLECTOR_PAGE, [bad])
    small = observations(before, after, MODELS)["chat-small"]
    assert small.tokens_per_second_per_gpu is None
    assert small.ttft_p95_seconds is not None


def test_rates_and_ttft_p95_come_from_the_last_interval():
    """Tokens/s per GPU and TTFT p95 use the sidecars' counter increase since the last scrape."""
    a, b = SidecarMetrics(), SidecarMetrics()
    labels = ("search", "chat-small")
    a.ttft.observe(labels, 9.0, count=100)  # old history, before the interval
    before = parse_pages(100.0, COLLECTOR_PAGE, [_page(a), _page(b)])
    a.completion_tokens.labels(*labels).inc(3000)
    b.completion_tokens.labels(*labels).inc(1000)
    a.ttft.observe(labels, 0.3, count=90)
    b.ttft.observe(labels, 0.9, count=10)
    after = parse_pages(110.0, COLLECTOR_PAGE, [_page(a), _page(b)])
    small = observations(before, after, MODELS)["chat-small"]
    assert small.tokens_per_second_per_gpu == pytest.approx(4000 / 10 / 2)
    # 95th of 100 in the interval: the 5th of the 10 in the (0.75, 1.0] bucket.
    assert small.ttft_p95_seconds == pytest.approx(0.75 + 0.25 * 5 / 10)


def test_counters_are_compared_with_the_same_sidecars_when_the_list_changes():
    """A sidecar gone from the front of the list does not lend its counters to the next one."""
    gone, stays = SidecarMetrics(), SidecarMetrics()
    labels = ("search", "chat-small")
    gone.completion_tokens.labels(*labels).inc(90_000)
    stays.completion_tokens.labels(*labels).inc(1_000)
    pages = ["http://gone/metrics", "http://stays/metrics"]
    collector = read_page(COLLECTOR_PAGE)
    before = scrape_of(0.0, collector, [read_page(_page(gone)), read_page(_page(stays))], pages)
    stays.completion_tokens.labels(*labels).inc(200)
    after = scrape_of(10.0, collector, [read_page(_page(stays))], pages[1:])
    small = observations(before, after, MODELS)["chat-small"]
    assert small.tokens_per_second_per_gpu == pytest.approx(200 / 10 / 2)


def test_a_restarted_sidecar_counts_from_zero():
    """Counters lower than last time mean a restart: their whole value is the increase."""
    old, new = SidecarMetrics(), SidecarMetrics()
    labels = ("search", "chat-small")
    old.completion_tokens.labels(*labels).inc(50_000)
    old.ttft.observe(labels, 5.0, count=500)
    new.completion_tokens.labels(*labels).inc(200)
    new.ttft.observe(labels, 0.05, count=20)
    before = parse_pages(0.0, COLLECTOR_PAGE, [_page(old)])
    after = parse_pages(10.0, COLLECTOR_PAGE, [_page(new)])
    small = observations(before, after, MODELS)["chat-small"]
    assert small.tokens_per_second_per_gpu == pytest.approx(200 / 10 / 2)
    assert small.ttft_p95_seconds is not None
    assert small.ttft_p95_seconds <= 0.06


@pytest.mark.parametrize(
    ("buckets", "expected"),
    [
        ({0.1: 0, 0.5: 100, math.inf: 100}, 0.1 + 0.4 * 0.95),
        ({0.1: 50, 0.5: 100, math.inf: 100}, 0.1 + 0.4 * 0.9),
        ({0.1: 0, 0.5: 0, math.inf: 10}, 0.5),  # beyond the last finite bound
        ({0.1: 0, math.inf: 0}, None),  # nothing observed
        ({}, None),
    ],
)
def test_histogram_quantile_matches_prometheus(buckets, expected):
    """Linear interpolation within the bucket, the highest finite bound beyond it."""
    got = histogram_quantile(0.95, buckets)
    assert got == (pytest.approx(expected) if expected is not None else None)


async def test_prometheus_source_runs_every_query_and_reads_vectors():
    """Each input is one instant query; the answers become one observation per model."""
    answers = {
        "current": 3,
        "queue": 14,
        "utilization": 0.5,
        "ttft_p95": "NaN",
        "tokens_per_gpu": 800,
    }
    by_query = {template.format(window="2m"): key for key, template in PROMQL.items()}
    seen: list[str] = []

    async def query(request: Request) -> JSONResponse:
        promql = request.query_params["query"]
        seen.append(promql)
        value = answers[by_query[promql]]
        result = [{"metric": {"model": "chat-large"}, "value": [1.7e9, str(value)]}]
        return JSONResponse(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    app = Starlette(routes=[Route("/api/v1/query", query)])
    async with serving(app) as url, httpx.AsyncClient() as client:
        vectors = await PrometheusSource(url, client).vectors()
    assert sorted(seen) == sorted(by_query)
    obs = observations_from_vectors(50.0, vectors, ["chat-large"])["chat-large"]
    assert (obs.current_replicas, obs.queue_depth, obs.gpu_utilization) == (3, 14.0, 0.5)
    assert (obs.ttft_p95_seconds, obs.tokens_per_second_per_gpu) == (None, 800.0)


async def test_configured_queries_replace_the_defaults():
    """A query named in ``prometheus_queries`` is sent instead of the built-in one."""
    seen: list[str] = []

    async def query(request: Request) -> JSONResponse:
        seen.append(request.query_params["query"])
        return JSONResponse({"status": "success", "data": {"resultType": "vector", "result": []}})

    app = Starlette(routes=[Route("/api/v1/query", query)])
    custom = 'count by (model) (label_replace(vllm:num_requests_waiting, "model", "$1", "service", "vllm-(.+)"))'
    async with serving(app) as url, httpx.AsyncClient() as client:
        await PrometheusSource(url, client, overrides={"current": custom}).vectors()
    assert seen[0] == custom
    assert len(seen) == len(PROMQL)
