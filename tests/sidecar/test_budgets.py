"""Budgets enforced by the sidecar from billing's spend: soft warning, hard refusal, override."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from billing import queries
from billing.ledger import Ledger
from infermeter.config import BudgetSettings
from infermeter.overrides import MAX_OVERRIDE_SECONDS, latest, override_field
from infermeter.spooldir import BUDGET_OVERRIDES
from sidecar.budgets import (
    BudgetExceeded,
    Override,
    billed_overrides,
    judge,
    parse_override,
    parse_spend,
)
from tests.servers import serving

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
ADMIN = {"authorization": "Bearer im-demo-admin"}


class FakeSpend:
    """Billing's ``GET /v1/spend`` over a mutable spend per team."""

    def __init__(self, grant_answer: tuple[int, bytes] | None = None) -> None:
        self.spent: dict[str, float] = {}
        # What billing's override route answers, when it has one (an earlier billing has none).
        self.grant_answer = grant_answer
        self.grants: list[tuple[bytes, dict[str, str]]] = []

    def app(self) -> Starlette:
        """The ASGI app serving /v1/spend (and the override route, with ``grant_answer``)."""

        async def handle(request: Request) -> JSONResponse:
            rows = [
                {
                    "team": t,
                    "month": "2026-12",
                    "spent_usd": s,
                    "budget_usd": 0.0,
                    "forecast_usd": s,
                }
                for t, s in self.spent.items()
            ]
            return JSONResponse(rows)

        async def grant(request: Request) -> Response:
            assert self.grant_answer is not None
            self.grants.append((await request.body(), dict(request.headers)))
            status, body = self.grant_answer
            return Response(body, status, media_type="application/json")

        routes = [Route("/v1/spend", handle)]
        if self.grant_answer is not None:
            routes.append(Route("/v1/admin/budget-overrides", grant, methods=["POST"]))
        return Starlette(routes=routes)


@pytest.mark.parametrize(
    ("spent", "on_exceeded", "model", "state"),
    [
        (10.0, "refuse", "m", "ok"),
        (85.0, "refuse", "m", "soft"),
        (100.0, "refuse", "m", "refused"),
        (150.0, "refuse_non_priority", "vip", "hard"),
        (150.0, "refuse_non_priority", "m", "refused"),
        (150.0, "warn", "m", "hard"),
    ],
)
def test_judge_applies_the_thresholds_and_the_policy(spent, on_exceeded, model, state):
    """Below soft nothing, then a warning, then refusal as on_exceeded says."""
    settings = BudgetSettings(on_exceeded=on_exceeded, priority_models=["vip"])
    try:
        verdict = judge("t", model, spent, 100.0, settings, None, 0.0)
    except BudgetExceeded:
        assert state == "refused"
        return
    assert verdict.state == state
    assert ("x-infermeter-budget-warning" in dict(verdict.headers)) == (state != "ok")


def test_a_team_without_a_budget_is_never_refused():
    """Budget 0 means no budget."""
    assert judge("t", "m", 1e9, 0.0, BudgetSettings(), None, 0.0).state == "ok"


def test_an_override_in_force_lets_a_team_past_its_budget_and_an_expired_one_does_not():
    """An override counts until its end, not after."""
    override = Override("t", 100.0, "launch", 0.0)
    assert judge("t", "m", 200.0, 100.0, BudgetSettings(), override, 50.0).overridden
    with pytest.raises(BudgetExceeded):
        judge("t", "m", 200.0, 100.0, BudgetSettings(), override, 150.0)


@pytest.mark.parametrize(
    ("body", "message", "field"),
    [
        (b"{", "not JSON", None),
        (b'{"team": "nobody", "minutes": 5, "reason": "x"}', "not a configured team", "team"),
        (b'{"team": ["search"], "minutes": 5, "reason": "x"}', "not a configured team", "team"),
        (b'{"team": {"a": 1}, "minutes": 5, "reason": "x"}', "not a configured team", "team"),
        (b'{"team": "search", "minutes": -1, "reason": "x"}', "minutes", "minutes"),
        (b'{"team": "search", "minutes": true, "reason": "x"}', "minutes", "minutes"),
        (b'{"team": "search", "minutes": 44641, "reason": "x"}', "minutes", "minutes"),
        (b'{"team": "search", "minutes": 5, "reason": " "}', "needs a reason", "reason"),
        (b'{"team": "search", "minutes": 5, "reason": "' + b"x" * 501 + b'"}', "at most", "reason"),
    ],
)
def test_parse_override_names_what_is_wrong(body, message, field):
    """A bad override request is refused with the field at fault, its ``param`` (a team of
    another type and a reason too long to keep whole too: neither is a server error, and a
    reason is never cut short)."""
    with pytest.raises(ValueError, match=message) as refused:
        parse_override(body, frozenset({"search"}), 0.0)
    assert override_field(str(refused.value)) == field


