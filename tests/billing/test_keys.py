"""Keys issued at run time through billing's API over real loopback HTTP, kept in a DuckDB file."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config
from tests.billing.conftest import bearer
from tests.conftest import config_ledger
from tests.servers import serving

ADMIN, SEARCH, SPEND = "im-demo-admin", "im-demo-search", "im-demo-spend"


@pytest.fixture
async def billing(config: Config, tmp_path: Path) -> AsyncIterator[tuple[str, Ledger]]:
    """Billing on a ledger file, on a loopback port; the ledger beside its URL."""
    path = tmp_path / "ledger.duckdb"
    ledger = config_ledger(config, path)
    try:
        async with serving(create_app(config, ledger), lifespan="off") as url:
            yield url, ledger
    finally:
        ledger.close()


def ledger_files(ledger: Ledger) -> list[Path]:
    """The ledger's file and its write-ahead log, whichever exist."""
    with ledger.reader() as cur:
        row = cur.execute(
            "SELECT path FROM duckdb_databases() WHERE database_name = current_database()"
        ).fetchone()
    assert row is not None
    main = Path(row[0])
    return [p for p in (main, main.with_name(main.name + ".wal")) if p.exists()]


async def issue(client: httpx.AsyncClient, token: str, **request: object) -> httpx.Response:
    return await client.post("/v1/keys", json=request, headers=bearer(token))


async def test_an_issued_key_is_shown_once_and_only_its_digest_is_kept(billing):
    """The secret is in the creating answer; the ledger file holds its SHA-256 and not the secret."""
    url, ledger = billing
    async with httpx.AsyncClient(base_url=url) as client:
        made = await issue(
            client, ADMIN, team="search", member="ana", project="rag", reason="new service"
        )
        assert made.status_code == 201, made.text
        body = made.json()
        secret = body["key"]
        assert made.headers["cache-control"] == "no-store"
        listed = (await client.get("/v1/keys", headers=bearer(ADMIN))).json()["keys"]
        assert [k["key_id"] for k in listed] == [body["key_id"]]
        assert "key" not in listed[0]
        assert "digest" not in listed[0]
        # The key works at once, as its team, for the team's data only.
        spend = await client.get("/v1/spend", headers=bearer(secret))
        assert spend.status_code == 200
        assert {row["team"] for row in spend.json()} == {"search"}
        whoami = (await client.get("/v1/query", headers=bearer(secret))).json()["caller"]
        assert whoami["team"] == "search"
        assert whoami["who"] == f"key:{body['key_id']}"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    with ledger.reader() as cur:
        assert cur.execute("SELECT digest, member, project FROM api_keys").fetchall() == [
            (digest, "ana", "rag")
        ]
        cur.execute("CHECKPOINT")
    files = list(ledger_files(ledger))
    assert files
    assert all(secret.encode() not in p.read_bytes() for p in files)


async def test_a_revoked_key_is_refused_at_once_and_the_change_is_audited(billing):
    """Revoking answers only after billing refuses the key; the audit trail says who, what, why."""
    url, _ = billing
    async with httpx.AsyncClient(base_url=url) as client:
        body = (await issue(client, ADMIN, team="search")).json()
        assert (await client.get("/v1/spend", headers=bearer(body["key"]))).status_code == 200
        gone = await client.post(
            f"/v1/keys/{body['key_id']}/revoke", json={"reason": "leaked"}, headers=bearer(ADMIN)
        )
        assert gone.status_code == 200
        assert gone.json()["revoked_at"] is not None
        refused = await client.get("/v1/spend", headers=bearer(body["key"]))
        assert refused.status_code == 401
        trail = (await client.get("/v1/audit", headers=bearer(ADMIN))).json()["events"]
    assert [(e["action"], e["actor"], e["target"], e["why"]) for e in trail] == [
        ("key.created", "@admin", f"key:{body['key_id']}", ""),
        ("key.revoked", "@admin", f"key:{body['key_id']}", "leaked"),
    ]
    assert trail[1]["address"] == "127.0.0.1"
    assert trail[1]["source"] == "billing"


