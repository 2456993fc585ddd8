"""The efficiency figures of a replica group running several instances, worked by hand.

``large-0`` (chat-large) runs as an autoscaled group of three pods, each on two H100s at 0 W
($3.90 a GPU-hour: $0.13 per instance-minute), in the hour from 01:00:

| instance | GPU time    | engine (running, waiting) | requests (in flight)                         |
|----------|-------------|---------------------------|----------------------------------------------|
| a        | 01:00-02:00 | 10, 1                     | search x2 01:10-01:20; assistant 01:30-01:40 |
| b        | 01:00-02:00 | 20, 0                     | search 01:05-01:35; assistant 01:05-01:15    |
| c        | 01:20-02:00 | 30, 0                     | search 01:20-01:50                           |

So the group grows from two instances to three within the hour: 60 + 60 + 40 = 160
instance-minutes, 19,200 GPU-seconds, $20.80. Busy seconds (at most 60 an instance-minute):
a 600 + 600 = 1,200, b 1,800, c 1,800; 4,800 of 9,600 measured instance-seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from billing.efficiency.figures import fleet_of
from billing.efficiency.replay_sql import group_measured_sql, runs_sql
from billing.efficiency.store import month_slots
from billing.ledger import Ledger
from dashboards.components import frame_table
from dashboards.pages.efficiency import SUMMARY_KINDS, frame_of, group_summary
from tests.billing.conftest import gpu_samples, usage
from tests.billing.test_efficiency import HOUR, NOW, engine, fill, report

MINUTE_USD = 2 * 3.90 / 60  # one instance-minute of two H100s
SERVED = "llama-3.1-70b-instruct-fp8"
# instance -> (first minute of GPU time, running, waiting)
PODS = {"large-0-a": (0, 10.0, 1.0), "large-0-b": (0, 20.0, 0.0), "large-0-c": (20, 30.0, 0.0)}
# (team, instance, from minute, to minute, prompt tokens, completion tokens)
REQUESTS = (
    ("search", "large-0-a", 10, 20, 100, 50),
    ("search", "large-0-a", 10, 20, 100, 50),
    ("assistant", "large-0-a", 30, 40, 1000, 100),
    ("search", "large-0-b", 5, 35, 100, 50),
    ("assistant", "large-0-b", 5, 15, 1000, 100),
    ("search", "large-0-c", 20, 50, 100, 50),
)


def _pod_gpus(pod: str, first_minute: int, node: int) -> list[dict[str, Any]]:
    """Two H100s of ``pod`` from ``first_minute`` to the end of the hour, sampled every minute."""
    out = []
    for gpu in ("0", "1"):
        out += gpu_samples(
            "large-0",
            start=HOUR + 60 * first_minute,
            seconds=3600 - 60 * first_minute,
            every=60,
            gpu_model="H100",
            watts=0.0,
            node=f"node-{node}",
            gpu=gpu,
        )
    return [s | {"instance": pod, "model": "chat-large"} for s in out]


def _group(ledger: Ledger) -> None:
    """The autoscaled group of the module docstring, in the ledger."""
    gpus, samples = [], []
    for node, (pod, (first, running, waiting)) in enumerate(PODS.items()):
        gpus += _pod_gpus(pod, first, node)
        samples += [
            s | {"instance": pod}
            for s in engine("large-0", running, waiting, model="chat-large")[first:]
        ]
    records = [
        usage(
            team,
            HOUR + 60 * lo,
            60.0 * (hi - lo),
            replica="large-0",
            instance=pod,
            model="chat-large",
            served_version=SERVED,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
        for team, pod, lo, hi, prompt, completion in REQUESTS
    ]
    fill(ledger, usage=records, gpu_samples=gpus, engine_samples=samples)


def test_a_teams_requests_tokens_and_cost_are_counted_once(ledger, config):
    """Each team's requests and tokens once, and its in-flight share of its own instances' minutes."""
    _group(ledger)
    rows = {r["team"]: r for r in report(ledger, config).teams.iter_rows(named=True)}
    assert {
        t: (r["requests"], r["prompt_tokens"], r["completion_tokens"]) for t, r in rows.items()
    } == {"search": (4, 400, 200), "assistant": (2, 2000, 200)}
    # search: a 10 minutes whole; b 20 whole and 10 shared half with assistant; c 30 whole.
    assert rows["search"]["cost_usd"] == pytest.approx((10 + 20 + 5 + 30) * MINUTE_USD)
    assert rows["search"]["gpu_hours"] == pytest.approx(65 * 2 / 60)
    # assistant: a 10 minutes whole; b 10 shared half.
    assert rows["assistant"]["cost_usd"] == pytest.approx((10 + 5) * MINUTE_USD)


def test_each_instance_has_its_own_idle_share_cost_and_gpus(ledger, config):
    """An instance's idle share is 1 - its busy seconds / its own measured seconds."""
    _group(ledger)
    rows = {r["instance"]: r for r in report(ledger, config).instances.iter_rows(named=True)}
    assert {pod: r["idle_share"] for pod, r in rows.items()} == pytest.approx(
        {"large-0-a": 1 - 1200 / 3600, "large-0-b": 1 - 1800 / 3600, "large-0-c": 1 - 1800 / 2400}
    )
    assert {pod: r["cost_usd"] for pod, r in rows.items()} == pytest.approx(
        {"large-0-a": 60 * MINUTE_USD, "large-0-b": 60 * MINUTE_USD, "large-0-c": 40 * MINUTE_USD}
    )
    assert {pod: r["gpus_per_engine"] for pod, r in rows.items()} == pytest.approx(
        dict.fromkeys(PODS, 2.0)
    )
    assert {pod: r["requests"] for pod, r in rows.items()} == {
        "large-0-a": 3,
        "large-0-b": 2,
        "large-0-c": 1,
    }


