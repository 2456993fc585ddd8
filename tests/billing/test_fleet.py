"""The autoscaler's decisions in the ledger, and ``GET /v1/fleet`` over a DuckDB file and real HTTP."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.api import create_app
from billing.fleet import fleet_view
from billing.ledger import Ledger
from infermeter.config import Config
from infermeter.records import MAX_DECISION_REASONS
from tests.billing.conftest import batch, bearer, instance_event, ndjson, scaling_decision
from tests.conftest import config_ledger
from tests.servers import serving

ADMIN, INGEST, METRICS, SEARCH = (
    "im-demo-admin",
    "im-demo-ingest",
    "im-demo-metrics",
    "im-demo-search",
)
NOW = time.time()


@pytest.fixture(autouse=True)
def _now() -> None:
    """NOW is the test's own start: billing judges liveness by its own clock, and a full run
    reaches this module minutes after collecting it, when heartbeats from then are stale."""
    global NOW
    NOW = time.time()


def decision(
    model: str = "chat-small",
    at: float = NOW - 60,
    previous: int = 2,
    desired: int = 3,
    **changes: Any,
) -> dict[str, Any]:
    """One decision as the autoscaler spools it (its own ``to_json``), with ``changes``."""
    reasons = "queue 12 > 10 for 35 s (>= 30 s): scale up"
    return {**scaling_decision(at, previous, desired, reasons, model), **changes}


def event(
    instance: str,
    kind: str,
    t: float,
    started_at: float,
    replica: str = "small-0",
    model: str = "chat-small",
    gpus: str = "0",
) -> dict[str, Any]:
    """An instance event as its sidecar writes it."""
    return instance_event(instance, kind, t, started_at, replica=replica, model=model, gpus=gpus)


@pytest.fixture
def ledger(tmp_path: Path, config: Config) -> Iterator[Ledger]:
    """A ledger file for the demo's teams and models."""
    led = config_ledger(config, tmp_path / "ledger.duckdb")
    yield led
    led.close()


# -- ingest -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"model": "chat-huge"}, 'unknown model "chat-huge"'),
        ({"reasons": "x" * (MAX_DECISION_REASONS + 1)}, "reasons: longer than 1000 characters"),
        ({"reasons": "  "}, "reasons: empty"),
        ({"desired": -1}, "replica counts: not between 0 and 10,000"),
        ({"current": 10_001}, "replica counts: not between 0 and 10,000"),
        ({"desired": 2}, "desired equals previous: not a change"),
        ({"decided_at": NOW + 3600}, "timestamp in the future: decided_at"),
        ({"decided_at": 1000.0}, "decided_at: not Unix seconds"),
        ({"decision_id": ""}, "decision_id: empty"),
        ({"reasons": None}, "reasons: must be"),
    ],
)
def test_a_bad_decision_is_refused_naming_why_and_the_rest_kept(ledger, changes, reason):
    """Each check refuses its record with its reason; the good record beside it is kept."""
    good = decision(model="chat-large", previous=1, desired=2)
    result = ledger.ingest_lines("scaling_decisions", ndjson([decision(**changes), good]), now=NOW)
    assert result.accepted == 1
    assert len(result.rejected) == 1
    assert reason in result.rejected[0].reason
    with ledger.reader() as cur:
        kept = cur.execute("SELECT model FROM scaling_decisions").fetchall()
    assert kept == [("chat-large",)]


def test_a_resent_decision_is_kept_once(ledger):
    """Decisions are idempotent by id: a batch sent again adds nothing."""
    records = [decision(at=NOW - 120), decision(at=NOW - 60, previous=3, desired=4)]
    first = ledger.ingest(batch("scaling_decisions", records), now=NOW)
    again = ledger.ingest_lines("scaling_decisions", ndjson(records), now=NOW)
    assert (first.accepted, again.accepted, again.duplicates) == (2, 0, 2)
    with ledger.reader() as cur:
        assert cur.execute("SELECT count(*) FROM scaling_decisions").fetchone() == (2,)


# -- the view ---------------------------------------------------------------------------------


def test_a_group_live_but_not_configured_is_listed_after_the_configured_ones(config):
    """An instance of a group the configuration no longer lists is shown, with 0 configured."""
    live = [
        {
            "instance": "vllm-old-1",
            "replica": "old",
            "model": "chat-small",
            "node": "n",
            "gpu_model": "L40S",
            "gpu_count": 1,
            "gpus": "",
            "started_at": NOW - 9,
            "last_seen": NOW,
        }
    ]
    view = fleet_view(config, live, [], [], (NOW - 60, NOW, False), NOW)
    assert [(g.replica, g.configured, g.live) for g in view.groups] == [
        ("large-0", 1, 0),
        ("small-0", 1, 0),
        ("small-1", 1, 0),
        ("old", 0, 1),
    ]
    small = next(m for m in view.models if m.model == "chat-small")
    assert (small.groups, small.configured, small.live, small.desired) == (
        ["small-0", "small-1", "old"],
        2,
        1,
        None,
    )