async def test_rotation_replaces_a_key_and_a_grace_period_keeps_the_old_one_briefly(billing):
    """A rotated key's successor works; the old one stops at once, or when its grace ends."""
    url, _ = billing
    async with httpx.AsyncClient(base_url=url) as client:
        old = (await issue(client, ADMIN, team="research", project="eval")).json()
        new = await client.post(f"/v1/keys/{old['key_id']}/rotate", json={}, headers=bearer(ADMIN))
        assert new.status_code == 201
        fresh = new.json()
        assert fresh["project"] == "eval"
        assert fresh["team"] == "research"
        assert (await client.get("/v1/spend", headers=bearer(fresh["key"]))).status_code == 200
        assert (await client.get("/v1/spend", headers=bearer(old["key"]))).status_code == 401
        graced = (await issue(client, ADMIN, team="research")).json()
        later = (
            await client.post(
                f"/v1/keys/{graced['key_id']}/rotate",
                json={"grace_seconds": 1.5},
                headers=bearer(ADMIN),
            )
        ).json()
        assert (await client.get("/v1/spend", headers=bearer(graced["key"]))).status_code == 200
        time.sleep(1.6)
        assert (await client.get("/v1/spend", headers=bearer(graced["key"]))).status_code == 401
        assert (await client.get("/v1/spend", headers=bearer(later["key"]))).status_code == 200


async def test_an_expired_key_is_refused(billing):
    """A key whose expiry has passed is refused like a revoked one."""
    url, _ = billing
    async with httpx.AsyncClient(base_url=url) as client:
        body = (await issue(client, ADMIN, team="search", expires_in_seconds=1)).json()
        assert (await client.get("/v1/spend", headers=bearer(body["key"]))).status_code == 200
        time.sleep(1.1)
        assert (await client.get("/v1/spend", headers=bearer(body["key"]))).status_code == 401


@pytest.fixture
async def bounded(config: Config, tmp_path: Path) -> AsyncIterator[tuple[str, Ledger]]:
    """Billing as ``billing`` serves it, with ``billing.max_keys_per_team`` at 3."""
    limited = config.model_copy(
        update={"billing": config.billing.model_copy(update={"max_keys_per_team": 3})}
    )
    ledger = config_ledger(limited, tmp_path / "ledger.duckdb")
    try:
        async with serving(create_app(limited, ledger), lifespan="off") as url:
            yield url, ledger
    finally:
        ledger.close()


async def active_ids(client: httpx.AsyncClient) -> set[str]:
    """The ids of the set the sidecars read."""
    keys = (await client.get("/v1/keys/active", headers=bearer(SPEND))).json()["keys"]
    return {k["key_id"] for k in keys}


async def test_a_team_lead_cannot_grow_its_keys_past_the_bound(bounded):
    """A lead holds at most max_keys_per_team keys in force for its team (its own included):
    one more is a 400 naming the bound, with nothing written; another team is not held back;
    a rotation with a grace period needs a free place, one without keeps the count, and a
    revocation makes room."""
    url, _ = bounded
    async with httpx.AsyncClient(base_url=url) as client:
        lead = (await issue(client, ADMIN, team="search", role="lead")).json()
        made = [(await issue(client, lead["key"], team="search", member=f"m{i}")) for i in range(2)]
        assert [r.status_code for r in made] == [201, 201]
        before = await active_ids(client)
        refused = await issue(client, lead["key"], team="search", member="m2")
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "too_many_keys"
        assert "team 'search' already has 3 keys in force" in error["message"]
        assert "billing.max_keys_per_team (3)" in error["message"]
        assert await active_ids(client) == before
        assert (await issue(client, ADMIN, team="research")).status_code == 201
        first = made[0].json()["key_id"]
        graced = await client.post(
            f"/v1/keys/{first}/rotate", json={"grace_seconds": 60}, headers=bearer(lead["key"])
        )
        assert graced.status_code == 400
        assert graced.json()["error"]["code"] == "too_many_keys"
        rotated = await client.post(
            f"/v1/keys/{first}/rotate", json={}, headers=bearer(lead["key"])
        )
        assert rotated.status_code == 201
        assert (await issue(client, lead["key"], team="search")).status_code == 400
        revoked = await client.post(
            f"/v1/keys/{rotated.json()['key_id']}/revoke", headers=bearer(lead["key"])
        )
        assert revoked.status_code == 200
        assert (await issue(client, lead["key"], team="search", member="m3")).status_code == 201


