"""``GET /v1/efficiency/{month}`` over real loopback HTTP: team scoping and the advice it carries."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config
from tests.billing.test_efficiency import fill, gpus, requests
from tests.servers import serving

ADMIN, SEARCH, ASSISTANT = "im-demo-admin", "im-demo-search", "im-demo-assistant"


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """The billing API over a ledger where search sends short requests to the large model."""
    fill(ledger,
         usage=requests(6, replica="large-0", model="chat-large") + requests(100, "assistant"),
         gpu_samples=gpus("large-0", 2, "H100", "node-a") + gpus("small-0"))  # fmt: skip
    async with serving(create_app(config, ledger), lifespan="off") as url:
        yield url


async def _get(url: str, key: str, path: str = "/v1/efficiency/2026-10") -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"}) as c:
        return await c.get(path)


async def test_the_admin_sees_the_fleet_and_every_recommendation(billing):
    """The admin's answer has the replica groups' figures and fleet-wide advice, largest saving first."""
    body = (await _get(billing, ADMIN)).json()
    groups = body["figures"]["groups"]
    assert {row[groups["columns"].index("replica")] for row in groups["rows"]} == {
        "large-0",
        "small-0",
    }
    kinds = [r["kind"] for r in body["recommendations"]]
    assert set(kinds) == {"quantize", "route"}
    savings = [r["saving_usd_per_month"] for r in body["recommendations"]]
    assert savings == sorted(savings, reverse=True)
    assert body["saving_usd_per_month"] == pytest.approx(sum(savings), abs=0.02)


async def test_a_team_sees_its_own_rows_and_its_own_advice(billing):
    """search gets its hourly rows and its route advice, no replica groups and no fleet-wide advice."""
    body = (await _get(billing, SEARCH)).json()
    teams = body["figures"]["teams"]
    assert {row[teams["columns"].index("team")] for row in teams["rows"]} == {"search"}
    assert body["figures"]["groups"]["rows"] == []
    assert [(r["kind"], r["team"]) for r in body["recommendations"]] == [("route", "search")]


async def test_a_team_may_not_read_another_teams_efficiency(billing):
    """Asking for another team's view is a 403 in OpenAI's error shape."""
    response = await _get(billing, ASSISTANT, "/v1/efficiency/2026-10?team=search")
    assert response.status_code == 403
    assert response.json()["error"]["message"] == "this credential may not read team 'search'"


async def test_a_malformed_month_is_a_400(billing):
    """The month must be YYYY-MM."""
    assert (await _get(billing, ADMIN, "/v1/efficiency/2026-13")).status_code == 400
