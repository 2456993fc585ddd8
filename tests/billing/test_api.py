"""The billing API over real loopback HTTP: ingest, access rules, exports, metrics."""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing.api import create_app
from billing.ledger import Ledger
from billing.queries import QUERIES
from infermeter.config import Config
from infermeter.records import USAGE
from infermeter.shipper import Shipper
from infermeter.spool import Spool
from infermeter.wire import ARROW_STREAM, NDJSON, encode_arrow
from tests.billing.conftest import NOV, batch, bearer, gpu_samples, ndjson, usage
from tests.servers import serving

ADMIN, INGEST, METRICS = "im-demo-admin", "im-demo-ingest", "im-demo-metrics"
SEARCH, ASSISTANT = "im-demo-search", "im-demo-assistant"


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """The billing API over the in-memory ledger, on a loopback port."""
    async with serving(create_app(config, ledger), lifespan="off") as url:
        yield url


async def _seed(url: str) -> None:
    """November usage for search and assistant on small-0, and the GPU under it."""
    records = [
        usage("search", NOV + 3600, 120),
        usage("assistant", NOV + 3650, 200),
        usage("search", NOV + 7200, 30, model='=HYPERLINK("http://x")'),
    ]
    async with httpx.AsyncClient(base_url=url, headers=bearer(INGEST)) as client:
        for body in (
            batch("usage", records),
            batch("gpu_samples", gpu_samples(start=NOV + 3600, seconds=7200)),
        ):
            response = await client.post("/v1/ingest", content=body)
            assert response.status_code == 200, response.text
            assert response.json()["rejected"] == []


async def test_ingest_acknowledges_what_it_kept(billing):
    """The answer counts accepted, duplicate and rejected records, with reasons."""
    body = batch("usage", [usage(), usage(completion_tokens=-5)])
    async with httpx.AsyncClient(base_url=billing, headers=bearer(INGEST)) as client:
        first = (await client.post("/v1/ingest", content=body)).json()
        second = (await client.post("/v1/ingest", content=body)).json()
    assert (first["accepted"], first["duplicates"], len(first["rejected"])) == (1, 0, 1)
    assert first["rejected"][0]["reason"] == "token counts must not be negative"
    assert (second["accepted"], second["duplicates"]) == (0, 1)


@pytest.mark.parametrize(
    ("key", "status"),
    [(None, 401), ("wrong-key", 401), (SEARCH, 403), (ADMIN, 403), (METRICS, 403)],
)
async def test_only_the_ingest_token_may_ingest(billing, key, status):
    """Missing or unknown credentials are 401; known ones that are not the ingest token, 403."""
    headers = bearer(key) if key else {}
    async with httpx.AsyncClient(base_url=billing, headers=headers) as client:
        response = await client.post("/v1/ingest", content=batch("usage", [usage()]))
    assert response.status_code == status
    assert "error" in response.json()


async def test_a_malformed_batch_is_a_400_in_openai_error_json(billing):
    """A body that is not a batch: 400 with a message saying why."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(INGEST)) as client:
        response = await client.post("/v1/ingest", content=b"{oops")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the body is not valid JSON"


async def test_a_fault_of_the_server_is_a_500_not_a_400(config, ledger):
    """A ValueError from the server's own code (no caller input involved) is a 500 in error JSON."""
    app = create_app(config, ledger)

    @app.get("/v1/faulty")
    async def faulty() -> None:
        # Stands for any bug in the service: nothing the caller sent is wrong.
        raise ValueError("cannot round 3 amounts to a total of -1 cents")

    async with serving(app, lifespan="off") as url, httpx.AsyncClient(base_url=url) as client:
        response = await client.get("/v1/faulty")
        malformed = await client.post("/v1/ingest", content=b"{oops", headers=bearer(INGEST))
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "internal server error",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert "cannot round" not in response.text
    assert malformed.status_code == 400


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nothing-here", 404),
        ("DELETE", "/v1/spend", 405),
        ("GET", "/v1/chargeback/2026-11.focus.csv?version=9", 422),
        ("GET", "/v1/chargeback/2026-13", 400),
        ("GET", "/v1/query/throughput?from=10&to=5", 400),
    ],
)
async def test_every_error_has_the_openai_shape(billing, method, path, status):
    """Routing, parameter and month errors answer with the same error object as the others."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(ADMIN)) as client:
        response = await client.request(method, path)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]


@pytest.mark.parametrize("name", sorted(QUERIES))
@pytest.mark.parametrize(
    ("start", "end"),
    [("1e19", "1.0000000000000002e19"), ("1e12", "1.0000000000036e12"), ("-1e12", "-999999996400")],
    ids=["past int64", "past 9999", "before 1970"],
)
async def test_a_query_range_outside_the_calendar_is_a_400_naming_the_bounds(
    billing, name, start, end
):
    """A finite range no calendar holds is the caller's error (400), never a 500, for any query."""
    async with httpx.AsyncClient(base_url=billing, headers=bearer(ADMIN)) as client:
        response = await client.get(f"/v1/query/{name}", params={"from": start, "to": end})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "invalid_value"
    assert "946684800..32503676400" in error["message"]