async def test_keys_asked_for_at_once_never_pass_the_bound(bounded):
    """Twelve requests for a key of one team at once: exactly the bound's three are issued."""
    url, _ = bounded
    async with httpx.AsyncClient(base_url=url) as client:
        answers = await asyncio.gather(
            *(issue(client, ADMIN, team="search", member=f"m{i}") for i in range(12))
        )
        assert sorted(r.status_code for r in answers) == [201] * 3 + [400] * 9
        assert len(await active_ids(client)) == 3


async def test_an_expired_key_leaves_the_set_and_makes_room(bounded):
    """Keys that expired neither count against the bound nor stay in the sidecars' set."""
    url, _ = bounded
    async with httpx.AsyncClient(base_url=url) as client:
        short = [
            (await issue(client, ADMIN, team="search", expires_in_seconds=1)).json()["key_id"]
            for _ in range(3)
        ]
        assert await active_ids(client) == set(short)
        time.sleep(1.1)
        fresh = await issue(client, ADMIN, team="search")
        assert fresh.status_code == 201
        assert await active_ids(client) == {fresh.json()["key_id"]}


@pytest.mark.parametrize(
    ("request_body", "message"),
    [
        ({"team": "nobody"}, "team 'nobody': no such team"),
        ({"role": "admin"}, "role 'admin'"),
        ({"role": "finance", "team": "search"}, "team: a finance key belongs to no team"),
        ({"team": "search", "expires_in_seconds": -5}, "expiry"),
        ({"team": "search", "requests_per_minute": 0}, "requests_per_minute"),
        ({"team": "search", "colour": "red"}, "unknown field(s): colour"),
        ({"team": "search", "member": "a b"}, "member 'a b'"),
    ],
)
async def test_a_key_that_cannot_be_issued_is_refused_with_the_reason(
    billing, request_body, message
):
    """Each bad request is a 400 naming the field, and nothing is issued."""
    url, _ = billing
    async with httpx.AsyncClient(base_url=url) as client:
        refused = await client.post("/v1/keys", json=request_body, headers=bearer(ADMIN))
        assert refused.status_code == 400
        assert message in refused.json()["error"]["message"]
        assert (await client.get("/v1/keys", headers=bearer(ADMIN))).json()["keys"] == []


async def test_the_sidecars_read_the_set_in_force_and_a_304_while_it_is_unchanged(billing):
    """The spend_reader gets the digests and limits, and its version back as a 304."""
    url, _ = billing
    async with httpx.AsyncClient(base_url=url) as client:
        empty = await client.get("/v1/keys/active", headers=bearer(SPEND))
        assert empty.status_code == 200
        assert empty.json() == {"version": 0, "keys": []}
        body = (await issue(client, ADMIN, team="search", requests_per_minute=5)).json()
        found = await client.get("/v1/keys/active", headers=bearer(SPEND))
        assert found.json()["version"] == 1
        [key] = found.json()["keys"]
        assert key["key_id"] == body["key_id"]
        assert key["requests_per_minute"] == 5
        assert key["digest"] == hashlib.sha256(body["key"].encode()).hexdigest()
        same = await client.get("/v1/keys/active", headers=bearer(SPEND) | {"if-none-match": '"1"'})
        assert same.status_code == 304
        assert (await client.get("/v1/keys/active", headers=bearer(SEARCH))).status_code == 403