def test_minutes_0_is_a_revocation_never_in_force():
    """``minutes`` 0 asks for an override that ends as it is granted: the team's last grant,
    which lets it past its budget at no time, and which ``latest`` prefers to any earlier one."""
    revoked = parse_override(
        b'{"team": "search", "minutes": 0, "reason": "granted by mistake"}',
        frozenset({"search"}),
        1000.0,
    )
    assert revoked == Override("search", 1000.0, "granted by mistake", 1000.0)
    assert not revoked.in_force(1000.0)
    month = {"search": Override("search", 1000.0 + MAX_OVERRIDE_SECONDS, "a month", 900.0)}
    assert latest(month, {"search": revoked}) == {"search": revoked}
    with pytest.raises(BudgetExceeded):
        judge("search", "m", 200.0, 100.0, BudgetSettings(), revoked, 1000.0)


def test_parse_spend_refuses_an_answer_of_another_shape():
    """Spend rows need a team and spent_usd."""
    assert parse_spend([{"team": "a", "spent_usd": 1.5}]) == {"a": 1.5}
    with pytest.raises(ValueError, match="spent_usd"):
        parse_spend([{"team": "a"}])


def test_the_overrides_billing_serves_are_read_with_the_spend_and_bounded():
    """Each row's ``override`` (billing's admin's last grant, in force or ended) is taken as
    billing's route could have granted it; any other entry is left out and the spend beside it
    still read; an answer without overrides (a billing of the previous version) has none."""
    now = 1_000_000.0
    good = {"until": now + 60, "issued_at": now - 1, "reason": "launch"}
    revoked = {"until": now - 30, "issued_at": now - 30, "reason": "taken back"}
    rows = [
        {"team": "search", "spent_usd": 5.0, "override": good},
        {"team": "assistant", "spent_usd": 1.0, "override": revoked},
        {"team": "ops", "spent_usd": 1.0, "override": {**good, "until": now - 2}},
        {"team": "research", "spent_usd": 1.0, "override": {**good, "reason": "x" * 501}},
        {
            "team": "analytics",
            "spent_usd": 1.0,
            "override": {**good, "until": now + 2 * MAX_OVERRIDE_SECONDS},
        },
        {"team": "nobody", "spent_usd": 1.0, "override": good},
        {"team": "other", "spent_usd": 1.0, "override": "always"},
    ]
    teams = frozenset({"search", "assistant", "ops", "research", "analytics", "other"})
    assert parse_spend(rows)["search"] == 5.0
    assert billed_overrides(rows, teams, now) == {
        "search": Override("search", now + 60, "launch", now - 1),
        "assistant": Override("assistant", now - 30, "taken back", now - 30),
    }
    assert billed_overrides([{"team": "search", "spent_usd": 5.0}], teams, now) == {}


def test_the_last_grant_decides_wherever_it_was_made():
    """Per team the override granted last wins, whichever source holds it."""
    sidecar = {"search": Override("search", 500.0, "at a sidecar", 10.0)}
    billing = {
        "search": Override("search", 100.0, "at billing, later, shorter", 20.0),
        "assistant": Override("assistant", 900.0, "at billing", 5.0),
    }
    assert latest(sidecar, billing) == billing
    newer = {"search": Override("search", 700.0, "at a sidecar, last", 30.0)}
    assert latest(sidecar, billing, newer)["search"] == newer["search"]


def test_a_sidecar_applies_the_last_of_billing_s_grants_and_its_own():
    """At each refresh a team's override is the last granted of billing's and this sidecar's
    own (the ones billing did not take), ended or not: an own grant that ended still stands in for billing's earlier
    one; its own grants are let go a month after they were granted."""
    from prometheus_client import CollectorRegistry

    from sidecar.budgets import BudgetGate

    now = time.time()
    gate = BudgetGate(BudgetSettings(), {"search": 100.0, "assistant": 100.0}, CollectorRegistry())
    own = Override("search", now + 600, "at this sidecar", now - 20)
    ended = Override("assistant", now - 1, "at this sidecar, ended", now - 90)
    old = Override(
        "ops", now - MAX_OVERRIDE_SECONDS + 10, "a month ago", now - MAX_OVERRIDE_SECONDS
    )
    gate.granted = {"search": own, "assistant": ended, "ops": old}
    gate.billed = {"assistant": Override("assistant", now + 60, "at billing", now - 100)}
    gate._read_overrides()
    assert gate.overrides == {"search": own, "assistant": ended}
    assert gate.granted == {"search": own, "assistant": ended}
    with pytest.raises(BudgetExceeded):
        judge("assistant", "m", 200.0, 100.0, BudgetSettings(), gate.overrides["assistant"], now)
    later = Override("search", now + 30, "at billing, last", now - 5)
    gate.billed = {"search": later}
    gate._read_overrides()
    assert gate.overrides == {"search": later, "assistant": ended}


