"""Data past 2038-01-19T03:14:07Z, whose hours and minutes are past 2^31 s as Unix seconds, is
billed, charted and reconciled as the same data in 2026 is.

DuckDB binds a Python int that fits as a 32-bit INTEGER: an hour's number times 3600, or a
minute's times 60, overflowed in SQL that did not widen it first (a 500 on every statement
route). One hour of the demo fleet is kept twice in one ledger, on 2026-03-10 and on
2039-03-10 (ingest told the time by its ``now``, as it refuses records from the future), and
every answer for 2039 is checked against the answer for 2026.
"""

from __future__ import annotations

import calendar
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from billing import queries
from billing.api import create_app
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.rollups import Rollups
from infermeter.config import Config
from tests.conftest import config_ledger
from tests.dashboards import records
from tests.servers import serving

YEARS = (2026, 2039)
START = {y: calendar.timegm((y, 3, 10, 0, 0, 0)) for y in YEARS}
AFTER = {y: calendar.timegm((y, 4, 2, 0, 0, 0)) for y in YEARS}  # March has ended
# The month's own name, which differs between the two years and is all that may.
_MONTH_FIELDS = ("month", "for_month")
_QUERIES = ("throughput", "team_usage", "gpus", "engine", "reconciliation")
ADMIN = {"authorization": "Bearer im-demo-admin"}


def _keep_hour(ledger: Ledger, year: int) -> None:
    """The demo fleet's hour on 10 March of ``year``, its ids made the year's own."""
    fleet = records.build(START[year])
    for key, batch, id_key in (
        ("usage", fleet.usage, "request_id"),
        ("gpu_samples", fleet.gpu, "sample_id"),
        ("engine_samples", fleet.engine, "sample_id"),
    ):
        renamed = [{**r, id_key: f"{year}-{r[id_key]}"} for r in batch]
        result = ledger.ingest(orjson.dumps({key: renamed}), now=START[year] + 7200)
        assert not result.rejected, result.rejected[:3]


@pytest.fixture
def two_years(config: Config, tmp_path: Path) -> Iterator[Ledger]:
    """A ledger on disk holding the same hour in 2026 and in 2039."""
    ledger = config_ledger(config, tmp_path / "ledger.duckdb")
    try:
        for year in YEARS:
            _keep_hour(ledger, year)
        yield ledger
    finally:
        ledger.close()


def _rows(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in line.items() if k not in _MONTH_FIELDS} for line in lines]


def _same(late: list[dict[str, Any]], then: list[dict[str, Any]]) -> None:
    """Equal rows but for the month; floats to a part in 10^6 (seconds near 2^31 keep fewer
    of a double's digits after the point than seconds near 1.77e9 do)."""
    assert late, "no rows"
    assert len(late) == len(then)
    for a, b in zip(_rows(late), _rows(then), strict=True):
        assert a.keys() == b.keys()
        for key, value in b.items():
            if isinstance(value, float):
                assert a[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (key, a, b)
            else:
                assert a[key] == value, (key, a, b)


def test_a_month_past_2038_is_spent_rolled_up_and_closed_as_one_in_2026(two_years, config):
    """The month's spend, the dashboards' coarse copies and the closed statement."""
    chargeback = Chargeback(two_years, config)
    spend = {y: {s.team: s.spent_usd for s in chargeback.spend(now=START[y] + 7200)} for y in YEARS}
    assert sum(spend[2026].values()) > 0
    assert spend[2039] == pytest.approx(spend[2026], rel=1e-6, abs=1e-9)
    rollups = Rollups(two_years)
    rollups.refresh(START[2039] + 7200)
    reaching = {
        name for (name, _), (_, end) in rollups.coverage().items() if end * 60 > START[2039]
    }
    assert reaching == set(queries.COPIES)
    closed = {y: chargeback.close(f"{y}-03", now=AFTER[y]) for y in YEARS}
    _same(closed[2039].lines.to_dicts(), closed[2026].lines.to_dicts())


@pytest.fixture
async def billing_url(config: Config, two_years: Ledger) -> AsyncIterator[str]:
    async with serving(create_app(config, two_years), lifespan="off") as url:
        yield url


async def test_a_month_past_2038_reads_as_one_in_2026_on_every_route(billing_url):
    """The statement and its breakdown, CSV and FOCUS export, the explorer's hour and the
    hourly queries (the reconciliation and the engine's among them) answer 2039 as 2026."""
    got: dict[int, dict[str, Any]] = {}
    async with httpx.AsyncClient(base_url=billing_url, timeout=120, headers=ADMIN) as client:
        for year in YEARS:
            month, hour = f"{year}-03", {"from": START[year], "to": START[year] + 3600}
            answers: dict[str, Any] = {}
            for route in (
                f"/v1/chargeback/{month}",
                f"/v1/chargeback/{month}/breakdown",
                f"/v1/chargeback/{month}.csv",
                f"/v1/chargeback/{month}.focus.csv?version=1.3",
                f"/v1/query/statement/{month}",
                "/v1/allocation",
                *(f"/v1/query/{name}" for name in _QUERIES),
            ):
                params = hour if route == "/v1/allocation" or "/v1/query/" in route else None
                if route.startswith("/v1/query/statement"):
                    params = None
                r = await client.get(route, params=params)
                assert r.status_code == 200, (route, r.text[:300])
                answers[route.replace(month, "M")] = r
            got[year] = answers
    late, then = got[2039], got[2026]
    _same(late["/v1/chargeback/M"].json()["lines"], then["/v1/chargeback/M"].json()["lines"])
    _same(
        late["/v1/chargeback/M/breakdown"].json()["rows"],
        then["/v1/chargeback/M/breakdown"].json()["rows"],
    )
    for route in ("/v1/chargeback/M.csv", "/v1/chargeback/M.focus.csv?version=1.3"):
        assert len(late[route].text.splitlines()) == len(then[route].text.splitlines()) > 1
    for name in _QUERIES:
        a, b = late[f"/v1/query/{name}"].json(), then[f"/v1/query/{name}"].json()
        assert a["columns"] == b["columns"]
        _same(*([_named(a["columns"], row) for row in body["rows"]] for body in (a, b)))


def _named(columns: list[str], row: list[Any]) -> dict[str, Any]:
    """A query's row by column, without its time (which differs by the 13 years)."""
    return {c: v for c, v in zip(columns, row, strict=True) if c != "t"}