# -- GET /v1/fleet ----------------------------------------------------------------------------


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """Billing over a ledger fed a scaled-up chat-small and the autoscaler's decisions.

    small-0 runs its fixed replica and three autoscaled instances; a fourth stopped a while ago.
    The autoscaler asked chat-small for 2 -> 3 -> 5 and chat-large for 1 -> 2, yesterday.
    """
    events = [event("small-0", "heartbeat", NOW - 5, NOW - 3000)]
    for n, started in ((1, NOW - 900), (2, NOW - 600), (3, NOW - 300)):
        name = f"vllm-small-0-{n}"
        events += [
            event(name, "start", started, started, gpus=f"{n + 1}"),
            event(name, "heartbeat", NOW - 10, started, gpus=f"{n + 1}"),
        ]
    events += [
        event("vllm-small-0-0", "start", NOW - 2000, NOW - 2000),
        event("vllm-small-0-0", "stop", NOW - 1000, NOW - 2000),
    ]
    decisions = [
        decision(
            at=NOW - 86_400 - 60,
            model="chat-large",
            previous=1,
            desired=2,
            reasons="raised to min_replicas 2",
        ),
        decision(at=NOW - 1000, previous=2, desired=3),
        decision(at=NOW - 950, previous=3, desired=5, reasons="previous days needed 5 replica(s)"),
    ]
    for kind, records in (("instances", events), ("scaling_decisions", decisions)):
        result = ledger.ingest(batch(kind, records))
        assert (result.accepted, result.rejected) == (len(records), [])
    async with serving(create_app(config, ledger), lifespan="off") as base:
        yield base


async def test_the_fleet_answers_each_groups_live_instances_and_each_models_last_decision(billing):
    """Configured, live and desired per model; the live instances of each group, oldest first."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(METRICS)) as client:
        body = (await client.get("/v1/fleet")).json()
    models = {m["model"]: m for m in body["models"]}
    small, large = models["chat-small"], models["chat-large"]
    assert (small["groups"], small["configured"], small["live"], small["desired"]) == (
        ["small-0", "small-1"],
        2,
        4,
        5,
    )
    last = small["last_decision"]
    assert (last["previous"], last["desired"], last["decided_at"]) == (
        3,
        5,
        pytest.approx(NOW - 950),
    )
    assert last["reasons"] == "previous days needed 5 replica(s)"
    assert (large["live"], large["desired"]) == (0, 2)  # decided yesterday: still its latest word
    groups = {g["replica"]: g for g in body["groups"]}
    assert [i["instance"] for i in groups["small-0"]["instances"]] == [
        "small-0",
        "vllm-small-0-1",
        "vllm-small-0-2",
        "vllm-small-0-3",
    ]
    assert groups["small-0"]["live"] == 4
    assert groups["small-0"]["instances"][1]["gpus"] == ["2"]
    assert (groups["small-1"]["configured"], groups["small-1"]["live"]) == (1, 0)


async def test_recent_decisions_are_those_of_the_range_newest_first_and_bounded(billing):
    """The last day's decisions by default; ``from``/``to`` pick another range, ``limit`` caps it."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(ADMIN)) as client:
        day = (await client.get("/v1/fleet")).json()
        two_days = (await client.get("/v1/fleet", params={"from": NOW - 2 * 86_400})).json()
        capped = (await client.get("/v1/fleet", params={"limit": 1})).json()
        backwards = await client.get("/v1/fleet", params={"from": NOW, "to": NOW - 60})
    assert [(d["previous"], d["desired"]) for d in day["decisions"]] == [(3, 5), (2, 3)]
    assert day["decisions_truncated"] is False
    assert [d["model"] for d in two_days["decisions"]] == ["chat-small", "chat-small", "chat-large"]
    assert [(d["desired"], capped["decisions_truncated"]) for d in capped["decisions"]] == [
        (5, True)
    ]
    assert backwards.status_code == 400
    assert "to > from" in backwards.json()["error"]["message"]


@pytest.mark.parametrize(
    ("key", "status"), [(None, 401), (SEARCH, 403), (INGEST, 403), (METRICS, 200), (ADMIN, 200)]
)
async def test_only_the_admin_and_metrics_tokens_read_the_fleet(billing, key, status):
    """The fleet spans every team: a team key and the ingest token may not read it."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(key) if key else {}) as client:
        assert (await client.get("/v1/fleet")).status_code == status


async def test_decisions_shipped_over_http_reach_the_fleet(billing):
    """A decision POSTed to the ingest route as shippers send it is the model's latest at once."""
    record = decision(at=time.time() - 1, model="chat-large", previous=2, desired=3)
    async with httpx.AsyncClient(base_url=billing) as client:
        sent = await client.post(
            "/v1/ingest/scaling_decisions",
            content=ndjson([record]),
            headers={**bearer(INGEST), "content-type": "application/x-ndjson"},
        )
        body = (await client.get("/v1/fleet", headers=bearer(ADMIN))).json()
    assert sent.json()["accepted"] == 1
    large = next(m for m in body["models"] if m["model"] == "chat-large")
    assert (large["desired"], large["last_decision"]["previous"]) == (3, 2)
