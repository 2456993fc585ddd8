"""Forged live instances cannot steer the registry: billing lists no more than the fleet may run.

Instances announce themselves, so a writer that forges start events can make billing hear of
any number of them. What steers the fleet (the collectors' engines, the sidecars' fail-open
split, the Fleet page, the live-instance metric) is bounded by the configuration: here the demo's,
``min_replicas: 2`` and no ``max_replicas``, so each group may run its replica and 2 more (3);
more when the autoscaler has asked for more. Once, 250 forged live instances made the fail-open
path divide every team's limit by 253: 28 of 30 requests refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config, SharedLimitsSettings, TeamLimits
from sidecar.limits import LimitExceeded
from sidecar.shared_limits import SharedTeamLimiter
from sidecar.team_limits import team_limiter
from tests.billing.conftest import batch, instance_event, scaling_decision
from tests.conftest import config_ledger
from tests.servers import serving

METRICS = {"authorization": "Bearer im-demo-metrics"}
NOW = time.time()


@pytest.fixture(autouse=True)
def _now() -> None:
    """NOW is the test's own start: billing judges liveness by its own clock, and a full run
    reaches this module minutes after collecting it, when heartbeats from then are stale."""
    global NOW
    NOW = time.time()


def _start(instance: str, started_at: float, replica: str = "small-0") -> dict[str, Any]:
    """A start event, and so a live instance, of ``replica`` (one of chat-small's groups)."""
    return instance_event(
        instance,
        "start",
        NOW - 5,
        started_at,
        event_id=f"ev-{replica}-{instance}",
        replica=replica,
        gpus="1",
        engine_metrics_url=f"http://10.9.9.9:9/{instance}",
    )


def _asked(desired: int, previous: int = 2) -> dict[str, Any]:
    """The autoscaler's decision to run ``desired`` replicas of chat-small, from ``previous``."""
    return scaling_decision(NOW - 30, previous, desired, "scale")


@pytest.fixture
def ledger(tmp_path: Path, config: Config) -> Iterator[Ledger]:
    """A ledger file where small-0 has two real instances and 250 forged ones started later."""
    led = config_ledger(config, tmp_path / "ledger.duckdb")
    real = [_start("small-0-a", NOW - 3600), _start("small-0-b", NOW - 1800)]
    forged = [_start(f"ghost-{i}", NOW - 60) for i in range(250)]
    assert led.ingest(batch("instances", real + forged), now=NOW).accepted == 252
    yield led
    led.close()


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """The billing API over that ledger."""
    async with serving(create_app(config, ledger), lifespan="off") as base:
        yield base


async def _live(base: str, **params: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base, headers=METRICS) as client:
        r = await client.get("/v1/instances", params={"state": "live", **params})
    assert r.status_code == 200
    instances: list[dict[str, Any]] = r.json()["instances"]
    return instances


async def test_the_registry_lists_no_more_live_instances_than_a_group_may_run(billing):
    """250 forged instances of small-0: the registry lists 3, the real ones first."""
    live = await _live(billing, replica="small-0")
    names = [i["instance"] for i in live]
    assert len(names) == 3
    assert {"small-0-a", "small-0-b"} <= set(names)


async def test_the_live_metric_and_the_fleet_view_are_bounded_too(billing):
    """billing's live-instance metric and GET /v1/fleet count 3 for small-0, not 252."""
    async with httpx.AsyncClient(base_url=billing, headers=METRICS) as client:
        text = (await client.get("/metrics")).text
        fleet = (await client.get("/v1/fleet")).json()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counts = {
        s.labels["replica"]: s.value for s in families["infermeter_billing_live_instances"].samples
    }
    assert counts == {"small-0": 3}
    small = next(g for g in fleet["groups"] if g["replica"] == "small-0")
    assert (small["live"], len(small["instances"])) == (3, 3)


async def test_groups_the_configuration_does_not_list_share_one_bound(billing, ledger):
    """250 forged groups of one instance each: 3 live in all of them together, not 250."""
    forged = [_start(f"stray-{i}", NOW - 60, replica=f"ghost-group-{i}") for i in range(250)]
    assert ledger.ingest(batch("instances", forged), now=NOW).accepted == 250
    live = await _live(billing)
    assert len([i for i in live if i["replica"].startswith("ghost-group-")]) == 3


async def test_what_the_autoscaler_asked_for_raises_the_bound(billing, ledger):
    """Without max_replicas, the autoscaler asking for 5 replicas lets small-0 list 6."""
    assert ledger.ingest(batch("scaling_decisions", [_asked(5)]), now=NOW).accepted == 1
    assert len(await _live(billing, replica="small-0")) == 6


async def test_instances_draining_after_a_scale_down_stay_listed(billing, ledger):
    """A scale-down from 5 to 2 a moment ago: the 5 may still be draining, so 6 are listed."""
    assert ledger.ingest(batch("scaling_decisions", [_asked(2, previous=5)]), now=NOW).accepted == 1
    assert len(await _live(billing, replica="small-0")) == 6


async def test_max_replicas_bounds_the_registry_whatever_is_asked(config, ledger):
    """With min and max_replicas 1 a group lists at most 2, even after a decision asking for 5."""
    scaling = config.scaling.model_copy(update={"min_replicas": 1, "max_replicas": 1})
    bounded = config.model_copy(update={"scaling": scaling})
    assert ledger.ingest(batch("scaling_decisions", [_asked(5)]), now=NOW).accepted == 1
    async with serving(create_app(bounded, ledger), lifespan="off") as base:
        live = await _live(base, replica="small-0")
    assert [i["instance"] for i in live] == ["small-0-a", "small-0-b"]


async def test_a_sidecar_reading_the_registry_splits_its_limit_by_the_bound(
    billing, config, redis_server, monkeypatch
):
    """Redis down (fail_open), a sidecar reads billing's live count: 3, not 252, so a team of
    600 requests a minute still gets 30 requests through this sidecar."""
    monkeypatch.setenv("INFERMETER_REGISTRY_TOKEN", "im-demo-metrics")
    settings = SharedLimitsSettings(
        redis_url=redis_server.url, timeout_millis=2000, retry_seconds=60, registry_url=billing
    )
    teams = [
        t.model_copy(update={"limits": TeamLimits(requests_per_minute=600)}) for t in config.teams
    ]
    sidecar = config.sidecar.model_copy(update={"shared_limits": settings})
    limiter = team_limiter(
        config.model_copy(update={"teams": teams, "sidecar": sidecar}),
        "small-0",
        CollectorRegistry(),
    )
    assert isinstance(limiter, SharedTeamLimiter)
    await limiter.start()
    try:
        deadline = time.monotonic() + 10
        while limiter.live.count == 1:
            assert time.monotonic() < deadline, "the registry was never read"
            await asyncio.sleep(0.05)
        redis_server.kill()
        admitted = []
        for _ in range(30):
            with contextlib.suppress(LimitExceeded):
                admitted.append(await limiter.admit(config.teams[0].name, 1))
    finally:
        await limiter.close()
    assert limiter.live.count == 3
    assert len(admitted) == 30
