"""Attribution below the team: statement lines split by project and end user, exactly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import polars as pl
import pytest
from hypothesis import given, settings, strategies as st

from billing.breakdown import (
    BREAKDOWN_SCHEMA,
    OTHER_USERS,
    TAG_SCHEMA,
    Rule,
    month_tags,
    tag_split,
)
from billing.ledger import _BACKFILLS, Ledger
from billing.schema import USAGE_TAGS_VERSION
from infermeter.config import DEFAULT_CONFIG, Config, load_config
from infermeter.months import month_bounds, month_of
from infermeter.statement import LINE_SCHEMA
from tests.billing.conftest import NOV, batch, bearer, gpu_samples, ndjson, usage
from tests.conftest import config_ledger
from tests.dashboards.stack import billing_thread

WEIGHTS = {"prompt": 1.0, "completion": 3.0}
INTEGERS = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "compute_cents",
    "energy_cents",
    "idle_cents",
    "total_cents",
)
ADMIN, INGEST, SPEND = "im-demo-admin", "im-demo-ingest", "im-demo-spend"
SEARCH, ASSISTANT = "im-demo-search", "im-demo-assistant"


def line(
    team: str,
    model: str,
    compute: int,
    energy: int,
    idle: int,
    requests: int = 0,
    prompt: int = 0,
    completion: int = 0,
    gpu_hours: float = 0.0,
    month: str = "2026-11",
    for_month: str = "2026-11",
) -> dict[str, Any]:
    """One statement line."""
    return {
        "month": month,
        "for_month": for_month,
        "team": team,
        "model": model,
        "requests": requests,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "gpu_hours": gpu_hours,
        "energy_kwh": 0.0,
        "compute_cents": compute,
        "energy_cents": energy,
        "idle_cents": idle,
        "total_cents": compute + energy + idle,
    }


def tag(
    team: str,
    model: str,
    project: str | None,
    user: str | None,
    requests: int,
    prompt: int,
    completion: int,
    inflight: float,
    for_month: str = "2026-11",
) -> dict[str, Any]:
    """One team, model, project and user's use in a month."""
    return {
        "for_month": for_month,
        "team": team,
        "model": model,
        "project": project,
        "user": user,
        "requests": requests,
        "prompt_tokens": prompt,
        "cached_prompt_tokens": 0,
        "completion_tokens": completion,
        "inflight_seconds": inflight,
    }