async def test_issued_keys_survive_a_restart_of_billing(config, tmp_path):
    """The keys are in the ledger file: a billing started again takes them."""
    path = tmp_path / "ledger.duckdb"
    teams = [t.name for t in config.teams]
    slas = {m.name: m.sla.ttft_p95_seconds for m in config.models}
    ledger = Ledger.open(path, teams, slas)
    async with (
        serving(create_app(config, ledger), lifespan="off") as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        secret = (await issue(client, ADMIN, team="search")).json()["key"]
    ledger.close()
    ledger = Ledger.open(path, teams, slas)
    try:
        async with (
            serving(create_app(config, ledger), lifespan="off") as url,
            httpx.AsyncClient(base_url=url) as client,
        ):
            assert (await client.get("/v1/spend", headers=bearer(secret))).status_code == 200
    finally:
        ledger.close()


async def test_no_key_a_lead_issues_outlives_the_leads_own_key(billing):
    """A lead's key bounds the keys it issues: none may expire after it (asked for none, one
    ends with it), and revoking the lead revokes every key it issued or rotated, on the trail;
    keys issued by the admin or another lead stay."""
    url, _ = billing
    async with httpx.AsyncClient(base_url=url) as client:
        lead = (
            await issue(client, ADMIN, team="search", role="lead", expires_in_seconds=600)
        ).json()
        other = (await issue(client, ADMIN, team="search", role="lead")).json()
        longer = await issue(
            client, lead["key"], team="search", expires_in_seconds=10 * 365 * 86400
        )
        assert longer.status_code == 400
        assert "the lead's own key" in longer.json()["error"]["message"]
        made = await issue(client, lead["key"], team="search", member="ana")
        assert made.status_code == 201
        assert made.json()["expires_at"] == lead["expires_at"]
        admins = (await issue(client, ADMIN, team="search", member="bo")).json()
        rotated = await client.post(
            f"/v1/keys/{admins['key_id']}/rotate", headers=bearer(lead["key"])
        )
        assert rotated.status_code == 201
        assert rotated.json()["expires_at"] == lead["expires_at"]
        kept = (await issue(client, other["key"], team="search", member="cy")).json()
        gone = await client.post(
            f"/v1/keys/{lead['key_id']}/revoke", json={"reason": "left"}, headers=bearer(ADMIN)
        )
        assert gone.status_code == 200
        for key in (lead["key"], made.json()["key"], rotated.json()["key"]):
            assert (await client.get("/v1/spend", headers=bearer(key))).status_code == 401
        assert (await client.get("/v1/spend", headers=bearer(kept["key"]))).status_code == 200
        trail = (await client.get("/v1/audit", headers=bearer(ADMIN))).json()["events"]
    revoked = {e["target"]: e for e in trail if e["action"] == "key.revoked"}
    assert set(revoked) == {
        f"key:{lead['key_id']}",
        f"key:{made.json()['key_id']}",
        f"key:{rotated.json()['key_id']}",
    }
    assert revoked[f"key:{made.json()['key_id']}"]["actor"] == "@admin"
    assert f"key:{lead['key_id']}" in revoked[f"key:{made.json()['key_id']}"]["why"]


@pytest.mark.parametrize(
    ("action", "body", "param", "message"),
    [
        ("rotate", {"grace_seconds": "abc"}, "grace_seconds", "grace_seconds: Input should be"),
        ("rotate", {"grace_seconds": "10"}, "grace_seconds", "grace_seconds: Input should be"),
        ("rotate", {"grace_seconds": 604801}, "grace_seconds", "grace_seconds: from 0 to 604800"),
        ("revoke", {"reason": 7}, "reason", "reason: Input should be a valid string"),
        ("revoke", {"reson": "typo"}, "reson", "reson: unknown field"),
    ],
)
async def test_a_bad_key_change_is_one_line_naming_its_field(billing, action, body, param, message):
    """A revocation or rotation whose body is not a key change: 400 with the field as ``param``
    and one line saying what is wrong with it (a number as text is refused, not read); the key
    still works."""
    url, _ = billing
    async with httpx.AsyncClient(base_url=url) as client:
        made = (await issue(client, ADMIN, team="search")).json()
        r = await client.post(
            f"/v1/keys/{made['key_id']}/{action}", json=body, headers=bearer(ADMIN)
        )
        still = await client.get("/v1/spend", headers=bearer(made["key"]))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value")
    assert error["message"].startswith(message)
    assert "\n" not in error["message"]
    assert "pydantic" not in error["message"]
    assert still.status_code == 200