async def test_ndjson_ingest_route_answers_like_the_json_one(billing, ledger):
    """POST /v1/ingest/usage with one record a line: same counts and reasons, same credentials."""
    body = ndjson([usage(), usage(completion_tokens=-5)])
    async with httpx.AsyncClient(base_url=billing, headers=bearer(INGEST)) as client:
        first = (await client.post("/v1/ingest/usage", content=body)).json()
        second = (await client.post("/v1/ingest/usage", content=body)).json()
        unknown = await client.post("/v1/ingest/bills", content=body)
        too_many = await client.post("/v1/ingest/usage", content=b"{}\n" * 100_001)
    async with httpx.AsyncClient(base_url=billing, headers=bearer(SEARCH)) as client:
        forbidden = await client.post("/v1/ingest/usage", content=body)
    assert (first["accepted"], first["duplicates"]) == (1, 0)
    assert [r["reason"] for r in first["rejected"]] == ["token counts must not be negative"]
    assert (second["accepted"], second["duplicates"]) == (0, 1)
    assert unknown.status_code == 400
    assert "unknown record kind 'bills'" in unknown.json()["error"]["message"]
    assert too_many.status_code == 413
    assert forbidden.status_code == 403
    assert ledger._group._coming == 0  # refused requests withdrew their announcements


async def test_arrow_ingest_route_keeps_typed_batches_and_refuses_other_schemas(billing, ledger):
    """An Arrow stream is kept like NDJSON; a stream that is not Arrow is a 400 naming why."""
    lines = ndjson([usage(), usage(completion_tokens=-5)])
    encoded = encode_arrow(USAGE, lines)
    assert encoded is not None
    async with httpx.AsyncClient(base_url=billing, headers=bearer(INGEST)) as client:
        kept = await client.post(
            "/v1/ingest/usage", content=encoded, headers={"content-type": ARROW_STREAM}
        )
        garbage = await client.post(
            "/v1/ingest/usage", content=lines, headers={"content-type": ARROW_STREAM}
        )
    assert (kept.json()["accepted"], [r["reason"] for r in kept.json()["rejected"]]) == (
        1,
        ["token counts must not be negative"],
    )
    assert garbage.status_code == 400
    assert "not an Arrow IPC stream" in garbage.json()["error"]["message"]
    assert ledger._group._coming == 0  # the refused stream withdrew its announcement


class _Recorder:
    """An ingest stand-in that records each POST's content type; it may refuse Arrow."""

    def __init__(self, refuse_arrow: bool) -> None:
        self.refuse_arrow = refuse_arrow
        self.types: list[str] = []

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        while (await receive()).get("more_body"):
            pass
        ctype = dict(scope["headers"]).get(b"content-type", b"").decode()
        self.types.append(ctype)
        status = 415 if self.refuse_arrow and ctype == ARROW_STREAM else 200
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"rejected": []}'})


