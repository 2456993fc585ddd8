"""Overrides the admin grants at billing reach every sidecar, with or without Redis.

Real ``infermeter sidecar`` processes for small-0 and small-1 in front of one simulated replica,
reading one real billing (a DuckDB file holding this month's usage of team search, priced from
its GPU samples) over HTTP with the spend_reader token. Without Redis an override granted at one
sidecar reaches only that one; granted at billing it reaches both within a spend refresh, and it
is in no Redis, so a Redis that loses its keys loses nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_py

from billing.api import create_app
from infermeter.serving import free_port
from tests.billing.conftest import batch, gpu_samples, usage
from tests.conftest import config_ledger
from tests.redis_server import RedisServer
from tests.servers import serving
from tests.sidecar.conftest import KEYS
from tests.sidecar.two_sidecars import TwoSidecars

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SEARCH = {"authorization": f"Bearer {KEYS['search']}"}
ADMIN = {"authorization": "Bearer im-demo-admin"}
OVERRIDE = "x-infermeter-budget-override"


@pytest.fixture(autouse=True)
def spend_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecars hold the spend_reader token, as the demo gives them (their processes
    inherit it)."""
    monkeypatch.setenv("INFERMETER_SPEND_TOKEN", "im-demo-spend")


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's redis-server, flushed and restarted empty by its tests."""
    server = RedisServer(tmp_path_factory.mktemp("redis-billing-overrides"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def shared(redis: RedisServer) -> dict[str, Any]:
    """The module's redis-server, running and empty, as the sidecars' shared limits."""
    if redis.process is None:
        redis.start()
    redis.flush()
    return {"shared_limits": {"redis_url": redis.url, "timeout_millis": 500, "retry_seconds": 0.2}}


@contextlib.asynccontextmanager
async def _fleet(tmp_path: Path, sidecar: dict[str, Any]) -> AsyncIterator[tuple[str, list[str]]]:
    """Billing over a ledger file in which search spent this month (ten minutes of small-0's GPU,
    well past its budget of one cent), and small-0's and small-1's sidecars reading its spend
    every 0.1 s; yields billing's URL and the sidecars'."""
    port = free_port()
    fleet = TwoSidecars(
        tmp_path,
        {"budgets": {"spend_url": f"http://127.0.0.1:{port}", "refresh_seconds": 0.1}, **sidecar},
        {"budget_usd_per_month": 0.01},
    )
    ledger = config_ledger(fleet.config, tmp_path / "ledger.duckdb")
    now = time.time()
    start = now - 900
    for kind, records in (
        ("gpu_samples", gpu_samples("small-0", start, 600.0)),
        ("usage", [usage("search", start + 10, 580.0)]),
    ):
        assert ledger.ingest(batch(kind, records), now=now).rejected == []
    try:
        app = create_app(fleet.config, ledger, statement_ttl_seconds=0.2)
        async with serving(app, port, lifespan="off") as billing, fleet.running() as urls:
            yield billing, urls
    finally:
        ledger.close()


async def _answers(c: httpx.AsyncClient, urls: list[str]) -> list[httpx.Response]:
    return [await c.post(f"{u}/v1/chat/completions", json=CHAT, headers=SEARCH) for u in urls]


async def _rounds(c: httpx.AsyncClient, urls: list[str]) -> list[list[httpx.Response]]:
    """Five rounds of answers over half a second: several spend refreshes of each sidecar."""
    rounds = []
    for _ in range(5):
        rounds.append(await _answers(c, urls))
        await asyncio.sleep(0.1)
    return rounds


async def _until(c: httpx.AsyncClient, urls: list[str], want: list[int], seconds: float) -> float:
    """Seconds until every sidecar answers search ``want``; AssertionError after ``seconds``."""
    loop = asyncio.get_running_loop()
    begin = loop.time()
    got: list[int] = []
    while loop.time() - begin < seconds:
        got = [r.status_code for r in await _answers(c, urls)]
        if got == want:
            return loop.time() - begin
        await asyncio.sleep(0.05)
    raise AssertionError(f"answers {got}, not {want}, after {seconds} s")


async def _overrides(c: httpx.AsyncClient, billing: str) -> list[dict[str, Any]]:
    """The ledger's budget overrides, as billing's admin lists them."""
    now = time.time()
    r = await c.get(
        f"{billing}/v1/query/budget_overrides",
        params={"from": now - 3600, "to": now + 3600},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    columns = r.json()["columns"]
    rows = [dict(zip(columns, row, strict=True)) for row in r.json()["rows"]]
    return sorted(rows, key=lambda row: row["issued_at"])


async def _grant(c: httpx.AsyncClient, at: str, minutes: float = 30) -> httpx.Response:
    """The admin grants search an override of ``minutes`` at ``at`` (billing or a sidecar)."""
    r = await c.post(
        f"{at}/v1/admin/budget-overrides",
        headers=ADMIN,
        json={"team": "search", "minutes": minutes, "reason": "launch week"},
    )
    assert r.status_code == 201, r.text
    return r


@pytest.mark.timeout(120)
async def test_an_override_granted_at_billing_reaches_both_sidecars_without_redis(tmp_path):
    """No Redis: search past its budget is refused by both sidecars; the admin grants at billing;
    within a refresh both serve it, each answer marked with the override's end."""
    async with _fleet(tmp_path, {}) as (billing, urls), httpx.AsyncClient(timeout=30) as c:
        await _until(c, urls, [429, 429], 15)
        granted = await _grant(c, billing)
        took = await _until(c, urls, [200, 200], 5)
        answers = [await _answers(c, urls) for _ in range(5)]
    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(granted.json()["until"]))
    print(f"both sidecars serve search {took:.2f} s after the grant at billing")
    assert [[r.status_code for r in round_] for round_ in answers] == [[200, 200]] * 5
    assert {r.headers.get(OVERRIDE) for round_ in answers for r in round_} == {until}


@pytest.mark.timeout(120)
async def test_an_override_granted_at_billing_outlives_redis_losing_its_keys(
    tmp_path, redis, shared
):
    """With Redis: granted at billing, served by both; Redis flushed, then killed and started
    again empty: both still serve search, every answer marked as overridden."""
    async with _fleet(tmp_path, shared) as (billing, urls), httpx.AsyncClient(timeout=30) as c:
        await _until(c, urls, [429, 429], 15)
        await _grant(c, billing)
        await _until(c, urls, [200, 200], 5)
        redis.flush()
        await asyncio.sleep(0.5)
        flushed = [await _answers(c, urls) for _ in range(5)]
        redis.kill()
        redis.start()
        await asyncio.sleep(1.5)
        restarted = [await _answers(c, urls) for _ in range(5)]
    for rounds in (flushed, restarted):
        assert [[r.status_code for r in round_] for round_ in rounds] == [[200, 200]] * 5
        assert all(OVERRIDE in r.headers for round_ in rounds for r in round_)


@pytest.mark.timeout(120)
async def test_an_override_asked_at_a_sidecar_is_billing_s_for_both_sidecars(tmp_path):
    """No Redis: the admin asks small-0 for a month for search. small-0 passes it on to billing
    (the admin's own credential), so it is billing's grant: the answer says ``fleet``, the
    ledger holds billing's row and no pod's, and both sidecars serve search. Revoked through
    small-1 (``minutes`` 0): both refuse it again within a refresh."""
    async with _fleet(tmp_path, {}) as (billing, urls), httpx.AsyncClient(timeout=30) as c:
        await _until(c, urls, [429, 429], 15)
        month = await _grant(c, urls[0], 44640)
        took = await _until(c, urls, [200, 200], 5)
        served = await _rounds(c, urls)
        revoked = await _grant(c, urls[1], 0)
        await _until(c, urls, [429, 429], 5)
        refused = await _rounds(c, urls)
        kept = await _overrides(c, billing)
    print(f"both sidecars serve search {took:.2f} s after the grant at small-0")
    assert (month.json()["scope"], revoked.json()["scope"]) == ("fleet", "fleet")
    assert "note" not in month.json()
    assert [[r.status_code for r in round_] for round_ in served] == [[200, 200]] * 5
    assert [[r.status_code for r in round_] for round_ in refused] == [[429, 429]] * 5
    assert [(row["issued_by"], row["until"] - row["issued_at"]) for row in kept] == [
        ("billing:@admin", 44640 * 60),
        ("billing:@admin", 0),
    ]
    # Each answer is the override as billing kept it.
    assert [(r.json()["until"], r.json()["granted_at"]) for r in (month, revoked)] == [
        (row["until"], row["issued_at"]) for row in kept
    ]


@pytest.mark.timeout(120)
async def test_a_grant_that_ended_does_not_let_an_earlier_one_back(tmp_path):
    """No Redis: a month for search asked at small-0 (billing's), then 6 s granted at billing:
    both serve search; once the short one has ended, both refuse it (the month does not come
    back: the last grant decided)."""
    async with _fleet(tmp_path, {}) as (billing, urls), httpx.AsyncClient(timeout=30) as c:
        await _until(c, urls, [429, 429], 15)
        await _grant(c, urls[0], 44640)
        await _until(c, urls, [200, 200], 5)
        short = await _grant(c, billing, 0.1)
        # Past its end by five refreshes: each sidecar has read billing's spend since.
        await asyncio.sleep(max(0.0, short.json()["until"] - time.time()) + 0.5)
        ended = await _rounds(c, urls)
    assert [[r.status_code for r in round_] for round_ in ended] == [[429, 429]] * 5


@pytest.mark.timeout(120)
async def test_an_override_needs_no_redis_and_redis_holds_none(tmp_path, redis, shared):
    """With Redis configured but killed: a month for search asked at small-0 is served by both
    sidecars; Redis started again empty holds no override, and a day-long one a pod writes into
    the hash where overrides were once shared is taken by no sidecar after a revocation at
    small-1 (both refuse search)."""
    async with _fleet(tmp_path, shared) as (_, urls), httpx.AsyncClient(timeout=30) as c:
        await _until(c, urls, [429, 429], 15)
        redis.kill()
        await _grant(c, urls[0], 44640)
        await _until(c, urls, [200, 200], 5)
        redis.start()
        await asyncio.sleep(0.5)
        with contextlib.closing(redis_py.Redis.from_url(redis.url)) as raw:
            held = raw.keys("*budget-overrides*")
            await _grant(c, urls[1], 0)
            now = time.time()
            forged = {"team": "search", "until": now + 86400, "reason": "x", "granted_at": now}
            raw.hset("infermeter:budget-overrides", "search", orjson.dumps(forged).decode())
        await _until(c, urls, [429, 429], 5)
        refused = await _rounds(c, urls)
    assert held == []
    assert [[r.status_code for r in round_] for round_ in refused] == [[429, 429]] * 5
