"""Instances: lifetimes from their events, allocation per instance-minute, the registry route."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import duckdb
import httpx
import polars as pl
import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing import allocation_runs, registry
from billing.allocation import UNALLOCATED, Policy
from billing.api import create_app
from billing.frames import allocate
from billing.ledger import Ledger
from billing.rounding import cents
from billing.schema import MIGRATIONS
from billing.statement import cents_lines
from infermeter.config import Config
from tests.billing.conftest import OCT, batch, bearer, gpu_samples, instance_event, usage
from tests.billing.test_allocation import EXAMPLE_GPUS, EXAMPLE_USAGE
from tests.servers import serving

ADMIN, INGEST, METRICS = "im-demo-admin", "im-demo-ingest", "im-demo-metrics"
SEARCH = "im-demo-search"
# One replica group "g" (one GPU per instance, $6.00 per GPU-hour, no energy price): every
# GPU-minute costs $0.10. Its three instances' lifetimes overlap:
#   g-a  start T0, heartbeats, stop at T0+170      minutes 0, 1, 2
#   g-b  start T0+60, heartbeats, stop at T0+230   minutes 1, 2, 3
#   g-c  heartbeats only, T0+90..T0+150 (lost)     minutes 1, 2 (it ends at T0+180, the heartbeat
#                                                  that never came); its GPU is seen in minute 3 too
T0 = OCT + 3600
MONTH = "2026-10"


def event(instance: str, kind: str, t: float, started_at: float, **kw: Any) -> dict[str, Any]:
    """An instance event of group g, as the sidecar writes it."""
    record = instance_event(
        instance,
        kind,
        t,
        started_at,
        replica=kw.pop("replica", "g"),
        node="node-a",
        gpus=f"GPU-{instance}",
    )
    record.update(kw)
    return record


def lifetime(instance: str, start: float, end: float, stop: bool) -> list[dict[str, Any]]:
    """Start (when ``stop``: an announced lifetime), heartbeats every 30 s, then stop or silence."""
    beats = [event(instance, "heartbeat", t, start) for t in range(int(start) + 30, int(end), 30)]
    if not stop:
        return beats
    return [event(instance, "start", start, start), *beats, event(instance, "stop", end, start)]


def gpu(instance: str, start: float, seconds: float) -> list[dict[str, Any]]:
    """The one GPU of ``instance``, seen every 10 s, drawing nothing."""
    samples = gpu_samples("g", start, seconds, watts=0.0, node="node-a", gpu=instance)
    return [{**s, "instance": instance} for s in samples]


def policy(rule: str = "platform") -> Policy:
    return Policy.listed(
        usd_per_gpu_hour={"L40S": 6.0},
        idle={"g": (rule, None)},
        replica_model={"g": "chat-small"},
    )


def keep(ledger: Ledger, kind: str, records: list[dict[str, Any]]) -> None:
    result = ledger.ingest(batch(kind, records), now=T0 + 3600)
    assert result.rejected == [], result.rejected
    assert result.accepted == len(records)


@pytest.fixture
def fleet(ledger: Ledger) -> Ledger:
    """Group g's three instances, their GPUs and their usage, in a real ledger."""
    keep(
        ledger,
        "instances",
        [
            *lifetime("g-a", T0, T0 + 170, stop=True),
            *lifetime("g-b", T0 + 60, T0 + 230, stop=True),
            *lifetime("g-c", T0 + 60, T0 + 151, stop=False),
        ],
    )
    keep(
        ledger,
        "gpu_samples",
        [*gpu("g-a", T0, 180), *gpu("g-b", T0 + 60, 180), *gpu("g-c", T0 + 60, 180)],
    )
    keep(
        ledger,
        "usage",
        [
            usage("search", T0, 60, replica="g", instance="g-a"),  # all of g-a's minute 0
            usage("assistant", T0 + 60, 30, replica="g", instance="g-b"),  # half of g-b's minute 1
            usage("search", T0 + 120, 60, replica="g", instance="g-c"),  # all of g-c's minute 2
        ],
    )
    return ledger