async def wait_for(predicate: Any, seconds: float = 3.0) -> None:
    """Poll ``predicate`` until it is true."""
    for _ in range(int(seconds / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition never held")


async def budget_stack(stack_factory: Any, billing: str, redis_url: str) -> Any:
    """A sidecar reading ``billing``'s spend every 0.1 s, overrides shared in Redis, and team
    search's budget at $100."""
    return await stack_factory(
        **{
            "sidecar.budgets": {"spend_url": billing, "refresh_seconds": 0.1},
            "sidecar.shared_limits": {"redis_url": redis_url, "timeout_millis": 2000},
            "teams.0.budget_usd_per_month": 100.0,
        }
    )


async def test_a_team_past_its_hard_budget_is_refused_within_one_refresh_until_overridden(
    stack_factory, redis_server, tmp_path
):
    """Spend past the budget: 429 at the next refresh; an override lets it in and is in the ledger.

    This billing has no override route, so the grant holds on this sidecar only (``scope``
    ``sidecar``, with why), in its spool for the ledger; nothing is written to Redis."""
    spend = FakeSpend()
    async with serving(spend.app(), lifespan="off") as billing:
        stack = await budget_stack(stack_factory, billing, redis_server.url)
        async with stack.client() as c:
            spend.spent["search"] = 85.0

            async def warned() -> bool:
                r = await c.post("/v1/chat/completions", json=CHAT)
                return "x-infermeter-budget-warning" in r.headers

            await wait_for(warned)
            spend.spent["search"] = 100.5

            async def refused() -> bool:
                r = await c.post("/v1/chat/completions", json=CHAT)
                return r.status_code == 429 and bool(r.json()["error"]["code"] == "budget_exceeded")

            await wait_for(refused, 0.5)
            assert (await stack.records())[-1]["status"] == "rate_limited"
            bad = await c.post(
                "/v1/admin/budget-overrides",
                json={"team": "search", "minutes": 5, "reason": "launch"},
            )
            granted = await c.post(
                "/v1/admin/budget-overrides",
                headers=ADMIN,
                json={"team": "search", "minutes": 5, "reason": "launch"},
            )
            through = await c.post("/v1/chat/completions", json=CHAT)
            metrics = await c.get("/metrics", headers=ADMIN)
    assert bad.status_code == 401
    assert granted.status_code == 201
    assert granted.json()["scope"] == "sidecar"
    assert "billing answered 404" in granted.json()["note"]
    assert through.status_code == 200
    assert "x-infermeter-budget-override" in through.headers
    assert 'infermeter_budget_overrides_total{team="search"} 1.0' in metrics.text
    assert 'infermeter_team_budget_used_ratio{team="search"} 1.005' in metrics.text
    assert stack.sidecar.limiter.redis is not None
    assert await stack.sidecar.limiter.redis.keys("*budget-overrides*") == []
    # The override's spool, as its shipper sends it, into a real ledger; the admin's query finds it.
    body = b"".join(
        p.read_bytes() for p in sorted((stack.spool / BUDGET_OVERRIDES).glob("seg-*.jsonl"))
    )
    ledger = Ledger.open(tmp_path / "ledger.duckdb", ["search", "assistant"], {})
    try:
        assert ledger.ingest_lines("budget_overrides", body).accepted == 1
        issued = granted.json()["granted_at"]
        with ledger.reader() as cur:
            rows = queries.run(
                cur, "budget_overrides", queries.params_from(issued - 60, issued + 60)
            )
    finally:
        ledger.close()
    assert rows.select("team", "admin_reason", "issued_by").rows() == [
        ("search", "launch", stack.sidecar.identity.instance)
    ]
    assert rows["until"][0] == pytest.approx(issued + 300)


async def test_an_override_a_pod_writes_into_redis_lifts_no_budget(stack_factory, redis_server):
    """Any pod holding the Redis password can write into the hash where overrides were once
    shared: a day-long override for search, well formed, and garbage beside it. The sidecar
    reads no override from Redis: search is refused past its budget, and its spend is still
    read."""
    spend = FakeSpend()
    async with serving(spend.app(), lifespan="off") as billing:
        stack = await budget_stack(stack_factory, billing, redis_server.url)
        redis = stack.sidecar.limiter.redis
        assert redis is not None
        now = time.time()
        forged = {"team": "search", "until": now + 86400, "reason": "forged", "granted_at": now}
        await redis.hset("infermeter:budget-overrides", b"search", orjson.dumps(forged))
        await redis.hset("infermeter:budget-overrides", b"assistant", b"{not json")
        async with stack.client() as c:
            spend.spent["search"] = 100.5

            async def refused() -> bool:
                r = await c.post("/v1/chat/completions", json=CHAT)
                return bool(r.status_code == 429)

            await wait_for(refused, 1.0)
            spend.spent["search"] = 10.0

            async def served() -> bool:
                r = await c.post("/v1/chat/completions", json=CHAT)
                return bool(r.status_code == 200)

            await wait_for(served, 1.0)  # the spend is still read after the garbage
    assert stack.sidecar.budgets.overrides == {}


@pytest.mark.parametrize(
    ("status", "body", "message", "code"),
    [
        (
            400,
            b'{"error": {"message": "team: \'search\' is not a configured team", '
            b'"type": "invalid_request_error", "param": "team", "code": "invalid_override"}}',
            "Billing refused the override (HTTP 400): team: 'search' is not a configured team",
            "invalid_override",
        ),
        (
            403,
            b"<html>forbidden</html>",
            "Billing refused the override (HTTP 403).",
            "override_refused",
        ),
    ],
)
async def test_an_override_billing_refuses_is_granted_nowhere(
    stack_factory, redis_server, status, body, message, code
):
    """Billing refuses the admin's request passed on to it (a team it does not know, the
    credential): the admin gets billing's status and reason, and the sidecar grants nothing of
    its own (no spool record, the team still refused past its budget)."""
    spend = FakeSpend(grant_answer=(status, body))
    async with serving(spend.app(), lifespan="off") as billing:
        stack = await budget_stack(stack_factory, billing, redis_server.url)
        async with stack.client() as c:
            spend.spent["search"] = 100.5

            async def refused() -> bool:
                r = await c.post("/v1/chat/completions", json=CHAT)
                return bool(r.status_code == 429)

            await wait_for(refused)
            asked = await c.post(
                "/v1/admin/budget-overrides",
                headers=ADMIN,
                json={"team": "search", "minutes": 5, "reason": "launch"},
            )
            after = await c.post("/v1/chat/completions", json=CHAT)
    assert len(spend.grants) == 1
    assert asked.status_code == status
    assert asked.json()["error"]["message"] == message
    assert asked.json()["error"]["code"] == code
    assert after.status_code == 429
    assert not list((stack.spool / BUDGET_OVERRIDES).glob("seg-*.jsonl"))


async def test_an_override_request_the_sidecar_cannot_read_is_a_clear_error(
    stack_factory, monkeypatch
):
    """A body over 64 KiB is 413, one that does not arrive in time 408, one that is not an
    override 400 naming the field: OpenAI-style errors, never the server's 500."""
    monkeypatch.setattr("sidecar.budgets._BODY_TIMEOUT_SECONDS", 0.3)
    stack = await stack_factory()
    async with stack.client() as c:
        large = await c.post(
            "/v1/admin/budget-overrides",
            headers=ADMIN,
            content=b'{"team": "search", "reason": "' + b"x" * 70_000 + b'"}',
        )
        listed = await c.post(
            "/v1/admin/budget-overrides",
            headers=ADMIN,
            json={"team": ["search"], "minutes": 5, "reason": "x"},
        )

        parts = (b'{"team": "search", ', b'"minutes": 5, "reason": "x"}')

        async def trickle() -> AsyncIterator[bytes]:
            yield parts[0]
            await asyncio.sleep(2)
            yield parts[1]

        slow = await c.post(
            "/v1/admin/budget-overrides",
            headers={**ADMIN, "content-length": str(len(b"".join(parts)))},
            content=trickle(),
        )
    assert (large.status_code, large.json()["error"]["code"]) == (413, "request_too_large")
    assert (listed.status_code, listed.json()["error"]["param"]) == (400, "team")
    assert (slow.status_code, slow.json()["error"]["code"]) == (408, "request_timeout")


async def test_a_grant_billing_takes_is_passed_on_as_the_admin_asked_it(
    stack_factory, redis_server
):
    """The admin's body and credential go to billing as they came, with the admin's address
    (``x-forwarded-for``, for billing's audit trail); billing's grant is the answer, ``fleet``."""
    now = time.time()
    taken = {"team": "search", "until": now + 300, "reason": "launch", "granted_at": now}
    spend = FakeSpend(grant_answer=(201, orjson.dumps(taken)))
    body = b'{"team": "search", "minutes": 5, "reason": "launch"}'
    async with serving(spend.app(), lifespan="off") as billing:
        stack = await budget_stack(stack_factory, billing, redis_server.url)
        async with stack.client() as c:
            asked = await c.post("/v1/admin/budget-overrides", headers=ADMIN, content=body)
    [(sent, headers)] = spend.grants
    assert asked.status_code == 201, asked.text
    assert asked.json()["scope"] == "fleet"
    assert asked.json()["until"] == taken["until"]
    assert sent == body
    assert headers["authorization"] == ADMIN["authorization"]
    assert headers["x-forwarded-for"] == "127.0.0.1"
