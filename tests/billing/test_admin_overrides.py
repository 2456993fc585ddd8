"""Budget overrides granted at billing by its admin, and the ones ``GET /v1/spend`` serves.

Real billing on loopback over a DuckDB ledger that knows the demo fleet, holding the writer
secret, so a sidecar's instance credential ships overrides through ingest as in a cluster. Billing
serves the sidecars only the overrides its own admin granted: a row a sidecar shipped (any pod's
credential may ship one) is kept for the record and never served to the fleet.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing import overrides
from billing.ledger import Ledger
from infermeter.config import load_config
from infermeter.ids import sample_id
from infermeter.overrides import MAX_OVERRIDE_SECONDS, Override, override_record
from infermeter.records import BudgetOverride
from tests.security import writers as writer_fixtures
from tests.security.writers import SMALL_0, bearer, billing, post

ADMIN, SEARCH, SPEND, INGEST = "im-demo-admin", "im-demo-search", "im-demo-spend", "im-demo-ingest"
ROUTE = "/v1/admin/budget-overrides"
GRANT = {"team": "search", "minutes": 30, "reason": "launch week, ticket FIN-12"}


# The demo configuration as it ships, a ledger of its fleet and billing over it (writer secret on).
strict, ledger, url = writer_fixtures.strict, writer_fixtures.ledger, writer_fixtures.url


async def grant(url: str, token: str, body: Any = None, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url) as client:
        return await client.post(
            ROUTE, json=GRANT if body is None else body, headers=bearer(token), **kw
        )


async def spend_overrides(url: str, token: str = SPEND) -> dict[str, dict[str, Any]]:
    """The ``override`` of each row of ``GET /v1/spend`` that carries one, by team."""
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.get("/v1/spend", headers=bearer(token))
    assert r.status_code == 200, r.text
    return {row["team"]: row["override"] for row in r.json() if "override" in row}


def rows(ledger: Ledger, sql: str) -> list[tuple[Any, ...]]:
    with ledger.reader() as cur:
        return cur.execute(sql).fetchall()


async def test_the_admin_grants_at_billing_and_every_spend_reader_sees_it(url, ledger):
    """201 with the override; its row in the ledger issued by billing's admin, its event on the
    audit trail; /v1/spend carries it on search's row for the sidecars (and for search), on no
    other team's."""
    before = time.time()
    r = await grant(url, ADMIN)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["team"] == "search"
    assert body["reason"] == GRANT["reason"]
    assert body["issued_by"] == "billing:@admin"
    assert before + 1800 <= body["until"] <= time.time() + 1800
    assert rows(
        ledger, "SELECT override_id, team, admin_reason, until, issued_by FROM budget_overrides"
    ) == [(body["override_id"], "search", GRANT["reason"], body["until"], "billing:@admin")]
    assert rows(
        ledger, "SELECT action, actor, actor_role, source, target, why FROM audit_events"
    ) == [("budget.override", "@admin", "admin", "billing", "team:search", GRANT["reason"])]
    served = {"until": body["until"], "issued_at": body["granted_at"], "reason": GRANT["reason"]}
    assert await spend_overrides(url) == {"search": served}
    assert await spend_overrides(url, SEARCH) == {"search": served}
    assert await spend_overrides(url, ADMIN) == {"search": served}