def by_team(lines: pl.DataFrame) -> dict[tuple[str, str], tuple[float, float]]:
    """(compute, idle) USD per line, from its exact micro-cents."""
    columns = ("team", "model", "compute_microcents", "idle_microcents")
    return {(t, m): (c / 10**8, i / 10**8) for t, m, c, i in lines.select(columns).iter_rows()}


def test_each_instance_pays_and_idles_on_its_own(fleet):
    """Sixty in-flight seconds on one pod make that pod's minute busy, not its siblings'."""
    lines, fleet_microcents = allocation_runs.allocate(fleet, policy("platform"), MONTH)
    # Keyed by replica, minute 2 (three GPUs, 60 in-flight seconds) would be all busy and
    # search would pay $0.30 for it; per instance it pays g-c's $0.10 and g-a and g-b idle.
    assert by_team(lines) == {
        ("search", "chat-small"): (0.20, 0.0),
        ("assistant", "chat-small"): (0.05, 0.0),
        # g-a idle 2 minutes, g-b 2.5, g-c 1 (inside its lifetime)
        ("platform", "chat-small"): (0.0, 0.55),
        # g-c's GPU in minute 3, after its lifetime: nobody's instance, the platform's
        ("platform", UNALLOCATED): (0.0, 0.10),
    }
    assert fleet_microcents == 90_000_000


def test_spread_idle_follows_the_teams_that_used_that_instance(fleet):
    """With spread, g-b's idle goes to assistant (its only user), g-a's and g-c's to search."""
    lines, _ = allocation_runs.allocate(fleet, policy("spread"), MONTH)
    assert by_team(lines) == {
        ("search", "chat-small"): (0.20, 0.30),
        ("assistant", "chat-small"): (0.05, 0.25),
        ("platform", UNALLOCATED): (0.0, 0.10),
    }


@pytest.mark.parametrize("rule", ["platform", "spread", "owner"])
def test_teams_and_idle_add_up_to_the_fleet_cost_to_the_cent(fleet, rule):
    """Every line of the month, in cents, adds up to the fleet's cost in cents."""
    p = policy(rule)
    if rule == "owner":
        p = Policy(
            prices=p.prices,
            idle={"g": ("owner", "research")},
            replica_model=p.replica_model,
        )
    lines, fleet_microcents = allocation_runs.allocate(fleet, p, MONTH)
    rounded = cents_lines(MONTH, lines)
    assert int(rounded["total_cents"].sum()) == cents(fleet_microcents) == 90


def test_an_instance_with_no_lifetime_is_allocated_wherever_it_was_seen(ledger):
    """Without events (a fixed replica, or a pod that never announced itself) nothing is cut."""
    keep(ledger, "gpu_samples", gpu("g-x", T0, 120))
    keep(ledger, "usage", [usage("search", T0, 60, replica="g", instance="g-x")])
    lines, _ = allocation_runs.allocate(ledger, policy("platform"), MONTH)
    assert by_team(lines) == {
        ("search", "chat-small"): (0.10, 0.0),
        ("platform", "chat-small"): (0.0, 0.10),
    }


def test_time_before_an_instances_first_announcement_stays_its_own(ledger):
    """A fixed replica whose sidecar starts announcing itself keeps the GPU time from before."""
    keep(ledger, "gpu_samples", gpu("g-x", T0, 180))
    keep(ledger, "usage", [usage("search", T0, 60, replica="g", instance="g-x")])
    keep(ledger, "instances", lifetime("g-x", T0 + 120, T0 + 170, stop=True))
    lines, _ = allocation_runs.allocate(ledger, policy("platform"), MONTH)
    assert by_team(lines) == {
        ("search", "chat-small"): (0.10, 0.0),
        ("platform", "chat-small"): (0.0, 0.20),
    }


def test_lifetimes_from_start_heartbeat_and_stop_and_from_heartbeats_alone(fleet):
    """A stopped instance ends at its stop; one that went silent is closed at its last heartbeat."""
    rows = {r["instance"]: r for r in registry.lifetimes(fleet, now=T0 + 1000)}
    assert {
        k: (r["started_at"], r["last_seen"], r["stopped_at"], r["state"]) for k, r in rows.items()
    } == {
        "g-a": (T0, T0 + 170, T0 + 170, "stopped"),
        "g-b": (T0 + 60, T0 + 230, T0 + 230, "stopped"),
        "g-c": (T0 + 60, T0 + 150, None, "lost"),
    }
    assert (rows["g-c"]["node"], rows["g-c"]["gpus"], rows["g-c"]["replica"]) == (
        "node-a",
        "GPU-g-c",
        "g",
    )


