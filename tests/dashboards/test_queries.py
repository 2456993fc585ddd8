"""The dashboards' queries over the minute rollups, and the query API's access rules."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import orjson
import polars as pl
import pytest
from fastapi.testclient import TestClient
from polars.testing import assert_frame_equal

from billing import queries
from billing.api import create_app
from billing.buckets import bucket_of, quantile
from billing.ledger import Ledger
from billing.rollups import Rollups
from infermeter.months import month_of
from tests.dashboards import records
from tests.dashboards.records import ADMIN_KEY, REPLICAS, TEAM_KEYS, TEAMS


@pytest.fixture
def fleet():
    return records.build(records.recent_start())


@pytest.fixture
def ledger(config, fleet):
    ledger = records.open_ledger(config, ":memory:", fleet)
    yield ledger
    ledger.close()


def run(ledger: Ledger, name: str, fleet: records.Fleet, **kw: Any) -> pl.DataFrame:
    params = queries.params_from(fleet.start, fleet.start + 3600, **kw)
    with ledger.reader() as cur:
        return queries.run(cur, name, params)


@pytest.mark.parametrize(
    ("span", "step"),
    [(3600, 60), (6 * 3600, 300), (24 * 3600, 900), (7 * 86400, 3600), (31 * 86400, 21600)],
)
def test_auto_step_keeps_series_short(span, step):
    """The automatic step is the smallest usual one that keeps a series within MAX_POINTS."""
    assert queries.auto_step(0, span) == step
    assert span / step <= queries.MAX_POINTS


# A day the calendar serves (2024-01-01), for the ranges that must fail for another reason.
DAY0 = 1_704_067_200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 5), "to > from"),
        ((0, 3600), "must lie within"),
        ((DAY0, DAY0 + 100 * 86400), "at most 93"),
        ((DAY0, DAY0 + 3600, 90), "whole number of minutes"),
    ],
)
def test_bad_ranges_are_refused(args, message):
    """A reversed range, one outside the calendar served or too long, or a step that is not
    whole minutes, is a ValueError."""
    with pytest.raises(ValueError, match=message):
        queries.params_from(*args)


def test_throughput_counts_every_request(ledger, fleet):
    """Requests/s times the step adds up to the number of requests per model."""
    frame = run(ledger, "throughput", fleet, step=3600)
    per_model = Counter(r["model"] for r in fleet.usage)
    got = {m: round(v * 3600) for m, v in frame.select("model", "requests_per_second").rows()}
    assert got == dict(per_model)


def test_error_ratio_is_failed_over_requests(ledger, fleet):
    """The error ratio is upstream errors over requests, per model."""
    frame = run(ledger, "throughput", fleet, step=3600, model="chat-large")
    rows = [r for r in fleet.usage if r["model"] == "chat-large"]
    expected = sum(r["status"] == "upstream_error" for r in rows) / len(rows)
    assert frame["error_ratio"].to_list() == [pytest.approx(expected)]


def test_ttft_quantiles_match_the_bucket_quantile(ledger, fleet):
    """SQL p50/p95 per model and step equal billing.buckets.quantile over the same buckets."""
    frame = run(ledger, "ttft", fleet, step=900)
    for t, model, _, p50, p95 in frame.rows():
        ttfts = [
            r["first_token_at"] - r["received_at"]
            for r in fleet.usage
            if r["model"] == model and t <= r["finished_at"] // 60 * 60 < t + 900
        ]
        counts = Counter(bucket_of(x) for x in ttfts)
        assert p50 == pytest.approx(quantile(0.5, counts.items()))
        assert p95 == pytest.approx(quantile(0.95, counts.items()))
    assert frame.height == 2 * 4


def test_worst_hours_rank_the_slow_period_first(ledger, fleet):
    """The one hour of data is every model's worst hour, with a p95 in the slow range."""
    frame = run(ledger, "worst_hours", fleet)
    assert frame["t"].unique().to_list() == [fleet.start]
    assert sorted(frame["model"]) == ["chat-large", "chat-small"]
    assert all(p95 > 2.0 for p95 in frame["p95_seconds"])


