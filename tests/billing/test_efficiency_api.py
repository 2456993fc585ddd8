"""``GET /v1/efficiency/{month}`` over real loopback HTTP: team scoping and the plan it carries."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from billing.api import create_app
from infermeter.config import Config
from tests.billing.fleet_month import Group, Month, Stream, month_config, run
from tests.conftest import config_ledger
from tests.servers import serving

ADMIN, SEARCH, ASSISTANT = "im-demo-admin", "im-demo-search", "im-demo-assistant"
PEAK = tuple(int(10 <= h < 14) for h in range(24))


def route_config() -> Config:
    """Engines 20 times slower than the demo's, chat-large's slowing 5 ms a sequence more per step."""
    data = month_config(slower=20).model_dump()
    data["simulator"]["engines"]["chat-large"]["step_per_seq_ms"] = 5 * 20
    return Config.model_validate(data)


@pytest.fixture
async def billing() -> AsyncIterator[str]:
    """Two days in which search's short chat-large requests need a second pod at the peak."""
    config = route_config()
    ledger = config_ledger(config)
    month = Month(
        (Group("large-0", tuple(2 if p else 1 for p in PEAK), dynamic=True), Group("small-0")),
        (
            Stream("search", "chat-large", tuple(50.0 * p for p in PEAK), 200, 250),
            Stream("search", "chat-large", (2.0,) * 24, 2000, 1000),
            Stream("assistant", "chat-small", (10.0,) * 24, 300, 150),
        ),
        days=2,
    )
    run(config, month, ledger)
    async with serving(create_app(config, ledger), lifespan="off") as url:
        yield url
    ledger.close()


async def _get(url: str, key: str, path: str = "/v1/efficiency/2026-10") -> httpx.Response:
    async with httpx.AsyncClient(
        base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=60
    ) as c:
        return await c.get(path)


async def test_the_admin_sees_the_plan_its_replay_and_the_fleet(billing):
    """The admin's answer: the groups' figures, the plan with each change's replay, and the notes."""
    body = (await _get(billing, ADMIN)).json()
    groups = body["figures"]["groups"]
    replicas = {row[groups["columns"].index("replica")] for row in groups["rows"]}
    assert replicas == {"large-0", "small-0"}
    [rec] = body["recommendations"]
    assert (rec["kind"], rec["team"], rec["change"]["route"]["to"]) == (
        "route",
        "search",
        "chat-small",
    )
    assert set(rec["replay"]) == {"chat-large", "chat-small"}
    large = rec["replay"]["chat-large"]
    assert large["gpu_hours_after"] < large["gpu_hours_before"]
    assert all(row["holds"] for row in large["sla_after"])
    assert (
        body["saving_usd_per_month"]
        == body["plan"]["saving_usd_per_month"]
        == rec["saving_usd_per_month"]
    )
    assert body["plan"]["saving_usd"] <= body["plan"]["measured_usd"]
    assert body["plan"]["hours_measured"] == 48
    assert [n["kind"] for n in body["notes"]] == ["cannot_size"]


async def test_a_team_sees_its_own_rows_and_its_own_advice(billing):
    """search gets its hourly rows and its route advice, no replica groups and no notes."""
    body = (await _get(billing, SEARCH)).json()
    teams = body["figures"]["teams"]
    assert {row[teams["columns"].index("team")] for row in teams["rows"]} == {"search"}
    assert body["figures"]["groups"]["rows"] == []
    assert [(r["kind"], r["team"]) for r in body["recommendations"]] == [("route", "search")]
    assert body["notes"] == []
    other = (await _get(billing, ASSISTANT)).json()
    assert (other["recommendations"], other["saving_usd_per_month"]) == ([], 0)


async def test_a_team_may_not_read_another_teams_efficiency(billing):
    """Asking for another team's view is a 403 in OpenAI's error shape."""
    response = await _get(billing, ASSISTANT, "/v1/efficiency/2026-10?team=search")
    assert response.status_code == 403
    assert response.json()["error"]["message"] == "this credential may not read team 'search'"


async def test_a_malformed_month_is_a_400(billing):
    """The month must be YYYY-MM."""
    assert (await _get(billing, ADMIN, "/v1/efficiency/2026-13")).status_code == 400