@pytest.mark.parametrize(
    ("token", "status"),
    [
        (SEARCH, 403),  # a team's key
        ("im-demo-metrics", 403),
        (SPEND, 403),  # what every sidecar holds
        (SMALL_0.token, 401),  # a sidecar's instance credential
        (INGEST, 403),
        ("not-a-key", 401),
    ],
)
async def test_no_credential_but_the_admin_grants_one(url, ledger, token, status):
    """Refused with the OpenAI error shape; nothing in the ledger, nothing served."""
    r = await grant(url, token)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] in ("forbidden", "invalid_api_key")
    assert rows(ledger, "SELECT count(*) FROM budget_overrides") == [(0,)]
    assert await spend_overrides(url) == {}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{", None),
        (b"[1]", None),
        ({"team": "nobody", "minutes": 5, "reason": "x"}, "team"),
        ({"minutes": 5, "reason": "x"}, "team"),
        ({"team": "search", "minutes": -0.5, "reason": "x"}, "minutes"),
        ({"team": "search", "minutes": True, "reason": "x"}, "minutes"),
        ({"team": "search", "minutes": 44641, "reason": "x"}, "minutes"),
        ({"team": "search", "minutes": "5", "reason": "x"}, "minutes"),
        ({"team": "search", "minutes": 5, "reason": "  "}, "reason"),
        ({"team": "search", "minutes": 5}, "reason"),
        ({"team": ["search"], "minutes": 5, "reason": "x"}, "team"),
        ({"team": {"search": 1}, "minutes": 5, "reason": "x"}, "team"),
        ({"team": "search", "minutes": 5, "reason": "x" * 501}, "reason"),
    ],
)
async def test_a_bad_body_is_400_naming_the_field(url, ledger, body, param):
    """The sidecar's checks, answered in billing's error shape with ``param``; nothing kept (a
    team that is not a string is no server error, a reason too long to keep is not cut)."""
    async with httpx.AsyncClient(base_url=url) as client:
        if isinstance(body, bytes):
            r = await client.post(ROUTE, content=body, headers=bearer(ADMIN))
        else:
            r = await client.post(ROUTE, json=body, headers=bearer(ADMIN))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_override"
    assert error["param"] == param
    if param is not None:
        assert error["message"].startswith(f"{param}:")
    assert rows(ledger, "SELECT count(*) FROM budget_overrides") == [(0,)]


async def test_a_body_over_the_bound_is_413(url, ledger):
    """The body is read under a cap, as every billing body is."""
    big = {**GRANT, "reason": "x" * (70 * 1024)}
    r = await grant(url, ADMIN, big)
    assert r.status_code == 413
    assert rows(ledger, "SELECT count(*) FROM budget_overrides") == [(0,)]


async def test_an_override_is_served_in_force_then_ended(url):
    """Granted for 0.02 minutes (1.2 s): in /v1/spend at once, and still there after its end,
    ended (its ``until`` past): as the team's last grant it ends any earlier one at every
    sidecar."""
    r = await grant(url, ADMIN, {**GRANT, "minutes": 0.02})
    assert r.status_code == 201, r.text
    served = {
        "until": r.json()["until"],
        "issued_at": r.json()["granted_at"],
        "reason": GRANT["reason"],
    }
    assert await spend_overrides(url) == {"search": served}
    await asyncio.sleep(max(0.0, served["until"] - time.time()) + 0.2)
    assert await spend_overrides(url) == {"search": served}
    assert served["until"] < time.time()


async def test_minutes_0_revokes_the_team_s_override(url, ledger):
    """A month-long grant, then ``minutes`` 0: the revocation is the team's last grant, served
    ended (``until`` its own time); both are in the ledger and on the audit trail."""
    month = await grant(url, ADMIN, {**GRANT, "minutes": 44640})
    assert month.status_code == 201, month.text
    revoked = await grant(url, ADMIN, {**GRANT, "minutes": 0, "reason": "granted by mistake"})
    assert revoked.status_code == 201, revoked.text
    body = revoked.json()
    assert body["until"] == body["granted_at"] > month.json()["granted_at"]
    assert await spend_overrides(url) == {
        "search": {
            "until": body["until"],
            "issued_at": body["until"],
            "reason": "granted by mistake",
        }
    }
    assert rows(
        ledger, "SELECT admin_reason, until - issued_at FROM budget_overrides ORDER BY issued_at"
    ) == [
        (GRANT["reason"], 44640 * 60.0),
        ("granted by mistake", 0.0),
    ]
    assert rows(ledger, "SELECT action, why FROM audit_events ORDER BY occurred_at") == [
        ("budget.override", GRANT["reason"]),
        ("budget.override", "granted by mistake"),
    ]


def _shipped(team: str = "search", issued_by: str = "small-0") -> dict[str, Any]:
    """An override as small-0's sidecar ships it, granted a second ago for an hour."""
    at = time.time() - 1
    return BudgetOverride(
        sample_id(at, issued_by, team), team, "asked at the sidecar", at + 3600, at, issued_by
    ).to_json()


async def test_an_override_a_sidecar_shipped_is_kept_and_never_served(url, ledger):
    """small-0's credential ships an override through ingest: kept in the ledger for the record,
    absent from /v1/spend (any pod's credential could have shipped it)."""
    async with httpx.AsyncClient() as client:
        r = await post(client, url, "budget_overrides", [_shipped()], SMALL_0)
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 1
    assert rows(ledger, "SELECT team, issued_by FROM budget_overrides") == [("search", "small-0")]
    assert await spend_overrides(url) == {}


