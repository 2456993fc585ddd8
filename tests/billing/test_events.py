"""``GET /v1/events`` (what the charts mark) and the ``span`` query (what default ranges fit)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from billing.api import create_app
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.routes.events import NO_PRICE_CHANGES
from infermeter.config import Config
from tests.billing.conftest import NOV, OCT, batch, gpu_samples, scaling_decision, usage
from tests.servers import serving

ADMIN, SEARCH = "im-demo-admin", "im-demo-search"
NOW = NOV + 3 * 86400


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """October with a request of search, GPU time from an hour before it, two scaling decisions
    in November, and October closed on the 2nd of November."""
    for kind, records in (
        ("usage", [usage("search", OCT + 7200)]),
        ("gpu_samples", gpu_samples(start=OCT + 3600, seconds=7200)),
        (
            "scaling_decisions",
            [
                scaling_decision(NOV + 3600, 1, 2, "queue 12 > 10 for 35 s: scale up"),
                scaling_decision(NOV + 7200, 2, 1, "GPUs 10 % busy for 5 m: scale down"),
            ],
        ),
    ):
        assert ledger.ingest(batch(kind, records), now=NOW).rejected == []
    Chargeback(ledger, config).close("2026-10", now=NOV + 86400)
    async with serving(create_app(config, ledger), lifespan="off") as url:
        yield url


async def get(url: str, key: str, path: str, **params: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.get(path, params=params, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_the_admin_sees_scale_events_and_closes_oldest_first(billing):
    """Each decision is a scale event with its reasons; the close of October follows them."""
    body = await get(billing, ADMIN, "/v1/events", **{"from": NOV, "to": NOW})
    kinds = [(e["kind"], e["title"]) for e in body["events"]]
    assert kinds == [
        ("scale_up", "chat-small: 1 -> 2 replicas"),
        ("scale_down", "chat-small: 2 -> 1 replicas"),
        ("month_close", "2026-10 closed"),
    ]
    assert body["events"][0]["detail"] == "queue 12 > 10 for 35 s: scale up"
    assert body["price_changes"] == NO_PRICE_CHANGES


async def test_a_team_sees_the_close_but_not_the_fleets_scaling(billing):
    """Scaling spans every team, so a team key gets the month's close only."""
    body = await get(billing, SEARCH, "/v1/events", **{"from": NOV, "to": NOW})
    assert [e["kind"] for e in body["events"]] == ["month_close"]


async def test_a_range_outside_the_events_has_none(billing):
    """Events are those of the range asked for."""
    body = await get(billing, ADMIN, "/v1/events", **{"from": OCT, "to": OCT + 86400})
    assert body["events"] == []


async def test_the_span_is_the_callers_own_data(billing):
    """The admin's data starts with the GPU time; the team's with its first request."""
    admin = await get(billing, ADMIN, "/v1/query/span")
    team = await get(billing, SEARCH, "/v1/query/span")
    assert admin["rows"] == [
        [OCT + 3600, OCT + 3 * 3600 + 60]
    ]  # the first sample covers 3600..3610
    assert team["rows"][0][0] == OCT + 7200