def test_sla_compliance_is_the_share_within_target(ledger, fleet, config):
    """Compliance is the share of requests with TTFT at or below the model's target."""
    frame = run(ledger, "sla", fleet).filter(pl.col("team") == "search")
    for model, compliance in frame.select("model", "compliance").rows():
        target = config.model(model).sla.ttft_p95_seconds
        rows = [r for r in fleet.usage if r["model"] == model and r["team"] == "search"]
        within = sum(r["first_token_at"] - r["received_at"] <= target for r in rows)
        assert compliance == pytest.approx(within / len(rows))


def test_gpu_utilization_and_power_are_time_weighted_means(ledger, fleet):
    """Mean utilization and power per replica are the samples' means over GPU time."""
    frame = run(ledger, "gpus", fleet, step=3600).filter(pl.col("replica") == "large-0")
    assert frame["utilization"].to_list() == [pytest.approx(0.55)]
    assert frame["power_watts"].to_list() == [pytest.approx(325.0)]
    assert frame["gpus"].to_list() == [pytest.approx(2.0)]


def test_engine_queue_and_kv_per_replica(ledger, fleet):
    """Queue depth and KV-cache use are the engine samples' means per replica."""
    frame = run(ledger, "engine", fleet, step=3600)
    assert sorted(frame["replica"]) == sorted(REPLICAS)
    waiting = [
        e["requests_waiting"]
        for e in fleet.engine
        if e["replica"] == "small-0" and e["timestamp"] < fleet.start + 3600
    ]
    assert frame["requests_waiting"].to_list() == [pytest.approx(sum(waiting) / len(waiting))] * 3
    assert frame["kv_cache_usage"].to_list() == [pytest.approx(0.25)] * 3


def test_replicas_reporting_at_the_end_of_the_range(ledger, fleet):
    """Replicas that sent engine samples just before the range's end are counted per model."""
    frame = run(ledger, "replicas", fleet)
    assert dict(frame.select("model", "replicas").rows()) == {"chat-large": 1, "chat-small": 2}


@pytest.fixture
def client(config, ledger):
    with TestClient(create_app(config, ledger)) as c:
        yield c


def get(client: TestClient, name: str, key: str, fleet: records.Fleet, **params: Any) -> Any:
    q = {"from": fleet.start, "to": fleet.start + 3600, **params}
    return client.get(f"/v1/query/{name}", params=q, headers={"authorization": f"Bearer {key}"})


def test_admin_sees_every_team(client, fleet):
    """The admin key's team usage lists every team."""
    body = get(client, "team_usage", ADMIN_KEY, fleet).json()
    teams = {row[body["columns"].index("team")] for row in body["rows"]}
    assert teams == set(TEAMS)


def test_team_key_is_held_to_its_own_team(client, fleet):
    """A team key gets only its own rows, whether or not it names its team."""
    for params in ({}, {"team": "search"}):
        body = get(client, "team_usage", TEAM_KEYS["search"], fleet, **params).json()
        assert body["team"] == "search"
        assert {row[0] for row in body["rows"]} == {"search"}
        requests = sum(row[body["columns"].index("requests")] for row in body["rows"])
        assert requests == sum(r["team"] == "search" for r in fleet.usage)


@pytest.mark.parametrize(
    ("name", "params"), [("team_usage", {"team": "assistant"}), ("gpus", {}), ("engine", {})]
)
def test_team_key_may_not_read_others_or_the_fleet(client, fleet, name, params):
    """Another team's rows and fleet-wide telemetry are 403 for a team key."""
    response = get(client, name, TEAM_KEYS["search"], fleet, **params)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "forbidden"