def frames(
    lines: list[dict[str, Any]], tags: list[dict[str, Any]]
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The lines and tags as the frames ``tag_split`` takes."""
    return pl.DataFrame(lines, schema=LINE_SCHEMA), pl.DataFrame(tags, schema=TAG_SCHEMA)


# Two projects under one team (search, chat-small), in-flight rule. The line: compute 1000,
# energy 101, idle 7, total 1108 cents; 6 requests, 600 prompt and 300 completion tokens;
# 1.2 GPU-hours. Its use: alpha/ana 300 s in flight (3 requests, 300 + 150 tokens), alpha/ben
# 100 s (1 request, 100 + 50), beta with no user 200 s (2 requests, 200 + 100): shares 3:1:2.
TWO_PROJECTS = [
    tag("search", "chat-small", "alpha", "ana", 3, 300, 150, 300.0),
    tag("search", "chat-small", "alpha", "ben", 1, 100, 50, 100.0),
    tag("search", "chat-small", "beta", None, 2, 200, 100, 200.0),
]


def test_two_projects_under_one_team_split_the_line_by_in_flight_share_to_the_cent() -> None:
    """The worked example: each cent column by largest remainder, the rows add up to the line."""
    lines, tags = frames(
        [
            line("search", "chat-small", 1000, 101, 7, 6, 600, 300, 1.2),
            line("assistant", "chat-small", 50, 5, 0, 1, 10, 10),
        ],
        TWO_PROJECTS,
    )
    rows = tag_split(lines, tags, "in_flight", WEIGHTS)
    assert rows.schema == pl.Schema(BREAKDOWN_SCHEMA)
    got = rows.select(
        "team",
        "project",
        "user",
        "compute_cents",
        "energy_cents",
        "idle_cents",
        "total_cents",
        "requests",
        "prompt_tokens",
        "completion_tokens",
    ).rows()
    # compute 1000 x 3/6, 1/6, 2/6 = 500, 166.67, 333.33: floors 500 + 166 + 333 = 999, the
    #   missing cent to the largest remainder (ben's 0.67) -> 500, 167, 333.
    # energy 101 -> 50.5, 16.83, 33.67: floors 99, two cents to ben (.83) and beta (.67)
    #   -> 50, 17, 34.
    # idle 7 -> 3.5, 1.17, 2.33: floors 6, one cent to ana (.5) -> 4, 1, 2.
    # totals: 554 + 185 + 369 = 1108. Requests and tokens by the pairs' own counts.
    assert got == [
        ("search", "alpha", "ana", 500, 50, 4, 554, 3, 300, 150),
        ("search", "alpha", "ben", 167, 17, 1, 185, 1, 100, 50),
        ("search", "beta", None, 333, 34, 2, 369, 2, 200, 100),
        # A line no tagged use stands behind is one row with no project and no user.
        ("assistant", None, None, 50, 5, 0, 55, 1, 10, 10),
    ]
    assert rows["gpu_hours"].to_list()[:3] == pytest.approx([0.6, 0.2, 0.4])


def test_the_requests_rule_splits_by_requests() -> None:
    """Under ``requests`` the shares are 3:1:2 requests, here the same cents as in flight."""
    lines, tags = frames([line("search", "chat-small", 600, 0, 0, 6, 600, 300)], TWO_PROJECTS)
    assert tag_split(lines, tags, "requests", WEIGHTS)["total_cents"].to_list() == [300, 100, 200]


def test_the_tokens_rule_weighs_cached_prompt_tokens_when_given_a_weight() -> None:
    """A pair whose prompt was all cache hits weighs its cached tokens at their own weight."""
    tags = [
        tag("search", "m", "alpha", None, 1, 100, 0, 1.0),
        tag("search", "m", "beta", None, 1, 100, 0, 1.0),
    ]
    tags[1]["cached_prompt_tokens"] = 100
    lines, frame = frames([line("search", "m", 130, 0, 0, 2, 200, 0)], tags)
    weights = WEIGHTS | {"cached_prompt": 0.3}
    # alpha 100 x 1.0 = 100, beta 100 x 0.3 = 30: 130 cents split 100 : 30.
    assert tag_split(lines, frame, "tokens", weights)["total_cents"].to_list() == [100, 30]
    # Without a cached weight every prompt token is alike: 65 each.
    assert tag_split(lines, frame, "tokens", WEIGHTS)["total_cents"].to_list() == [65, 65]


def test_users_past_the_teams_bound_are_folded_into_other_users_by_spend() -> None:
    """max_users 1: ana (554 cents) stays, ben (185) becomes "(other users)"; no-user rows stay."""
    lines, tags = frames([line("search", "chat-small", 1000, 101, 7, 6, 600, 300)], TWO_PROJECTS)
    rows = tag_split(lines, tags, "in_flight", WEIGHTS, {"search": 1})
    assert rows.select("project", "user", "total_cents").rows() == [
        ("alpha", OTHER_USERS, 185),
        ("alpha", "ana", 554),
        ("beta", None, 369),
    ]


def test_an_adjustment_line_is_split_by_the_use_of_the_month_it_is_for() -> None:
    """A negative late-record adjustment for October is split by October's tags, signs kept."""
    lines, tags = frames(
        [line("search", "chat-small", -9, 0, 0, month="2026-11", for_month="2026-10")],
        [
            tag("search", "chat-small", "alpha", None, 1, 1, 1, 2.0, for_month="2026-10"),
            tag("search", "chat-small", "beta", None, 1, 1, 1, 1.0, for_month="2026-10"),
            tag("search", "chat-small", "gamma", None, 1, 1, 1, 5.0),
        ],
    )
    rows = tag_split(lines, tags, "in_flight", WEIGHTS)
    assert rows.select("project", "total_cents").rows() == [("alpha", -6), ("beta", -3)]


_cents = st.integers(-10_000, 1_000_000)
_counts = st.integers(0, 10_000)


@st.composite
def statements(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Lines of a few teams and models and random tagged use behind some of them."""
    pairs = draw(
        st.lists(
            st.tuples(st.sampled_from("abc"), st.sampled_from("xy")),
            min_size=1,
            max_size=4,
            unique=True,
        )
    )
    lines = [
        line(
            t,
            m,
            draw(_cents),
            draw(_cents),
            draw(_cents),
            draw(_counts),
            draw(_counts),
            draw(_counts),
        )
        for t, m in pairs
    ]
    tags = [
        tag(
            t,
            m,
            draw(st.sampled_from([None, "p", "q"])),
            draw(st.sampled_from([None, "u", "v", "w"])),
            draw(_counts),
            draw(_counts),
            draw(_counts),
            draw(st.floats(0, 1e6)),
        )
        for t, m in draw(st.lists(st.sampled_from(pairs), max_size=12))
    ]
    return lines, tags


@settings(max_examples=150, deadline=None)
@given(statements(), st.sampled_from(["in_flight", "tokens", "requests"]), st.integers(1, 3))
def test_the_rows_of_each_line_add_up_to_it_exactly(
    drawn: tuple[list[dict[str, Any]], list[dict[str, Any]]], rule: Rule, bound: int
) -> None:
    """Whatever the lines, use, rule and user bound: per line, every integer column's rows sum
    to the line's value, and each row's total is its parts' sum."""
    lines, tags = frames(*drawn)
    rows = tag_split(lines, tags, rule, WEIGHTS | {"cached_prompt": 0.3}, {"a": bound})
    keys = ["month", "for_month", "team", "model"]
    summed = rows.group_by(keys).agg(pl.col(INTEGERS).sum()).sort(keys)
    assert summed.select(keys, *INTEGERS).rows() == lines.sort(keys).select(keys, *INTEGERS).rows()
    assert (
        rows["total_cents"] == rows["compute_cents"] + rows["energy_cents"] + rows["idle_cents"]
    ).all()
    assert rows.filter(pl.col("team") == "a")["user"].drop_nulls().n_unique() <= bound + 1


def test_records_carry_user_and_project_into_the_ledger_and_its_hourly_tags(
    tmp_path: Path, config: Config
) -> None:
    """Ingested records keep user and project; usage_tags sums them by hour, '' for none, and
    its migration fills it from the raw rows alike."""
    ledger = Ledger.open(tmp_path / "ledger.duckdb", [t.name for t in config.teams], {})
    records = [
        usage("search", NOV + 3600, 120, user="ana", project="alpha"),
        usage("search", NOV + 3700, 60, user="ana", project="alpha"),
        usage("search", NOV + 7000, 400, project="beta"),  # ends in the next hour
        usage("assistant", NOV + 3600, 10),
    ]
    assert ledger.ingest_lines("usage", ndjson(records), now=NOV + 9000).accepted == 4
    with ledger.reader() as cur:
        kept = cur.execute(
            'SELECT team, "user", project FROM usage ORDER BY received_at, team'
        ).fetchall()
        hourly = cur.execute("SELECT * FROM usage_tags ORDER BY ALL").fetchall()
    assert kept == [
        ("assistant", None, None),
        ("search", "ana", "alpha"),
        ("search", "ana", "alpha"),
        ("search", None, "beta"),
    ]
    hour = int(NOV // 3600)
    assert hourly == [
        (hour + 1, "assistant", "chat-small", "", "", 1, 100, 0, 50, 10.0),
        (hour + 1, "search", "chat-small", "alpha", "ana", 2, 200, 0, 100, 180.0),
        (hour + 1, "search", "chat-small", "beta", "", 0, 0, 0, 0, 200.0),
        (hour + 2, "search", "chat-small", "beta", "", 1, 100, 0, 50, 200.0),
    ]
    with ledger.writing() as cur:  # what the migration runs on a ledger from before it
        cur.execute("DELETE FROM usage_tags")
        for statement in _BACKFILLS[USAGE_TAGS_VERSION]:
            cur.execute(statement)
    try:
        with ledger.reader() as cur:
            assert cur.execute("SELECT * FROM usage_tags ORDER BY ALL").fetchall() == hourly
        tags = month_tags(ledger, ["2026-11"], ["search"])
    finally:
        ledger.close()
    assert tags.sort("project").select("project", "user", "requests").rows() == [
        ("alpha", "ana", 2),
        ("beta", None, 1),
    ]


# -- the routes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def projects_config() -> Config:
    """The demo configuration, search with projects alpha and beta and a $0.01 budget on beta."""
    return load_config(
        DEFAULT_CONFIG,
        environ={
            "INFERMETER__BILLING__SHARED_INGEST_TOKEN": "true",
            "INFERMETER__TEAMS__SEARCH__PROJECTS": "[alpha, beta]",
            "INFERMETER__TEAMS__SEARCH__PROJECT_BUDGETS_USD_PER_MONTH": "{beta: 0.01}",
        },
    )


@pytest.fixture(scope="module")
def billing(projects_config: Config) -> Iterator[str]:
    """Billing over an in-memory ledger with this month's use of search (two projects, two
    users) and assistant on small-0, and the GPU under it; in a thread on a loopback port."""
    config = projects_config
    led = config_ledger(config)
    now = time.time()
    start = max(now - 1800, month_bounds(month_of(now))[0])
    records = [
        usage("search", start + 10, 300, user="ana", project="alpha"),
        usage("search", start + 20, 100, user="ben", project="alpha"),
        usage("search", start + 30, 200, project="beta"),
        usage("assistant", start + 40, 100, user="zed"),
    ]
    for kind, rows in (
        ("usage", records),
        ("gpu_samples", gpu_samples(start=start, seconds=max(60.0, now - start - 1))),
    ):
        assert led.ingest(batch(kind, rows), now=now).accepted == len(rows)
    try:
        with billing_thread(config, led) as url:
            yield url
    finally:
        led.close()


def _get(url: str, key: str, path: str) -> httpx.Response:
    return httpx.get(url + path, headers=bearer(key), timeout=30)


@pytest.mark.parametrize(
    ("key", "teams"),
    [(ADMIN, {"search", "assistant"}), (SEARCH, {"search"}), (ASSISTANT, {"assistant"})],
)
def test_the_breakdown_route_gives_a_reader_every_team_and_a_team_its_own(
    billing: str, key: str, teams: set[str]
) -> None:
    """Rows per team, model, project and user that add up to the statement's lines the caller sees."""
    month = month_of(time.time())
    got = _get(billing, key, f"/v1/chargeback/{month}/breakdown")
    lines = (_get(billing, key, f"/v1/chargeback/{month}")).json()["lines"]
    assert got.status_code == 200, got.text
    body = got.json()
    rows = [r for r in body["rows"] if r["team"] in {"search", "assistant"}]
    assert {r["team"] for r in rows} == teams
    assert {r["team"] for r in body["rows"]} <= teams | {"platform"}
    assert body["truncated"] is False
    for team in teams:
        mine = [r for r in body["rows"] if r["team"] == team]
        assert sum(r["total_cents"] for r in mine) == sum(
            ln["total_cents"] for ln in lines if ln["team"] == team
        )
    if "search" in teams:
        tags = {(r["project"], r["user"]) for r in rows if r["team"] == "search"}
        assert tags == {("alpha", "ana"), ("alpha", "ben"), ("beta", None)}


def test_the_breakdown_route_is_not_for_the_spend_reader(billing: str) -> None:
    """The sidecars' spend_reader reads spend, not statements."""
    month = month_of(time.time())
    assert (_get(billing, SPEND, f"/v1/chargeback/{month}/breakdown")).status_code == 403


def test_spend_carries_the_budgeted_projects_of_a_team_and_keeps_its_old_keys(billing: str) -> None:
    """/v1/spend: search, which budgets a project, has projects (USD per project it used, each
    budgeted one present); the others' rows are as before."""
    rows = {r["team"]: r for r in orjson.loads((_get(billing, SPEND, "/v1/spend")).content)}
    projects = rows["search"]["projects"]
    assert set(projects) == {"alpha", "beta"}
    assert projects["alpha"] > projects["beta"] > 0  # alpha had 400 s in flight, beta 200 s
    assert "projects" not in rows["assistant"]
    assert {"team", "month", "spent_usd", "budget_usd", "forecast_usd", "as_of"} <= set(
        rows["assistant"]
    )


def test_columns_beyond_the_line_schema_are_carried_to_every_row() -> None:
    """An export's lines by instance keep their instance on each project and user row."""
    lines, tags = frames([line("search", "chat-small", 1000, 101, 7, 6, 600, 300)], TWO_PROJECTS)
    by_instance = lines.with_columns(instance=pl.lit("small-0-a"))
    rows = tag_split(by_instance, tags, "in_flight", WEIGHTS)
    assert rows.columns == [*LINE_SCHEMA, "instance", "project", "user"]
    assert rows["instance"].to_list() == ["small-0-a"] * 3
    assert rows["total_cents"].to_list() == [554, 185, 369]


def test_a_statements_breakdown_is_computed_once_per_team_and_again_for_a_new_statement(
    ledger: Ledger, config: Config
) -> None:
    """The memo answers the same rows for the same statement and team, its own for another
    team, and computes anew for a statement computed since."""
    from billing.breakdown import Breakdowns
    from infermeter.statement import Statement

    lines = pl.DataFrame([line("search", "chat-small", 10, 0, 0)], schema=LINE_SCHEMA)
    first, second = (Statement("2026-11", False, lines, 10, 0) for _ in range(2))
    memo = Breakdowns()
    rows = memo.of(ledger, first, config, None)
    assert memo.of(ledger, first, config, None) is rows
    assert memo.of(ledger, first, config, "assistant").height == 0
    assert memo.of(ledger, second, config, None) is not rows


def test_the_csv_and_focus_files_break_search_down_by_project_and_user(billing: str) -> None:
    """The admin's CSV has a row per project of search (users summed) adding up to its line;
    FOCUS 1.3 tags each of search's rows with its project and user."""
    import csv
    import io

    month = month_of(time.time())
    lines = _get(billing, ADMIN, f"/v1/chargeback/{month}").json()["lines"]
    search_cents = sum(ln["total_cents"] for ln in lines if ln["team"] == "search")
    text = _get(billing, ADMIN, f"/v1/chargeback/{month}.csv").text
    rows = [r for r in csv.DictReader(io.StringIO(text)) if r["team"] == "search"]
    assert sorted(r["project"] for r in rows) == ["alpha", "beta"]
    assert round(sum(float(r["total_usd"]) for r in rows) * 100) == search_cents
    focus = _get(billing, ADMIN, f"/v1/chargeback/{month}.focus.csv?version=1.3").text
    tags = [
        orjson.loads(r["Tags"])
        for r in csv.DictReader(io.StringIO(focus))
        if r["SubAccountName"] == "search"
    ]
    assert {(t.get("project"), t.get("user")) for t in tags} == {
        ("alpha", "ana"),
        ("alpha", "ben"),
        ("beta", None),
    }