@pytest.mark.parametrize(
    ("records", "refuse_arrow", "sent"),
    [
        ("typed", False, [ARROW_STREAM]),
        ("one string for a number", False, [NDJSON]),
        ("typed", True, [ARROW_STREAM, NDJSON]),
    ],
)
async def test_the_shipper_sends_arrow_when_lines_convert_and_ndjson_otherwise(
    tmp_path, records, refuse_arrow, sent
):
    """Arrow for exact batches; NDJSON for the rest, and when billing refuses Arrow."""
    batch_records = [usage(), usage()]
    if records != "typed":
        batch_records[1]["prompt_tokens"] = "100"
    spool = Spool(tmp_path / "spool", roll_seconds=0.0)
    spool.open()
    for record in batch_records:
        await spool.append(record)
    recorder = _Recorder(refuse_arrow)
    async with serving(recorder, lifespan="off") as url, httpx.AsyncClient() as client:
        assert await Shipper(spool, f"{url}/v1/ingest", INGEST, "usage", client).ship_once() == 2
    await spool.close()
    assert recorder.types == sent


async def test_metrics_count_ingest_by_outcome_format_and_transaction(billing):
    """/metrics tells operators what ingest kept, refused and how it grouped transactions."""
    lines = ndjson([usage(), usage(completion_tokens=-5)])
    encoded = encode_arrow(USAGE, lines)
    async with httpx.AsyncClient(base_url=billing, headers=bearer(INGEST)) as client:
        await client.post(
            "/v1/ingest/usage", content=encoded, headers={"content-type": ARROW_STREAM}
        )
        await client.post("/v1/ingest/usage", content=lines, headers={"content-type": NDJSON})
        await client.post("/v1/ingest", content=batch("usage", [usage()]))
        text = (await client.get("/metrics", headers=bearer(METRICS))).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }

    def records(outcome: str) -> float:
        return samples[
            ("infermeter_billing_ingest_records_total", (("kind", "usage"), ("outcome", outcome)))
        ]

    assert (records("accepted"), records("duplicate"), records("rejected")) == (2, 1, 2)
    for fmt in ("arrow", "ndjson", "json"):
        assert (
            samples[
                ("infermeter_billing_ingest_batches_total", (("format", fmt), ("kind", "usage")))
            ]
            == 1
        )
    assert samples[("infermeter_billing_ingest_transactions_total", ())] == 3
    assert samples[("infermeter_billing_ingest_transaction_records_total", ())] == 2
    assert samples[("infermeter_billing_ingest_waiting_batches", ())] == 0


async def test_a_team_reads_only_its_own_statement(billing):
    """search's key sees search's lines; asking with no key is 401."""
    await _seed(billing)
    async with httpx.AsyncClient(base_url=billing) as client:
        mine = (await client.get("/v1/chargeback/2026-11", headers=bearer(SEARCH))).json()
        everything = (await client.get("/v1/chargeback/2026-11", headers=bearer(ADMIN))).json()
        anonymous = await client.get("/v1/chargeback/2026-11")
    assert {line["team"] for line in mine["lines"]} == {"search"}
    assert "fleet_cents" not in mine
    assert {line["team"] for line in everything["lines"]} == {"search", "assistant"}
    assert everything["reconciles"] is True
    assert anonymous.status_code == 401


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chargeback/2026-11.csv",
        "/v1/chargeback/2026-11.focus.csv",
        "/v1/months",
        "/v1/months/2026-10/close",
    ],
)
async def test_cross_team_views_need_the_admin_credential(billing, path):
    """The metrics and ingest tokens get 403 on every view; team keys on months and closing."""
    # A team key gets its own lines in the files (test_a_teams_files_hold_only_its_own_lines).
    keys = (METRICS, INGEST) if path.endswith(".csv") else (SEARCH, METRICS, INGEST)
    async with httpx.AsyncClient(base_url=billing) as client:
        for key in keys:
            method = client.post if path.endswith("close") else client.get
            assert (await method(path, headers=bearer(key))).status_code == 403