def test_unknown_key_and_unknown_query(client, fleet):
    """No key is 401; an unknown query name is 404 listing the known ones."""
    assert get(client, "ttft", "nope", fleet).status_code == 401
    response = get(client, "nope", ADMIN_KEY, fleet)
    assert response.status_code == 404
    assert "throughput" in response.json()["error"]["message"]


def test_index_names_the_caller(client):
    """GET /v1/query says who the key belongs to, which teams it may see and when the key
    expires (a configured key: never)."""
    body = client.get(
        "/v1/query", headers={"authorization": f"Bearer {TEAM_KEYS['search']}"}
    ).json()
    assert body["caller"] == {
        "name": "search",
        "team": "search",
        "is_admin": False,
        "reads_all": False,
        "role": "member",
        "who": "search",
        "expires_at": None,
    }
    assert body["teams"] == ["search"]
    assert "gpus" not in body["queries"]


def test_answers_are_json_with_nulls_for_empty_means(client, fleet):
    """A range with no data answers with no rows; the step served is echoed."""
    body = get(
        client,
        "throughput",
        ADMIN_KEY,
        fleet,
        **{"from": fleet.start - 7200, "to": fleet.start - 3600},
    ).json()
    assert body["rows"] == []
    assert body["step"] == 60
    assert not math.isnan(body["from"])


