"""Looking a usage record up by the sidecar's, vLLM's or the caller's id, held to the caller's team."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from billing.api import create_app
from billing.ledger import Ledger
from billing.lookup import Lookup, lookup_sql
from infermeter.config import Config
from tests.billing.conftest import NOV, batch, bearer, usage
from tests.servers import serving

ADMIN, INGEST, METRICS = "im-demo-admin", "im-demo-ingest", "im-demo-metrics"
SEARCH, ASSISTANT = "im-demo-search", "im-demo-assistant"


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """The billing API with three records: two of search (one id shared), one of assistant."""
    records = [
        usage(
            "search",
            NOV + 60,
            request_id="req-a",
            response_id="chatcmpl-a",
            client_request_id="trace-1",
        ),
        usage(
            "search",
            NOV + 120,
            request_id="req-b",
            response_id="cmpl-b",
            client_request_id="trace-1",
        ),
        usage(
            "assistant",
            NOV + 180,
            request_id="req-c",
            response_id="chatcmpl-c",
            client_request_id="trace-2",
        ),
    ]
    async with serving(create_app(config, ledger), lifespan="off") as url:
        async with httpx.AsyncClient(base_url=url, headers=bearer(INGEST)) as c:
            r = await c.post("/v1/ingest", content=batch("usage", records))
            assert r.json()["accepted"] == 3, r.text
        yield url


async def _find(url: str, key: str, **params: str | int) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, headers=bearer(key)) as c:
        return await c.get("/v1/usage/records", params=params)


@pytest.mark.parametrize(
    ("id_", "expected"),
    [
        ("req-a", ["req-a"]),
        ("chatcmpl-c", ["req-c"]),
        ("trace-1", ["req-b", "req-a"]),
        ("nothing", []),
    ],
)
async def test_the_admin_finds_a_record_by_each_of_its_ids(billing, id_, expected):
    """The sidecar's id, vLLM's response id and the caller's id each find the record, newest first."""
    r = await _find(billing, ADMIN, id=id_)
    assert r.status_code == 200
    assert [rec["request_id"] for rec in r.json()["records"]] == expected


async def test_a_record_comes_back_whole(billing):
    """The answer holds every field of the record as the ledger keeps it."""
    (record,) = (await _find(billing, ADMIN, id="cmpl-b")).json()["records"]
    assert (record["team"], record["response_id"], record["client_request_id"]) == (
        "search",
        "cmpl-b",
        "trace-1",
    )
    assert record["prompt_tokens"] == 100


async def test_a_team_finds_only_its_own_records(billing):
    """A team key finds its records; another team's ids find nothing, not even a 403."""
    own = await _find(billing, SEARCH, id="trace-1")
    other = await _find(billing, SEARCH, id="chatcmpl-c")
    theirs = await _find(billing, ASSISTANT, id="trace-1")
    assert [rec["request_id"] for rec in own.json()["records"]] == ["req-b", "req-a"]
    assert other.status_code == theirs.status_code == 200
    assert other.json() == theirs.json() == {"records": []}


async def test_by_holds_the_lookup_to_one_kind_of_id(billing):
    """``by=response_id`` does not match a request id of the same text."""
    assert (await _find(billing, ADMIN, id="req-a", by="response_id")).json() == {"records": []}
    found = await _find(billing, ADMIN, id="req-a", by="request_id")
    assert len(found.json()["records"]) == 1


async def test_the_answer_is_bounded_by_limit(billing):
    """``limit`` caps the records answered; past the maximum it is refused."""
    assert len((await _find(billing, ADMIN, id="trace-1", limit=1)).json()["records"]) == 1
    assert (await _find(billing, ADMIN, id="trace-1", limit=101)).status_code == 422
    assert (await _find(billing, ADMIN, id="x" * 257)).status_code == 422


@pytest.mark.parametrize(("key", "status"), [(METRICS, 403), (INGEST, 403), ("nope", 401)])
async def test_only_the_admin_and_teams_may_look_records_up(billing, key, status):
    """The roles that do not read the ledger are refused."""
    assert (await _find(billing, key, id="req-a")).status_code == status


def test_a_team_lookup_filters_on_the_team_in_sql():
    """The query a team's lookup runs carries the team as a parameter, after the ids."""
    sql, params = lookup_sql(Lookup("x", team="search"))
    assert "AND team = ?" in sql
    assert params == ["x", "x", "x", "search", 20]


@pytest.mark.parametrize("kw", [{"by": "team"}, {"limit": 0}, {"limit": 101}])
def test_a_lookup_out_of_bounds_is_refused(kw):
    """An unknown id column or a limit outside 1..100 is a ValueError naming it."""
    with pytest.raises(ValueError, match=next(iter(kw))):
        Lookup("x", **kw)