def test_the_groups_hour_sums_its_instances(ledger, config):
    """Idle share 1 - 4,800 / 9,600, $20.80, six requests, 2 GPUs an engine, 160 / 60 engines."""
    _group(ledger)
    [row] = report(ledger, config).groups.iter_rows(named=True)
    assert (row["t"], row["replica"], row["model"]) == (HOUR, "large-0", "chat-large")
    assert row["idle_share"] == pytest.approx(0.5)
    assert row["cost_usd"] == pytest.approx(160 * MINUTE_USD)
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (6, 2400, 400)
    assert row["gpus_per_engine"] == pytest.approx(2.0)
    assert row["engines"] == pytest.approx(160 / 60)
    assert row["instances"] == 3
    assert (row["instance_hours"], row["busy_hours"]) == pytest.approx((160 / 60, 4800 / 3600))
    assert row["tokens_per_gpu_second"] == pytest.approx(2800 / 19_200)


def test_the_groups_engines_are_summed_each_minute(ledger, config):
    """Running and waiting are the instances' sum per minute; occupancy the mean per instance-minute."""
    _group(ledger)
    [row] = report(ledger, config).groups.iter_rows(named=True)
    # 30 running for 20 minutes, 60 for 40; pod a's one waiting request all hour.
    assert row["requests_running"] == pytest.approx((20 * 30 + 40 * 60) / 60)
    assert row["requests_waiting"] == pytest.approx(1.0)
    # Little's law: one request waiting all hour, six requests served: 600 s each.
    assert row["queue_wait_seconds"] == pytest.approx(3600 / 6)
    occupancy = (60 * 10 + 60 * 20 + 40 * 30) / 160 / 64
    assert row["batch_occupancy"] == pytest.approx(occupancy)


def test_busy_time_outside_measured_minutes_keeps_idle_share_in_range(ledger, config):
    """Requests on a pod whose GPUs were never seen add no busy time: idle share stays in [0, 1]."""
    _group(ledger)
    late = usage(
        "search",
        HOUR + 600,
        2400.0,
        replica="large-0",
        instance="large-0-d",
        model="chat-large",
        served_version=SERVED,
    )
    fill(ledger, usage=[late])
    found = report(ledger, config)
    [row] = found.groups.iter_rows(named=True)
    assert row["idle_share"] == pytest.approx(0.5)
    assert row["requests"] == 7
    pods = {r["instance"]: r for r in found.instances.iter_rows(named=True)}
    assert pods["large-0-d"]["requests"] == 1
    assert pods["large-0-d"]["idle_share"] is None  # nothing measured to be idle in


def test_the_replay_runs_each_pod_over_its_own_minutes(ledger, config):
    """Pods without lifetimes run in the replay over the minutes they had GPU time, with their GPUs:
    a and b the hour, c from 01:20, 2 GPUs each, 19,200 GPU-seconds as measured."""
    _group(ledger)
    lo, hi = month_slots("2026-10", NOW)
    with ledger.reader() as cursor:
        sql, params = runs_sql(lo, hi, 30.0)
        runs = cursor.sql(sql, params=params).fetchall()
        sql, params = group_measured_sql(lo, hi, fleet_of(config))
        measured = cursor.sql(sql, params=params).pl()
    assert [(pod, start - HOUR, end - HOUR, gpus) for _, pod, start, end, gpus, _ in runs] == [
        ("large-0-a", 0, 3600, 2.0),
        ("large-0-b", 0, 3600, 2.0),
        ("large-0-c", 1200, 3600, 2.0),
    ]
    [row] = measured.iter_rows(named=True)
    assert (row["replica"], row["gpu_seconds"]) == ("large-0", pytest.approx(19_200))
    assert row["gpu_usd"] == pytest.approx(160 * MINUTE_USD)


def test_the_page_summarises_the_group_from_instance_seconds(ledger, config):
    """The Efficiency page's month of the group: idle share from busy over measured instance-hours."""
    _group(ledger)
    # A second hour with only pod a, idle throughout: 60 more measured minutes, none busy.
    fill(
        ledger,
        gpu_samples=[
            s | {"timestamp": s["timestamp"] + 3600} for s in _pod_gpus("large-0-a", 0, 0)
        ],
    )
    groups = frame_of(report(ledger, config).to_json()["figures"]["groups"])  # as billing sends it
    [row] = group_summary(groups).iter_rows(named=True)
    assert row["idle_share"] == pytest.approx(1 - 4800 / (9600 + 3600))
    assert row["engines"] == pytest.approx((160 + 60) / 120)
    assert row["cost_usd"] == pytest.approx(220 * MINUTE_USD, abs=0.005)


def _cells(component: Any) -> Iterator[tuple[str, Any]]:
    """(column, text) of every table cell under ``component``."""
    if type(component).__name__ == "Td":
        yield getattr(component, "data-column"), component.children
    children = getattr(component, "children", None)
    for child in children if isinstance(children, list) else [children]:
        if child is not None and not isinstance(child, str):
            yield from _cells(child)


def test_the_page_shows_the_groups_shares_in_percent(ledger, config):
    """The month's table reads occupancy and idle share in percent, engines as a mean count."""
    _group(ledger)
    groups = frame_of(report(ledger, config).to_json()["figures"]["groups"])
    table = frame_table(group_summary(groups), "efficiency-summary-table", kinds=SUMMARY_KINDS)
    cells = dict(_cells(table))
    assert (cells["idle_share"], cells["batch_occupancy"]) == ("50.0 %", "29.3 %")
    assert cells["engines"] == "2.667"