@pytest.mark.parametrize("team", [None, "search"])
@pytest.mark.parametrize(
    "name", ["throughput", "ttft", "worst_hours", "sla", "team_usage", "gpus", "engine"]
)
@pytest.mark.parametrize(
    ("offset", "span", "step"),
    [(0, 3600, 3600), (0, 3600, 300), (-1800, 7200, 3600), (420, 2700, 300), (0, 3600, 60)],
)
def test_coarse_rollups_answer_as_the_minutes_do(ledger, fleet, name, offset, span, step, team):
    """Reading whole periods from the 5-minute and hourly copies changes no answer."""
    rollups = Rollups(ledger, settle_seconds=0)
    rollups.refresh(fleet.start + 3600)
    coverage = rollups.coverage()
    assert coverage[("ttft_buckets", 60)] == (fleet.start // 60, fleet.start // 60 + 60)
    start = fleet.start + offset
    with ledger.reader() as cur:
        minute = queries.run(cur, name, queries.params_from(start, start + span, step, team))
        coarse_params = queries.params_from(start, start + span, step, team, coverage=coverage)
        coarse = queries.run(cur, name, coarse_params)
    assert minute.height > 0
    assert_frame_equal(coarse, minute, check_exact=False, rel_tol=1e-9)


def test_coarse_rollups_are_read_when_they_cover_the_range(ledger, fleet):
    """A range of whole covered hours reads the hourly copy, not the minute table."""
    rollups = Rollups(ledger, settle_seconds=0)
    rollups.refresh(fleet.start + 3600)
    params = queries.params_from(fleet.start, fleet.start + 3600, 3600, coverage=rollups.coverage())
    sql, _ = queries.throughput_sql(params)
    assert "usage_slots_all_60m" in sql
    sql, _ = queries.throughput_sql(
        queries.params_from(fleet.start, fleet.start + 3600, 60, coverage=rollups.coverage())
    )
    assert "_60m" not in sql
    assert "_5m" not in sql


def test_late_records_are_rerolled(config, fleet):
    """A record that arrives after a refresh is in the coarse copy after the next one."""
    ledger = records.open_ledger(config, ":memory:", fleet)
    try:
        rollups = Rollups(ledger, settle_seconds=0)
        rollups.refresh(fleet.start + 3600)
        late = dict(fleet.usage[0], request_id="late-1")
        ledger.ingest(orjson.dumps({"usage": [late]}))
        rollups.refresh(fleet.start + 3660)
        params = queries.params_from(
            fleet.start, fleet.start + 3600, 3600, coverage=rollups.coverage()
        )
        with ledger.reader() as cur:
            frame = queries.run(cur, "team_usage", params)
        assert int(frame["requests"].sum()) == len(fleet.usage) + 1
    finally:
        ledger.close()


def _figures(body: Any) -> Any:
    """An answer without its ``as_of`` times (two answers read the ledger at different moments)."""
    if isinstance(body, list):
        return [_figures(row) for row in body]
    return {k: v for k, v in body.items() if k != "as_of"}


def test_cached_statement_answers_as_the_chargeback_api(client, fleet):
    """/v1/query/statement/{month} and /v1/query/spend answer as /v1/chargeback and /v1/spend."""
    month = month_of(fleet.start)
    for key in (ADMIN_KEY, TEAM_KEYS["search"]):
        headers = {"authorization": f"Bearer {key}"}
        cached = client.get(f"/v1/query/statement/{month}", headers=headers).json()
        fresh = client.get(f"/v1/chargeback/{month}", headers=headers).json()
        assert _figures(cached) == _figures(fresh)
        assert (
            client.get("/v1/query/spend", headers=headers).json()
            == client.get("/v1/spend", headers=headers).json()
        )
    assert (
        client.get(
            "/v1/query/statement/2026-13", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        ).status_code
        == 400
    )


def test_cached_answers_say_when_the_ledger_was_read_and_for_how_long(config, ledger, fleet):
    """The cached statement and spend carry ``as_of`` and a private max-age of at most the TTL."""
    app = create_app(config, ledger, statement_ttl_seconds=7)
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    month = month_of(fleet.start)
    with TestClient(app) as c:
        before = time.time()
        statement = c.get(f"/v1/query/statement/{month}", headers=headers)
        spend = c.get("/v1/query/spend", headers=headers)
    assert before <= statement.json()["as_of"] <= time.time()
    assert {row["as_of"] for row in spend.json()} <= {spend.json()[0]["as_of"]}
    for answer in (statement, spend):
        assert answer.headers["cache-control"] in {"private, max-age=7", "private, max-age=6"}


def test_a_statement_past_its_lifetime_is_recomputed_before_it_is_served(config, ledger, fleet):
    """Past ``billing.statement_ttl_seconds`` the next answer is computed anew, never the old copy."""
    app = create_app(config, ledger, statement_ttl_seconds=2)
    month = month_of(fleet.start)
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    with TestClient(app) as c:
        first = c.get(f"/v1/query/statement/{month}", headers=headers).json()
        late = dict(fleet.usage[0], request_id="late-2", completion_tokens=10_000)
        ledger.ingest(orjson.dumps({"usage": [late]}))
        within = c.get(f"/v1/query/statement/{month}", headers=headers).json()
        time.sleep(max(0.0, first["as_of"] + 2 - time.time()) + 0.05)
        after = c.get(f"/v1/query/statement/{month}", headers=headers).json()
    assert within == first
    assert sum(line["requests"] for line in after["lines"]) == len(fleet.usage) + 1
    assert after["as_of"] > first["as_of"]


def test_records_arriving_long_after_their_time_reach_the_coarse_copies(config, fleet):
    """A record a day late (outside the re-roll window) is in the hourly copy after a refresh."""
    ledger = records.open_ledger(config, ":memory:", fleet)
    try:
        rollups = Rollups(ledger, settle_seconds=0, reroll_minutes=60)
        rollups.refresh(fleet.start + 3600)
        rollups.refresh(fleet.start + 86400 + 3600)
        late = dict(fleet.usage[0], request_id="late-by-a-day")
        ledger.ingest(orjson.dumps({"usage": [late]}), now=fleet.start + 86400 + 3660)
        rollups.refresh(fleet.start + 86400 + 3720)
        params = queries.params_from(
            fleet.start, fleet.start + 3600, 3600, coverage=rollups.coverage()
        )
        assert "_60m" in queries.throughput_sql(params)[0]
        with ledger.reader() as cur:
            frame = queries.run(cur, "team_usage", params)
        assert int(frame["requests"].sum()) == len(fleet.usage) + 1
    finally:
        ledger.close()