def test_an_instance_is_live_until_it_misses_three_heartbeats(fleet):
    """g-c, last heard at T0+150: live until three 30 s heartbeats and the 10 s a heartbeat may
    take to reach billing have passed (T0+250), lost after."""
    live = [r["instance"] for r in registry.lifetimes(fleet, now=T0 + 245, state="live")]
    lost = [r["instance"] for r in registry.lifetimes(fleet, now=T0 + 255, state="live")]
    assert (live, lost) == (["g-c"], [])
    assert [r["state"] for r in registry.lifetimes(fleet, now=T0 + 255, replica="g")] == [
        "stopped"
    ] * 2 + ["lost"]


def test_a_pod_name_that_comes_back_is_a_new_lifetime(ledger):
    """A StatefulSet pod restarted under the same name: two lifetimes, each with its own start."""
    keep(
        ledger,
        "instances",
        [
            *lifetime("g-0", T0, T0 + 100, stop=True),
            *lifetime("g-0", T0 + 200, T0 + 300, stop=True),
        ],
    )
    rows = registry.lifetimes(ledger, now=T0 + 1000)
    assert [(r["started_at"], r["stopped_at"]) for r in rows] == [
        (T0, T0 + 100),
        (T0 + 200, T0 + 300),
    ]


def test_an_old_ledger_upgrades_and_keeps_its_statement(tmp_path):
    """Rollups written at schema version 3 (keyed by replica) give the same lines once migrated."""
    path = tmp_path / "v3.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER, applied_at DOUBLE)")
    for version, migration in enumerate(MIGRATIONS[:3], start=1):
        con.execute(migration)
        con.execute("INSERT INTO schema_version VALUES (?, 0)", [version])
    base = int(OCT // 60)
    usage_rows = EXAMPLE_USAGE.with_columns(slot=pl.col("slot") + base)
    gpu_rows = EXAMPLE_GPUS.with_columns(slot=pl.col("slot") + base)
    for r in usage_rows.iter_rows(named=True):
        con.execute(
            "INSERT INTO usage_slots VALUES (?, ?, ?, ?, ?, ?, 0, ?, 0, ?, 0, 0, 0, 0)",
            [
                r["replica"],
                r["team"],
                r["model"],
                r["slot"],
                r["inflight_seconds"],
                r["requests"],
                r["prompt_tokens"],
                r["completion_tokens"],
            ],
        )
    con.execute(
        "INSERT INTO replica_slots SELECT replica, slot, sum(inflight_seconds) FROM usage_slots GROUP BY ALL"
    )
    for r in gpu_rows.iter_rows(named=True):
        con.execute(
            "INSERT INTO gpu_slots VALUES ('node-a', ?, ?, ?, ?, ?, 0, 0, 0, 1, 0)",
            [r["gpu_model"], r["replica"], r["slot"], r["gpu_seconds"], r["energy_joules"]],
        )
    con.close()
    example = Policy.listed(
        usd_per_gpu_hour={"H100": 6.0}, usd_per_kwh=0.20, pue=1.5, replica_model={"r1": "m"}
    )
    ledger = Ledger.open(path, ["search", "assistant"], {})
    try:
        lines, fleet_microcents = allocation_runs.allocate(ledger, example, MONTH)
        with ledger.reader() as cur:
            instances = cur.execute("SELECT DISTINCT replica, instance FROM gpu_slots").fetchall()
    finally:
        ledger.close()
    expected, expected_fleet = allocate(EXAMPLE_USAGE, EXAMPLE_GPUS, example)
    assert instances == [("r1", "r1")]
    assert lines.equals(expected)
    assert fleet_microcents == expected_fleet
    rounded = cents_lines(MONTH, lines)
    assert dict(zip(rounded["team"], rounded["total_cents"], strict=True)) == {
        "search": 21,
        "assistant": 10,
    }


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """The billing API over a ledger holding a live, a stopped and a lost instance (of now)."""
    now = time.time()
    url = "http://10.0.0.7:19400/engine/metrics"
    ledger.ingest(
        batch(
            "instances",
            [
                event(
                    "g-live",
                    "start",
                    now - 100,
                    now - 100,
                    gpus="GPU-1,GPU-2",
                    engine_metrics_url=url,
                    namespace="llm",
                    pod_uid="uid-1",
                ),
                event(
                    "g-live",
                    "heartbeat",
                    now - 10,
                    now - 100,
                    gpus="GPU-1,GPU-2",
                    engine_metrics_url=url,
                    namespace="llm",
                    pod_uid="uid-1",
                ),
                event("g-stopped", "start", now - 900, now - 900),
                event("g-stopped", "stop", now - 600, now - 900),
                event("g-lost", "heartbeat", now - 500, now - 800),
                event("h-live", "heartbeat", now - 5, now - 50, replica="h"),
            ],
        )
    )
    async with serving(create_app(config, ledger), lifespan="off") as base:
        yield base


async def test_the_registry_lists_live_instances_by_default(billing):
    """GET /v1/instances: the live instances, each as the contract spells it."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(METRICS)) as client:
        body = (await client.get("/v1/instances")).json()
        only_g = (await client.get("/v1/instances", params={"replica": "g"})).json()
    assert [(i["instance"], i["state"]) for i in body["instances"]] == [
        ("g-live", "live"),
        ("h-live", "live"),
    ]
    live = body["instances"][0]
    assert set(live) == {
        "instance",
        "replica",
        "model",
        "node",
        "gpu_model",
        "gpu_count",
        "gpus",
        "namespace",
        "pod_uid",
        "engine_metrics_url",
        "started_at",
        "last_seen",
        "stopped_at",
        "state",
    }
    assert (live["gpus"], live["stopped_at"], live["namespace"], live["pod_uid"]) == (
        ["GPU-1", "GPU-2"],
        None,
        "llm",
        "uid-1",
    )
    assert live["engine_metrics_url"] == "http://10.0.0.7:19400/engine/metrics"
    assert [i["instance"] for i in only_g["instances"]] == ["g-live"]


async def test_the_registry_lists_every_lifetime_with_state_all(billing):
    """state=all adds stopped and lost instances; limit bounds the answer."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(ADMIN)) as client:
        body = (await client.get("/v1/instances", params={"state": "all"})).json()
        two = (await client.get("/v1/instances", params={"state": "all", "limit": 2})).json()
        bad = await client.get("/v1/instances", params={"state": "dead"})
    states = {i["instance"]: i["state"] for i in body["instances"]}
    assert states == {"g-live": "live", "g-lost": "lost", "g-stopped": "stopped", "h-live": "live"}
    assert len(two["instances"]) == 2
    assert bad.status_code == 422


@pytest.mark.parametrize(
    ("key", "status"),
    [(None, 401), ("wrong", 401), (SEARCH, 403), (INGEST, 403), (METRICS, 200), (ADMIN, 200)],
)
async def test_only_the_admin_and_metrics_tokens_read_the_registry(billing, key, status):
    """The registry spans the fleet: teams and the ingest token may not read it."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(key) if key else {}) as client:
        assert (await client.get("/v1/instances")).status_code == status


async def test_metrics_count_live_instances_per_replica_group(billing):
    """/metrics: infermeter_billing_live_instances per group and model."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(METRICS)) as client:
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["infermeter_billing_live_instances"].samples
    assert {s.labels["replica"]: s.value for s in samples} == {"g": 1, "h": 1}


def test_pods_sharing_a_replica_id_each_have_their_own_minutes():
    """Three pods of one group, one busy all minute: one busy GPU-minute and two idle, not three busy."""
    gpus = pl.DataFrame(
        {
            "replica": ["g"] * 3,
            "instance": ["g-a", "g-b", "g-c"],
            "gpu_model": ["L40S"] * 3,
            "slot": [0] * 3,
            "gpu_seconds": [60.0] * 3,
            "energy_joules": [0.0] * 3,
        }
    )
    busy = pl.DataFrame(
        {
            "replica": ["g"],
            "instance": ["g-a"],
            "team": ["search"],
            "model": ["chat-small"],
            "slot": [0],
            "inflight_seconds": [60.0],
            "requests": [1],
            "prompt_tokens": [1],
            "completion_tokens": [1],
        }
    )
    lines, _ = allocate(busy, gpus, policy("platform"))
    assert by_team(lines) == {
        ("search", "chat-small"): (0.10, 0.0),
        ("platform", "chat-small"): (0.0, 0.20),
    }


def test_a_line_split_by_instance_keeps_its_sign_and_an_error_line_stays_whole():
    """Cents split by largest remainder add up to the line; a negative adjustment stays negative."""
    from billing.statement import instance_lines
    from infermeter.statement import LINE_SCHEMA

    def line(for_month: str, model: str, compute: int, requests: int) -> dict[str, Any]:
        return {
            "month": "2026-11",
            "for_month": for_month,
            "team": "search",
            "model": model,
            "requests": requests,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "gpu_hours": 0.3,
            "energy_kwh": 0.0,
            "compute_cents": compute,
            "energy_cents": 0,
            "idle_cents": 0,
            "total_cents": compute,
        }

    lines = pl.DataFrame(
        [
            line("2026-11", "m", 10, 3),
            line("2026-10", "m", -7, -1),
            line("2026-11", "(error) no price", 0, 0),
        ],
        schema=LINE_SCHEMA,
    )
    parts = pl.DataFrame(
        {
            "for_month": ["2026-11", "2026-11", "2026-10", "2026-10"],
            "team": ["search"] * 4,
            "model": ["m"] * 4,
            "replica": ["g"] * 4,
            "instance": ["g-a", "g-b", "g-a", "g-b"],
            "gpu_hours": [0.2, 0.1, 0.2, 0.1],
            "energy_kwh": [0.0] * 4,
            "compute_microcents": [6_666_667, 3_333_333, 20_000_000, 10_000_000],
            "energy_microcents": [0] * 4,
            "idle_microcents": [0] * 4,
            "requests": [2, 1, 2, 1],
            "prompt_tokens": [0] * 4,
            "completion_tokens": [0] * 4,
        }
    )
    split = instance_lines(lines, parts)
    rows = [
        (r["for_month"], r["instance"], r["compute_cents"], r["requests"])
        for r in split.iter_rows(named=True)
    ]
    assert rows == [
        ("2026-11", "g-a", 7, 2),
        ("2026-11", "g-b", 3, 1),
        ("2026-10", "g-a", -5, -1),  # -4.67 and -2.33 cents; -0.67 and -0.33 requests
        ("2026-10", "g-b", -2, 0),
        ("2026-11", None, 0, 0),
    ]
    assert split["gpu_hours"].to_list()[:2] == pytest.approx([0.2, 0.1])


def test_a_billing_restart_does_not_read_the_fleet_as_lost(tmp_path, config):
    """Billing down 60 s, then back: for one live window, instances heard of before it stopped
    stay live (their spooled heartbeats are still on the way); after it, silence means lost."""
    path = tmp_path / "ledger.duckdb"
    teams = [t.name for t in config.teams]
    first = Ledger.open(path, teams, {})
    now = time.time()
    events = [
        event("g-a", "start", now - 100, now - 100),
        event("g-a", "heartbeat", now - 70, now - 100),
    ]
    assert first.ingest(batch("instances", events), now=now).accepted == 2
    first.close()
    # Billing was down from now-70 to now: the heartbeat it last heard is 70 s old.
    second = Ledger.open(path, teams, {})
    try:
        assert [r["instance"] for r in registry.lifetimes(second, now, state="live")] == ["g-a"]
        assert registry.live_instances(second, now) == [("g", "chat-small", 1)]
        # Once billing has been up a whole window (3 x 30 s + 10 s), g-a's silence counts.
        window = 3 * 30 + 10
        assert registry.lifetimes(second, second.restart.at + window + 1, state="live") == []
    finally:
        second.close()
