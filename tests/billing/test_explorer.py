"""The allocation explorer (``GET /v1/allocation``) against the statement, on a ledger of the hard shape.

The ledger's October has what makes allocation hard: a fixed replica and a group of two
instances, teams sharing instances, a spare GPU (unallocated), a GPU model with no price (an
error line), idle capacity, and tokens the engine counted that no record carries (an
unattributed line). A window of the whole month must give the statement's lines to the cent in
every grouping; a shorter window, whole cents that add up; a team key, its own rows only.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import polars as pl
import pytest

from billing.api import create_app
from billing.chargeback import Chargeback
from billing.explorer import NONE
from billing.explorer_view import ExplorerQuery, _rounded
from billing.ledger import Ledger
from billing.queries import FIRST_SECOND, LAST_SECOND
from infermeter.config import Config
from infermeter.months import month_bounds
from tests.billing.conftest import OCT, batch, gpu_samples, usage
from tests.billing.test_reconciliation import engine_samples, requests
from tests.servers import serving

HOUR = 3600.0
MONTH = "2026-10"
ADMIN, SEARCH, ANALYTICS = "im-demo-admin", "im-demo-search", "im-demo-analytics"


def _keep(ledger: Ledger, kind: str, records: list[dict[str, Any]]) -> None:
    result = ledger.ingest(batch(kind, records), now=OCT + 40 * 86400)
    assert (result.accepted, result.rejected) == (len(records), [])


@pytest.fixture
def month(ledger: Ledger) -> Ledger:
    """October with every shape allocation has (see the module's docstring), over six hours."""
    hour1, hour2 = requests(20, 1), requests(10, 2)
    withheld = {1, 5, 6, 17}  # their tokens are the engine's only: unattributed
    kept = [r for i, r in enumerate(hour1) if i not in withheld] + hour2
    kept += [
        usage("assistant", OCT + 3 * HOUR + 60 * i, 30.0, replica="large-0", model="chat-large")
        for i in range(40)
    ]
    for i in range(30):
        instance = ("small-1-a", "small-1-b")[i % 2]
        kept.append(
            usage("analytics", OCT + 4 * HOUR + 90 * i, 20.0, replica="small-1", instance=instance)
        )
    _keep(ledger, "usage", kept)
    _keep(ledger, "engine_samples", engine_samples(hour1 + hour2, OCT, OCT + 3 * HOUR))
    gpus = gpu_samples(seconds=6 * HOUR)
    for g in ("0", "1"):
        gpus += gpu_samples("large-0", seconds=6 * HOUR, gpu_model="H100", node="node-a", gpu=g)
    for g, instance in (("1", "small-1-a"), ("2", "small-1-b")):
        for sample in gpu_samples("small-1", seconds=6 * HOUR, gpu=g):
            gpus.append(sample | {"instance": instance})
    gpus += gpu_samples("", seconds=6 * HOUR, gpu="3")  # spare
    gpus += gpu_samples("", seconds=2 * HOUR, gpu_model="A10G", node="node-c")  # no price
    _keep(ledger, "gpu_samples", gpus)
    return ledger


@pytest.fixture
async def billing(config: Config, month: Ledger) -> AsyncIterator[str]:
    async with serving(create_app(config, month), lifespan="off") as url:
        yield url


async def ask(url: str, key: str, **params: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        response = await client.get(
            "/v1/allocation", params=params, headers={"authorization": f"Bearer {key}"}
        )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def shown(body: dict[str, Any]) -> pl.DataFrame:
    return pl.DataFrame(body["rows"], schema=body["columns"], orient="row")


def cents(value: float) -> int:
    return round(value * 100)


WHOLE = dict(zip(("from", "to"), month_bounds(MONTH), strict=True))


async def test_a_whole_month_by_team_and_model_is_the_statement_to_the_cent(billing, month, config):
    """Each (team, model) row and the total are the statement's line and total, cent for cent."""
    statement = Chargeback(month, config).statement(MONTH)
    body = await ask(billing, ADMIN, by="team,model", **WHOLE)
    rows = shown(body)
    lines = statement.lines.filter(pl.col("total_cents") != 0)
    assert {
        (r["team"], r["model"]): cents(r["total_usd"])
        for r in rows.iter_rows(named=True)
        if r["total_usd"]
    } == {(t, m): c for t, m, c in lines.select("team", "model", "total_cents").iter_rows()}
    for column in ("compute", "energy", "idle"):
        assert (
            sum(cents(v) for v in rows[f"{column}_usd"]) == statement.lines[f"{column}_cents"].sum()
        )
    assert body["total"]["total_cents"] == statement.fleet_cents == statement.total_cents
    # The hard shapes are there: unallocated, the error line and the unattributed line.
    models = set(rows["model"])
    assert {"(unallocated)", "chat-small (unattributed)"} <= models
    assert any(m.startswith("(error)") for m in models)
    requests = dict(
        zip(
            statement.lines["model"] + "|" + statement.lines["team"],
            statement.lines["requests"],
            strict=True,
        )
    )
    assert {
        f"{r['model']}|{r['team']}": r["requests"] for r in rows.iter_rows(named=True)
    } == requests


@pytest.mark.parametrize(
    "by",
    ["team", "model", "replica", "instance", "node", "gpu_model", "team,instance", "node,model"],
)
async def test_every_grouping_of_a_whole_month_adds_up_to_the_statement(billing, month, config, by):
    """Whatever the grouping, the rows' cents add up to the statement's total, and per team
    (when grouped by team) to the statement's team totals."""
    statement = Chargeback(month, config).statement(MONTH)
    body = await ask(billing, ADMIN, by=by, **WHOLE)
    rows = shown(body)
    assert (
        sum(cents(v) for v in rows["total_usd"])
        == body["total"]["total_cents"]
        == statement.total_cents
    )
    assert rows["requests"].sum() == statement.lines["requests"].sum()
    if "team" in by:
        teams = Counter[str]()
        for r in rows.iter_rows(named=True):
            teams[r["team"]] += cents(r["total_usd"])
        expected = statement.lines.group_by("team").agg(pl.col("total_cents").sum())
        assert {t: c for t, c in teams.items() if c} == {t: c for t, c in expected.iter_rows() if c}


async def test_instances_split_their_group_as_the_focus_file_does(billing, month, config):
    """By instance, a month's cents are the statement split by instance (the FOCUS file's rows)."""
    chargeback = Chargeback(month, config)
    split = chargeback.by_instance(chargeback.statement(MONTH)).lines
    expected = split.group_by(pl.col("instance").fill_null(NONE).replace("", NONE)).agg(
        pl.col("total_cents").sum()
    )
    rows = shown(await ask(billing, ADMIN, by="instance", **WHOLE))
    got = {i: cents(v) for i, v in rows.select("instance", "total_usd").iter_rows()}
    assert got == dict(expected.iter_rows())
    assert {"small-1-a", "small-1-b", "large-0", "small-0"} <= set(got)


async def test_nodes_and_gpu_models_are_where_the_money_was_spent(billing):
    """The H100s of node-a carry large-0's cost; the unpriced board costs nothing."""
    rows = shown(await ask(billing, ADMIN, by="gpu_model,node", **WHOLE))
    by = {(g, n): cents(v) for g, n, v in rows.select("gpu_model", "node", "total_usd").iter_rows()}
    assert by[("H100", "node-a")] > 0
    assert by[("L40S", "node-b")] > 0
    assert (
        "A10G",
        "node-c",
    ) not in by  # no price: left out of the fleet's cost, as allocation does


async def test_a_shorter_window_is_whole_cents_that_add_up(billing, month, config):
    """Hours 3 to 5 hold assistant's and analytics' requests, and whole cents that add up."""
    body = await ask(billing, ADMIN, by="team", **{"from": OCT + 3 * HOUR, "to": OCT + 5 * HOUR})
    rows = shown(body)
    assert sum(cents(v) for v in rows["total_usd"]) == body["total"]["total_cents"]
    requests = dict(rows.select("team", "requests").iter_rows())
    assert requests["assistant"] == 40
    assert requests["analytics"] == 30
    assert requests.get("search", 0) == 0
    whole = (await ask(billing, ADMIN, by="team", **WHOLE))["total"]["total_cents"]
    assert 0 < body["total"]["total_cents"] < whole


async def test_a_team_sees_its_own_rows_with_the_admins_cents(billing):
    """A team key gets its own team only, with the cents the admin sees for it; another team is 403."""
    mine = await ask(billing, ANALYTICS, by="instance", **WHOLE)
    assert mine["values"]["team"] == ["analytics"]
    admin = await ask(billing, ADMIN, by="instance", team="analytics", **WHOLE)
    assert mine["rows"] == admin["rows"]
    async with httpx.AsyncClient(base_url=billing) as client:
        refused = await client.get(
            "/v1/allocation",
            params={"team": "search"},
            headers={"authorization": f"Bearer {ANALYTICS}"},
        )
    assert refused.status_code == 403


async def test_the_csv_is_the_rows_shown_and_safe_in_a_spreadsheet(billing):
    """The CSV has the rows and the total of the answer, with formula-like text defused."""
    body = await ask(billing, ADMIN, by="team,model", **WHOLE)
    async with httpx.AsyncClient(base_url=billing, timeout=60) as client:
        response = await client.get(
            "/v1/allocation.csv",
            params={"by": "team,model", **WHOLE},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
    assert response.text == body["csv"]
    records = list(csv.DictReader(io.StringIO(response.text)))
    assert len(records) == len(body["rows"]) + 1
    assert records[-1]["team"] == "total"
    assert float(records[-1]["total_usd"]) == body["total"]["total_usd"]
    for record, row in zip(records, body["rows"], strict=False):
        assert record["team"] == row[0]
        assert float(record["total_usd"]) == row[body["columns"].index("total_usd")]


async def test_bad_windows_and_keys_are_refused_with_a_reason(billing):
    """A reversed window, an unknown key and three keys are 400s that say what is wrong; an end
    outside the calendar served is a 422 naming it."""
    async with httpx.AsyncClient(base_url=billing) as client:
        t = 1_760_000_000
        for params, says in (
            ({"from": t + 10, "to": t + 5}, "to > from"),
            ({"by": "colour"}, "colour"),
            ({"by": "team,model,node"}, "one or two"),
            ({"from": t, "to": t + 200 * 86400}, "at most 93"),
        ):
            response = await client.get(
                "/v1/allocation", params=params, headers={"authorization": f"Bearer {ADMIN}"}
            )
            assert response.status_code == 400, params
            assert says in response.json()["error"]["message"]
        # Ends no calendar month holds (before 2000, after 2999) are refused by name, not a 500.
        for bad in ({"from": -4e16, "to": t}, {"to": 1.9e176}, {"to": 2.2e-309}):
            response = await client.get(
                "/v1/allocation.csv", params=bad, headers={"authorization": f"Bearer {ADMIN}"}
            )
            assert response.status_code == 422, bad
            assert next(iter(bad)) in response.text


async def test_windows_at_the_calendars_ends_are_answered(billing):
    """``to`` alone at the first second served: the default window (the month ``to`` falls in)
    begins no earlier than the calendar, so it is empty (a 400 saying so), never an error about
    a month before the calendar that no one named (it escaped as a 500)."""
    async with httpx.AsyncClient(base_url=billing) as client:
        response = await client.get(
            "/v1/allocation.csv",
            params={"to": FIRST_SECOND},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
    assert response.status_code == 400
    assert "to > from" in response.json()["error"]["message"]
    # And the calendar's last month, whose end is an hour past the last second served.
    body = await ask(billing, ADMIN, **{"from": LAST_SECOND - 86400, "to": LAST_SECOND})
    assert body["rows"] == []


def test_rounding_keeps_whole_numbers_and_the_total():
    """Float parts of whole lines come back whole; other parts add up to their rounded sum."""
    assert _rounded([264.0000000001, 110.99999999, 55.0]) == [264, 111, 55]
    parts = _rounded([0.4, 0.4, 0.4, 1.7])
    assert parts == [1, 0, 0, 2]  # 2.9 is 3: the 0.7, then the first of the 0.4s


def test_a_query_is_widened_to_whole_hours():
    """From and to become the hours that hold them; one or two keys, known ones."""
    q = ExplorerQuery.checked(OCT + 100, OCT + 3 * HOUR + 1, ["team"], {}, None)
    assert (q.first_hour, q.end_hour) == (OCT // HOUR, OCT // HOUR + 4)
    assert q.step == 3600
    long = ExplorerQuery.checked(OCT, OCT + 10 * 86400, ["team"], {"model": ["chat-small"]}, None)
    assert long.step == 86400
    assert long.filters == {"model": frozenset({"chat-small"})}


async def test_a_long_window_reads_whole_days_and_its_edge_hours_alike(billing):
    """Hours 1 to 5 give the same rows whether read by the hour or as days with edge hours."""
    hourly = await ask(billing, ADMIN, by="instance", **{"from": OCT + HOUR, "to": OCT + 6 * HOUR})
    daily = await ask(
        billing, ADMIN, by="instance", **{"from": OCT + HOUR, "to": OCT + 4 * 86400 + 5 * HOUR}
    )
    assert (hourly["step"], daily["step"]) == (3600, 86400)
    assert daily["rows"] == hourly["rows"]
    assert daily["total"] == hourly["total"]
