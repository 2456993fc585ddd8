"""One role model over billing's routes: every role tried on every route that gates by role.

The callers are the roles as a company has them: the admin and the services' tokens from the
configuration, a team's configured key (a member), and keys issued at run time for finance, a
viewer, the lead of a team and a member of another team. Each route is asked by each caller, and
the answer must be a refusal (401/403) exactly where the role may not do it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from billing.api import create_app
from infermeter.config import Config
from tests.billing.conftest import bearer
from tests.conftest import config_ledger
from tests.servers import serving

ADMIN, METRICS, SPEND, SEARCH = (
    "im-demo-admin",
    "im-demo-metrics",
    "im-demo-spend",
    "im-demo-search",
)
MONTH = "2026-10"
CALLERS = ("admin", "finance", "viewer", "spend_reader", "metrics", "lead", "member", "other")

# What each caller may do (the rest must be refused). "lead" and "member" are of team search,
# "other" a member of team research.
MAY = {
    ("GET", "/v1/spend"): {"admin", "finance", "viewer", "spend_reader", "lead", "member", "other"},
    ("GET", "/v1/rates"): {"admin", "finance", "viewer", "spend_reader", "lead", "member", "other"},
    ("GET", f"/v1/chargeback/{MONTH}"): {"admin", "finance", "viewer", "lead", "member", "other"},
    ("GET", f"/v1/chargeback/{MONTH}.csv"): {
        "admin",
        "finance",
        "viewer",
        "lead",
        "member",
        "other",
    },
    ("GET", f"/v1/chargeback/{MONTH}.focus.csv"): {
        "admin",
        "finance",
        "viewer",
        "lead",
        "member",
        "other",
    },
    ("GET", f"/v1/chargeback/{MONTH}/breakdown"): {
        "admin",
        "finance",
        "viewer",
        "lead",
        "member",
        "other",
    },
    ("GET", "/v1/query/team_usage?team=research"): {"admin", "finance", "viewer", "other"},
    ("GET", "/v1/query/gpus"): {"admin", "finance", "viewer"},
    ("GET", "/v1/months"): {"admin", "finance", "viewer"},
    ("POST", f"/v1/months/{MONTH}/close"): {"admin", "finance"},
    ("POST", "/v1/admin/export"): {"admin"},
    ("POST", "/v1/admin/budget-overrides"): {"admin"},
    ("GET", "/v1/invoices"): {"admin", "finance", "viewer"},
    ("POST", "/v1/invoices"): {"admin", "finance"},
    ("POST", "/v1/keys search"): {"admin", "lead"},
    ("POST", "/v1/keys research"): {"admin"},
    ("POST", "/v1/keys finance"): {"admin"},
    ("GET", "/v1/keys"): {"admin", "lead"},
    ("GET", "/v1/keys/active"): {"admin", "spend_reader"},
    ("GET", "/v1/audit"): {"admin"},
    ("GET", "/v1/audit.csv"): {"admin"},
    ("GET", "/metrics"): {"admin", "metrics"},
}


@pytest.fixture
async def callers(config: Config, tmp_path: Path) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """Billing on a ledger file and the token of each caller (run-time ones issued by the admin)."""
    config = config.model_copy(
        update={
            "billing": config.billing.model_copy(
                update={"read_burst": 100_000, "export_dir": str(tmp_path / "exports")}
            )
        }
    )
    ledger = config_ledger(config, tmp_path / "ledger.duckdb")
    try:
        async with serving(create_app(config, ledger), lifespan="off") as url:
            tokens = {"admin": ADMIN, "spend_reader": SPEND, "metrics": METRICS, "member": SEARCH}
            async with httpx.AsyncClient(base_url=url) as client:
                for name, request in (
                    ("finance", {"role": "finance"}),
                    ("viewer", {"role": "viewer"}),
                    ("lead", {"role": "lead", "team": "search"}),
                    ("other", {"team": "research"}),
                ):
                    made = await client.post("/v1/keys", json=request, headers=bearer(ADMIN))
                    assert made.status_code == 201, made.text
                    tokens[name] = made.json()["key"]
            yield url, tokens
    finally:
        ledger.close()


async def _ask(client: httpx.AsyncClient, method: str, route: str, token: str) -> httpx.Response:
    path, _, team = route.partition(" ")
    if method == "POST" and path == "/v1/keys":
        body = {"role": "finance"} if team == "finance" else {"team": team}
        return await client.post(path, json=body, headers=bearer(token))
    return await client.request(method, path, headers=bearer(token))


async def test_each_role_may_do_exactly_what_the_role_model_says_on_every_route(callers):
    """Every (caller, route) pair: refused (403) where the role may not, not refused where it may."""
    url, tokens = callers
    wrong = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for (method, route), allowed in MAY.items():
            for caller in CALLERS:
                answer = await _ask(client, method, route, tokens[caller])
                refused = answer.status_code in (401, 403)
                if refused == (caller in allowed) or answer.status_code >= 500:
                    wrong.append(
                        f"{caller} {method} {route}: {answer.status_code} {answer.text[:120]}"
                    )
    assert not wrong, "\n".join(wrong)


async def test_a_lead_sees_and_manages_only_its_own_teams_keys(callers):
    """A lead lists its team's keys only, and may not revoke another team's nor a lead's key."""
    url, tokens = callers
    async with httpx.AsyncClient(base_url=url) as client:
        everything = (await client.get("/v1/keys", headers=bearer(ADMIN))).json()["keys"]
        mine = (await client.get("/v1/keys", headers=bearer(tokens["lead"]))).json()["keys"]
        assert {k["team"] for k in everything} == {None, "search", "research"}
        assert mine
        assert {k["team"] for k in mine} == {"search"}
        research = next(k for k in everything if k["team"] == "research")
        refused = await client.post(
            f"/v1/keys/{research['key_id']}/revoke", headers=bearer(tokens["lead"])
        )
        assert refused.status_code == 403
        own_lead = next(k for k in mine if k["role"] == "lead")
        refused = await client.post(
            f"/v1/keys/{own_lead['key_id']}/rotate", headers=bearer(tokens["lead"])
        )
        assert refused.status_code == 403
        made = await client.post(
            "/v1/keys", json={"team": "search", "member": "bo"}, headers=bearer(tokens["lead"])
        )
        gone = await client.post(
            f"/v1/keys/{made.json()['key_id']}/revoke", headers=bearer(tokens["lead"])
        )
        assert gone.status_code == 200
        trail = (await client.get("/v1/audit", headers=bearer(ADMIN))).json()["events"]
    lead_id = own_lead["key_id"]
    assert [(e["action"], e["actor"]) for e in trail[-2:]] == [
        ("key.created", f"key:{lead_id}"),
        ("key.revoked", f"key:{lead_id}"),
    ]


async def test_a_team_sees_only_its_own_lines_and_finance_sees_every_teams(callers):
    """The statement is cut to the caller's team for a lead; finance gets every team's lines."""
    url, tokens = callers
    async with httpx.AsyncClient(base_url=url) as client:
        lead = (await client.get("/v1/spend", headers=bearer(tokens["lead"]))).json()
        finance = (await client.get("/v1/spend", headers=bearer(tokens["finance"]))).json()
        spend = (await client.get("/v1/spend", headers=bearer(SPEND))).json()
    assert {r["team"] for r in lead} == {"search"}
    assert {r["team"] for r in finance} == {r["team"] for r in spend}
    assert len(finance) > 1