async def test_a_teams_files_hold_only_its_own_lines(billing):
    """search's key gets the CSV and FOCUS rows of search only, as the admin's files have them
    (FOCUS 1.3's allocation ratios too: a row's share of its instance's whole cost, other teams'
    use of it included)."""
    await _seed(billing)
    paths = (
        "/v1/chargeback/2026-11.csv",
        "/v1/chargeback/2026-11.focus.csv",
        "/v1/chargeback/2026-11.focus.csv?version=1.3",
    )
    async with httpx.AsyncClient(base_url=billing) as client:
        files = {}
        for key in (SEARCH, ADMIN):
            for path in paths:
                response = await client.get(path, headers=bearer(key))
                assert response.status_code == 200, response.text
                rows = csv.DictReader(io.StringIO(response.text))
                # The CSV's last row is the file's own total, which differs by design.
                files[key, path] = [r for r in rows if r.get("line_type") != "total"]
    for path in paths:
        team_column = "x_Team" if "focus" in path else "team"
        mine, everything = files[SEARCH, path], files[ADMIN, path]
        assert {row[team_column] for row in mine} == {"search"}
        assert mine == [row for row in everything if row[team_column] == "search"]
        assert {row[team_column] for row in everything} == {"search", "assistant"}
    ratios = [
        orjson.loads(row["AllocatedMethodDetails"])["Elements"][0]["AllocatedRatio"]
        for row in files[SEARCH, paths[2]]
    ]
    assert ratios
    assert all(0 < r < 1 for r in ratios)


async def test_spend_shows_a_team_only_itself(billing):
    """/v1/spend: all teams for the admin, one for a team."""
    await _seed(billing)
    async with httpx.AsyncClient(base_url=billing) as client:
        admin = (await client.get("/v1/spend", headers=bearer(ADMIN))).json()
        team = (await client.get("/v1/spend", headers=bearer(ASSISTANT))).json()
    assert {row["team"] for row in admin} == {"search", "assistant", "analytics", "research"}
    assert [row["team"] for row in team] == ["assistant"]


async def test_the_csv_is_the_statement_and_is_safe_in_a_spreadsheet(billing):
    """The admin's CSV has the documented header, totals equal to the statement, no live formula."""
    await _seed(billing)
    async with httpx.AsyncClient(base_url=billing, headers=bearer(ADMIN)) as client:
        text = (await client.get("/v1/chargeback/2026-11.csv")).text
        statement = (await client.get("/v1/chargeback/2026-11")).json()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0]) == [
        "month",
        "team",
        "model",
        "line_type",
        "for_month",
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "gpu_hours",
        "energy_kwh",
        "compute_usd",
        "energy_usd",
        "idle_usd",
        "total_usd",
        "team_budget_usd",
        "team_budget_used_percent",
        "basis",
        "pricing_category",
        "pool",
        "project",
    ]
    # No invoice and no node pools in the demo's price book: list prices, no pool named.
    assert {(r["basis"], r["pool"]) for r in rows} == {("list", "")}
    *lines, total = rows
    assert total["line_type"] == "total"
    assert round(sum(float(r["total_usd"]) for r in lines) * 100) == statement["fleet_cents"]
    assert round(float(total["total_usd"]) * 100) == statement["fleet_cents"]
    models = {r["model"] for r in rows}
    assert '\'=HYPERLINK("http://x")' in models
    assert not any(cell.startswith(("=", "+", "@")) for r in rows for cell in r.values())


async def test_metrics_export_spend_budget_and_forecast(billing):
    """/metrics (metrics token) has the three money gauges per team; a team key gets 403."""
    await _seed(billing)
    async with httpx.AsyncClient(base_url=billing) as client:
        text = (await client.get("/metrics", headers=bearer(METRICS))).text
        denied = await client.get("/metrics", headers=bearer(SEARCH))
    assert denied.status_code == 403
    families = {f.name: f for f in text_string_to_metric_families(text)}
    budgets = {s.labels["team"]: s.value for s in families["infermeter_team_budget_usd"].samples}
    assert budgets["search"] == 6000
    assert {s.labels["team"] for s in families["infermeter_team_spend_usd"].samples} >= {
        "search",
        "assistant",
    }
    assert "infermeter_team_spend_forecast_usd" in families