async def test_no_writer_can_ship_an_override_named_as_billing_s(strict, ledger, url):
    """An override shipped as issued by ``billing:@admin`` is refused from an instance credential
    and from the shared ingest token of earlier releases alike: served otherwise."""
    forged = _shipped(issued_by="billing:@admin")
    allowed = load_config(None, environ={"INFERMETER__BILLING__SHARED_INGEST_TOKEN": "true"})
    async with httpx.AsyncClient() as client:
        by_pod = await post(client, url, "budget_overrides", [forged], SMALL_0)
        async with billing(allowed, ledger) as legacy:
            by_token = await post(client, legacy, "budget_overrides", [forged], INGEST)
    assert by_pod.json()["accepted"] == 0
    assert by_token.status_code == 200, by_token.text
    assert by_token.json()["accepted"] == 0
    assert "billing's own grants" in by_token.json()["rejected"][0]["reason"]
    assert rows(ledger, "SELECT count(*) FROM budget_overrides") == [(0,)]
    assert await spend_overrides(url) == {}


def test_the_last_grant_decides_ended_or_not(ledger):
    """Per team the last grant at billing in the last month is served, in force or ended: a
    later, shorter grant that has ended is served, so the earlier, longer one never comes back;
    a grant older than a month is not read; sidecars' rows never count."""
    now = time.time()
    grants = [
        (Override("search", now + 3600, "long", now - 100), "billing:@admin"),
        (Override("search", now - 1, "short, ended", now - 50), "billing:@admin"),
        (Override("assistant", now + 600, "first", now - 100), "billing:@admin"),
        (Override("assistant", now + 300, "second", now - 10), "billing:@admin"),
        (Override("assistant", now + 3000, "a pod's", now - 1), "small-0"),
        (Override("ops", now - 10, "long ago", now - 10 - MAX_OVERRIDE_SECONDS), "billing:@admin"),
    ]
    for override, by in grants:
        with ledger.writing() as cur:
            overrides.keep(cur, override_record(override, by), now)
    with ledger.reader() as cur:
        found = overrides.last_grants(cur, now)
    assert found == {
        "search": {"until": now - 1, "issued_at": now - 50, "reason": "short, ended"},
        "assistant": {"until": now + 300, "issued_at": now - 10, "reason": "second"},
    }


async def test_billing_s_metrics_show_the_override_in_force_until_its_revocation(url):
    """``infermeter_team_budget_override_until_seconds{team}``: search's end while its grant is
    in force, no sample once revoked; no other team has one."""

    async def gauges() -> dict[str, float]:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.get("/metrics", headers=bearer("im-demo-metrics"))
        assert r.status_code == 200, r.text
        found = {}
        for family in text_string_to_metric_families(r.text):
            if family.name == "infermeter_team_budget_override_until_seconds":
                found = {s.labels["team"]: s.value for s in family.samples}
        return found

    assert await gauges() == {}
    granted = await grant(url, ADMIN)
    assert await gauges() == {"search": pytest.approx(granted.json()["until"])}
    revoked = await grant(url, ADMIN, {**GRANT, "minutes": 0})
    assert revoked.status_code == 201, revoked.text
    assert await gauges() == {}


@pytest.mark.parametrize(
    ("forwarded", "kept"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("2001:db8::7, 10.0.0.9", "2001:db8::7"),
        ("<script>", None),
        (None, None),
    ],
)
async def test_a_grant_passed_on_keeps_the_address_it_was_asked_from(url, ledger, forwarded, kept):
    """A sidecar passing an admin's grant on says where the admin asked from
    (``x-forwarded-for``): the event keeps it as ``forwarded_for`` beside the peer billing saw
    (the sidecar), one IP address or nothing, never the header's text."""
    headers = bearer(ADMIN) | ({"x-forwarded-for": forwarded} if forwarded else {})
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post(ROUTE, json=GRANT, headers=headers)
    assert r.status_code == 201, r.text
    [(address, detail)] = rows(ledger, "SELECT address, detail FROM audit_events")
    assert address == "127.0.0.1"
    assert orjson.loads(detail).get("forwarded_for") == kept