async def test_the_shipper_delivers_a_spool_and_dead_letters_rejects(billing, tmp_path):
    """Sidecar spool -> shipper -> billing: good records kept once, bad ones in rejected.jsonl."""
    spool = Spool(tmp_path / "spool", roll_seconds=0.0)
    spool.open()
    for record in [usage(), usage(), usage(completion_tokens=-5)]:
        await spool.append(record)
    async with httpx.AsyncClient() as client:
        shipper = Shipper(spool, f"{billing}/v1/ingest", INGEST, "usage", client)
        assert await shipper.ship_once() == 3
    await spool.close()
    rejected = [
        orjson.loads(line)
        for line in (tmp_path / "spool" / "rejected.jsonl").read_bytes().splitlines()
    ]
    assert [r["record"]["completion_tokens"] for r in rejected] == [-5]
    assert rejected[0]["reason"] == "token counts must not be negative"
    assert await spool.closed_segments() == []


async def test_the_shipper_skips_a_torn_last_line_and_ships_the_rest(billing, ledger, tmp_path):
    """A segment left by a process that died mid-write: its whole lines ship, the torn one does not."""
    directory = tmp_path / "spool"
    directory.mkdir()
    records = [usage(), usage()]
    torn = orjson.dumps(usage())[:40]
    (directory / "seg-00000000000000000001.jsonl").write_bytes(ndjson(records) + torn)
    spool = Spool(directory, roll_seconds=0.0)
    spool.open()
    async with httpx.AsyncClient() as client:
        shipper = Shipper(spool, f"{billing}/v1/ingest/", INGEST, "usage", client)
        assert await shipper.ship_once() == 2
    await spool.close()
    with ledger.reader() as cur:
        kept = cur.execute("SELECT request_id FROM usage ORDER BY request_id").fetchall()
    assert kept == sorted((r["request_id"],) for r in records)
    assert not (directory / "rejected.jsonl").exists()
    assert await spool.closed_segments() == []


async def test_parquet_export_writes_every_table(billing, config, tmp_path):
    """POST /v1/admin/export writes Parquet that reads back with the same row counts."""
    import duckdb

    await _seed(billing)
    config_dir = Path(config.billing.export_dir)
    async with httpx.AsyncClient(base_url=billing, headers=bearer(ADMIN)) as client:
        response = await client.post("/v1/admin/export", params={"partitioned": "true"})
    assert response.status_code == 200
    directory = Path(response.json()["directory"])
    try:
        assert {"usage", "gpu_slots.parquet", "statement_lines.parquet"} <= set(
            response.json()["tables"]
        )
        count = duckdb.execute(
            f"SELECT count(*) FROM read_parquet('{directory}/usage/*/*.parquet', hive_partitioning=true)"
        ).fetchall()
        assert count == [(3,)]
        months = duckdb.execute(
            f"SELECT DISTINCT month FROM read_parquet('{directory}/usage/*/*.parquet', hive_partitioning=true)"
        ).fetchall()
        assert months == [("2026-11",)]
    finally:
        import shutil

        shutil.rmtree(directory)
        if config_dir.exists() and not any(config_dir.iterdir()):
            config_dir.rmdir()


async def test_a_closed_month_shows_closed_at_once_in_the_cached_views(billing):
    """The dashboards' cached statement follows a close immediately, not after its TTL."""
    from tests.billing.conftest import OCT

    async with httpx.AsyncClient(base_url=billing, headers=bearer(INGEST)) as client:
        await client.post("/v1/ingest", content=batch("usage", [usage("search", OCT + 3600, 60)]))
    async with httpx.AsyncClient(base_url=billing, headers=bearer(ADMIN)) as client:
        before = (await client.get("/v1/query/statement/2026-10")).json()
        assert (await client.post("/v1/months/2026-10/close")).status_code == 200
        after = (await client.get("/v1/query/statement/2026-10")).json()
    assert before["closed"] is False
    assert after["closed"] is True
