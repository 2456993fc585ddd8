"""Federation: two clusters' billing processes and a central one on loopback, over real HTTP.

Each cluster keeps records of October 2026 and closes the month through its route; the central
pulls the closed months with its per-cluster federation credential and serves one statement
and one FOCUS file across them. One cluster is stopped for a while: the central keeps serving
what it pulled of it, marked stale, and catches up once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import hashlib
import http.server
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import orjson
import polars as pl
import pydantic
import pytest
import yaml
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from billing.chargeback import Chargeback
from billing.closed_hours import month_hours
from billing.federation import (
    FederationError,
    central_hours,
    digest,
    month_payload,
    parse_payload,
)
from billing.federation_pull import Puller
from billing.federation_store import (
    MonthDigests,
    closed_months,
    federated_hours,
    federated_month,
    payload_of,
    replace_month,
)
from billing.ledger import Ledger
from infermeter.config import DEFAULT_CONFIG, BillingSettings, Config, load_config
from infermeter.serving import free_port
from infermeter.statement import LINE_SCHEMA, empty_pools
from tests.billing.conftest import NOV, OCT, batch, gpu_samples, usage
from tests.dashboards.stack import chromium, dashboard_thread
from tests.focus_spec import spec_failures
from tests.servers import stop_process, wait_healthy

ADMIN = {"Authorization": "Bearer im-demo-admin"}
INGEST = {"Authorization": "Bearer im-demo-ingest"}
TOKENS = {"east": "fed-east-secret", "west": "fed-west-secret"}
_CLUSTER = {"name": "eu-west", "url": "http://127.0.0.1:1", "token_env": "FED_EU_WEST"}


@dataclass
class Billing:
    """A billing process on loopback, with what it takes to start it again."""

    url: str
    config: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)


def _config(root: Path, port: int, **billing: Any) -> Path:
    """A configuration for billing on ``port`` with its ledger in ``root``."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["billing"].update(
        listen=f"127.0.0.1:{port}",
        url=f"http://127.0.0.1:{port}",
        database=str(root / "ledger.duckdb"),
        shared_ingest_token=True,
        retention={"interval_seconds": 0, "archive": str(root / "archive")},
        **billing,
    )
    if billing.get("cluster_name") == "west":  # a price book of its own: dearer GPUs
        data["prices"]["usd_per_gpu_hour"]["L40S"] = 2.10
    config = root / "infermeter.yaml"
    config.write_text(yaml.safe_dump(data))
    return config


def _start(service: Billing) -> None:
    """Start ``service``'s process and wait until it answers."""
    command = [sys.executable, "-m", "launcher", "billing", "--config", str(service.config)]
    service.process = subprocess.Popen(command, env=service.env)
    wait_healthy(service.process, service.url, what="billing")


def _stop(service: Billing) -> None:
    """Stop ``service``'s process (SIGTERM, then SIGKILL after 20 s)."""
    stop_process(service.process)


@contextmanager
def _running(*services: Billing) -> Iterator[None]:
    try:
        for service in services:
            _start(service)
        yield
    finally:
        for service in reversed(services):
            _stop(service)


@dataclass
class Federation:
    """Two clusters and their central."""

    east: Billing
    west: Billing
    central: Billing


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _close(service: Billing, month: str) -> None:
    response = httpx.post(f"{service.url}/v1/months/{month}/close", headers=ADMIN, timeout=30)
    assert response.status_code == 200, response.text


def _ingest(service: Billing, kind: str, records: list[Any]) -> None:
    response = httpx.post(f"{service.url}/v1/ingest", content=batch(kind, records), headers=INGEST)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    """Two clusters with a closed October (east also a closed November carrying a late October
    record as an adjustment) and a central pulling both, every hour on its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERMETER")}
    clusters = {}
    for name in TOKENS:
        port = free_port()
        root = tmp_path_factory.mktemp(name)
        config = _config(root, port, cluster_name=name)
        data = yaml.safe_load(config.read_text())
        data["federation_token_sha256"] = [_sha(TOKENS[name])]
        config.write_text(yaml.safe_dump(data))
        clusters[name] = Billing(f"http://127.0.0.1:{port}", config, env)
    port = free_port()
    listed = [
        {"name": n, "url": c.url, "token_env": f"FED_{n.upper()}"} for n, c in clusters.items()
    ]
    central_config = _config(
        tmp_path_factory.mktemp("central"),
        port,
        role="central",
        cluster_name="central",
        clusters=listed,
        federation={
            "interval_seconds": 3600,
            "attempts": 2,
            "backoff_seconds": 0.1,
            "timeout_seconds": 5,
        },
    )
    central_env = env | {f"FED_{n.upper()}": t for n, t in TOKENS.items()}
    central = Billing(f"http://127.0.0.1:{port}", central_config, central_env)
    east, west = clusters["east"], clusters["west"]
    with _running(east, west):
        for service, teams in ((east, ("search", "assistant")), (west, ("search", "research"))):
            _ingest(service, "gpu_samples", gpu_samples(start=OCT + 3600, seconds=3600))
            _ingest(
                service,
                "usage",
                [usage(t, OCT + 3700 + 100 * i, 300 + 200 * i) for i, t in enumerate(teams)],
            )
            _close(service, "2026-10")
        _ingest(east, "usage", [usage("analytics", OCT + 4000, 900)])  # late: November's adjustment
        _ingest(east, "gpu_samples", gpu_samples(start=NOV + 3600, seconds=1800))
        _close(east, "2026-11")
        with _running(central):
            yield Federation(east, west, central)


def _statement(service: Billing, month: str) -> dict[str, Any]:
    response = httpx.get(f"{service.url}/v1/federation/statement/{month}", headers=ADMIN)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _own(service: Billing, month: str) -> dict[str, Any]:
    response = httpx.get(f"{service.url}/v1/chargeback/{month}", headers=ADMIN, timeout=30)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _pull(central: Billing) -> dict[str, dict[str, Any]]:
    response = httpx.post(f"{central.url}/v1/federation/pull", headers=ADMIN, timeout=60)
    assert response.status_code == 200, response.text
    return {c["cluster"]: c for c in response.json()["clusters"]}


def _until_pulled(central: Billing) -> dict[str, Any]:
    """October's statement once the central's own first round has pulled both clusters."""
    deadline = time.monotonic() + 30
    while True:
        body = _statement(central, "2026-10")
        if not body["stale_clusters"]:
            return body
        assert time.monotonic() < deadline, f"not pulled in 30 s: {body['clusters']}"
        time.sleep(0.2)


def _cents(lines: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    keys = (
        "for_month",
        "team",
        "model",
        "requests",
        "compute_cents",
        "energy_cents",
        "idle_cents",
        "total_cents",
    )
    return sorted(tuple(line[k] for k in keys) for line in lines)


def test_the_central_statement_is_the_sum_of_the_clusters_cent_for_cent(
    federation: Federation,
) -> None:
    """Its own timer pulls both clusters; each cluster's lines and total arrive unchanged."""
    body = _until_pulled(federation.central)
    assert body["reconciles"]
    total = 0
    for name in TOKENS:
        own = _own(getattr(federation, name), "2026-10")
        mine = [line for line in body["lines"] if line["cluster"] == name]
        assert _cents(mine) == _cents(own["lines"])
        cluster = next(c for c in body["clusters"] if c["cluster"] == name)
        assert cluster["total_cents"] == cluster["stated_total_cents"] == own["total_cents"]
        total += own["total_cents"]
    assert body["total_cents"] == total > 0
    # West's price book is its own: the same hour of GPU costs it more.
    by = {c["cluster"]: c["total_cents"] for c in body["clusters"]}
    assert by["west"] > by["east"]


def test_an_adjustment_arrives_with_the_closed_month_that_issued_it(
    federation: Federation,
) -> None:
    """East's late October record is on its November statement, and on the central's."""
    _until_pulled(federation.central)
    body = _statement(federation.central, "2026-11")
    late = [line for line in body["lines"] if line["for_month"] == "2026-10"]
    assert {line["cluster"] for line in late} == {"east"}
    assert "analytics" in {line["team"] for line in late}
    own = _own(federation.east, "2026-11")
    assert _cents(body["lines"]) == _cents(own["lines"])
    west = next(c for c in body["clusters"] if c["cluster"] == "west")
    assert west["closed"] is False
    assert west["total_cents"] == 0
    assert body["reconciles"]


def test_pulling_twice_changes_nothing(federation: Federation) -> None:
    """A round over unchanged clusters fetches no month and leaves the statement as it was."""
    before = _until_pulled(federation.central)
    first = _pull(federation.central)
    second = _pull(federation.central)
    for report in (*first.values(), *second.values()):
        assert report["fetched"] == []
        assert report["error"] is None
    assert second["east"]["unchanged"] == 2
    assert second["west"]["unchanged"] == 1
    after = _statement(federation.central, "2026-10")
    assert after["lines"] == before["lines"]
    assert after["total_cents"] == before["total_cents"]


@pytest.mark.parametrize(
    ("token", "path", "status"),
    [
        (None, "/v1/federation/months", 401),
        ("wrong-token", "/v1/federation/months", 401),
        (TOKENS["west"], "/v1/federation/months", 401),  # west's credential is not east's
        ("im-demo-search", "/v1/federation/months", 403),  # a team reads no federation
        (TOKENS["east"], "/v1/chargeback/2026-10", 403),  # the federation role reads no statement
        (TOKENS["east"], "/v1/months", 403),
    ],
)
def test_a_cluster_takes_its_federation_credential_for_its_federation_route_only(
    federation: Federation, token: str | None, path: str, status: int
) -> None:
    """Another cluster's credential, an unknown one or none is 401; another role's is 403, and
    the federation credential is 403 on every other route."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    assert httpx.get(f"{federation.east.url}{path}", headers=headers).status_code == status


def test_an_open_month_is_not_federated(federation: Federation) -> None:
    """A cluster serves closed months only: December is 409, and not listed."""
    headers = {"Authorization": f"Bearer {TOKENS['east']}"}
    url = federation.east.url
    assert httpx.get(f"{url}/v1/federation/months/2026-12", headers=headers).status_code == 409
    listed = httpx.get(f"{url}/v1/federation/months", headers=headers).json()
    assert [m["month"] for m in listed["months"]] == ["2026-10", "2026-11"]


def test_the_federation_routes_of_a_central_are_not_on_a_cluster(federation: Federation) -> None:
    """A cluster has no statement across clusters nor puller: 404."""
    url = federation.east.url
    assert httpx.get(f"{url}/v1/federation/statement/2026-10", headers=ADMIN).status_code == 404
    assert httpx.post(f"{url}/v1/federation/pull", headers=ADMIN).status_code == 404


def test_the_focus_file_names_each_cluster_in_the_sub_account(federation: Federation) -> None:
    """FOCUS 1.2 rows of both clusters, SubAccountId "<cluster>/<team>", adding up to the total,
    and the file holds to the specification's checks."""
    body = _until_pulled(federation.central)
    response = httpx.get(
        f"{federation.central.url}/v1/federation/statement/2026-10.focus.csv", headers=ADMIN
    )
    assert response.status_code == 200, response.text
    rows = pl.read_csv(io.StringIO(response.text), infer_schema_length=0)
    assert set(rows["x_Cluster"]) == {"east", "west"}
    accounts = set(rows["SubAccountId"])
    assert {"east/search", "east/assistant", "west/search", "west/research"} <= accounts
    for row in rows.iter_rows(named=True):
        assert row["SubAccountId"].startswith(row["x_Cluster"] + "/")
    billed = sum(round(float(c) * 100) for c in rows["BilledCost"])
    assert billed == body["total_cents"]
    problems = spec_failures(list(csv.DictReader(io.StringIO(response.text))), "1.2")
    assert problems == [], problems


def _rows_by_first_cell(driver: webdriver.Chrome, table: str) -> dict[str, list[str]]:
    """The cells of each body row of the table ``table`` (a CSS selector), by the first cell."""
    rows = driver.find_elements(By.CSS_SELECTOR, f"{table} tbody tr")
    cells = [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]
    return {c[0]: c for c in cells}


def _shown(driver: webdriver.Chrome, css: str, text: str) -> str:
    """The text of the first element matching ``css`` once it contains ``text``."""

    def ready(d: webdriver.Chrome) -> str | bool:
        found = d.find_elements(By.CSS_SELECTOR, css)
        return (found[0].text or True) if found and text in found[0].text else False

    shown = WebDriverWait(driver, 30, poll_frequency=0.1).until(ready)
    return shown if isinstance(shown, str) else ""


def test_the_chargeback_page_of_a_central_lists_its_clusters(
    federation: Federation, tmp_path: Path
) -> None:
    """Signed in as the admin on the central's dashboard, October shows each cluster's total,
    neither stale, and that they add up to the statement across clusters."""
    body = _until_pulled(federation.central)
    config = load_config(federation.central.config, environ={})
    with (
        dashboard_thread(config, federation.central.url) as url,
        chromium(tmp_path) as driver,
    ):
        driver.get(url + "/chargeback?month=2026-10")
        _shown(driver, "#login-key", "")
        driver.find_element(By.ID, "login-key").send_keys("im-demo-admin")
        driver.find_element(By.ID, "login-button").click()
        total = _shown(driver, "#chargeback-clusters-total", "Across clusters")
        assert f"${body['total_cents'] / 100:,.2f}" in total
        assert "reconciles to the cent" in total
        assert "Stale" not in total
        by_cluster = _rows_by_first_cell(driver, "#chargeback-clusters-table")
        assert set(by_cluster) == {"east", "west"}
        for state in body["clusters"]:
            row = by_cluster[state["cluster"]]
            assert f"${state['total_cents'] / 100:,.2f}" in row
            assert row[3] == "no"  # stale
        said = _shown(driver, "#chargeback-cluster-hours-total", "Hours:")
        assert "adds up to its own lines to the cent" in said
        hours = _rows_by_first_cell(driver, "#chargeback-cluster-hours-table")
        assert set(hours) == {"east", "west"}
        for state in body["clusters"]:
            row = hours[state["cluster"]]
            assert row[1:2] == ["yes"]  # hours kept
            assert f"${state['total_cents'] / 100:,.2f}" in row
            assert row[3] == "yes"  # adds up


def _hours(service: Billing, month: str, **params: str) -> dict[str, Any]:
    response = httpx.get(
        f"{service.url}/v1/federation/hours/{month}", headers=ADMIN, params=params, timeout=30
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _summed(rows: list[dict[str, Any]], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        out[row[key]] = out.get(row[key], 0) + row["total_cents"]
    return out


def test_the_central_holds_each_clusters_hours_adding_up_to_its_statement(
    federation: Federation,
) -> None:
    """Each cluster's closed October arrives with its hours: the hourly cost adds up to the
    cluster's own statement to the cent, the usage to each team's lines, and the engines' tokens
    are reconciled per hour; one cluster's hours can be asked for alone."""
    _until_pulled(federation.central)
    body = _hours(federation.central, "2026-10")
    assert body["adds_up"]
    assert body["stale_clusters"] == []
    first, after = month_hours("2026-10")
    for name in TOKENS:
        own = _own(getattr(federation, name), "2026-10")
        cost = [r for r in body["hours"]["cost"] if r["cluster"] == name]
        assert cost
        assert all(first <= r["hour"] < after and r["month"] == "2026-10" for r in cost)
        assert sum(r["total_cents"] for r in cost) == own["total_cents"] > 0
        used = [r for r in body["hours"]["usage"] if r["cluster"] == name]
        assert _summed(used, "team") == {
            t: c for t, c in _summed(own["lines"], "team").items() if t in _summed(used, "team")
        }
        assert {line["team"] for line in own["lines"] if line["requests"]} <= {
            r["team"] for r in used
        }
        state = next(c for c in body["clusters"] if c["cluster"] == name)
        assert state["hourly"]
        assert state["hourly_cents"] == state["own_month_cents"] == own["total_cents"]
        reconciled = [r for r in body["hours"]["reconciliation"] if r["cluster"] == name]
        assert reconciled
        assert state["reconciliation"]["ledger_tokens"] == sum(
            r["ledger_tokens"] for r in reconciled
        )
    assert body["reconciliation"]["ledger_tokens"] == sum(
        c["reconciliation"]["ledger_tokens"] for c in body["clusters"]
    )
    figures = _hours(federation.central, "2026-10", rows="false")
    assert figures["hours"] is None
    assert figures["clusters"] == body["clusters"]
    alone = _hours(federation.central, "2026-10", cluster="east")
    assert {r["cluster"] for k in alone["hours"] for r in alone["hours"][k]} == {"east"}
    assert [c["cluster"] for c in alone["clusters"]] == ["east"]
    unknown = httpx.get(
        f"{federation.central.url}/v1/federation/hours/2026-10",
        headers=ADMIN,
        params={"cluster": "north"},
    )
    assert unknown.status_code == 404
    on_cluster = f"{federation.east.url}/v1/federation/hours/2026-10"
    assert httpx.get(on_cluster, headers=ADMIN).status_code == 404


def test_a_stopped_cluster_is_served_stale_and_caught_up_once_back(
    federation: Federation,
) -> None:
    """West down: the central keeps east's and west's last pulled lines, west marked stale since
    the failed pull; west back with a newly closed month: the next round fetches it."""
    central, west = federation.central, federation.west
    before = _until_pulled(central)
    _stop(west)
    try:
        failed_at = time.time()
        reports = _pull(central)
        assert reports["west"]["error"]
        assert reports["east"]["error"] is None
        body = _statement(central, "2026-10")
        assert body["stale_clusters"] == ["west"]
        state = next(c for c in body["clusters"] if c["cluster"] == "west")
        assert state["stale"]
        assert failed_at - 1 <= state["stale_since"] <= time.time()
        assert _cents(body["lines"]) == _cents(before["lines"])
        assert body["reconciles"]
        again = _pull(central)  # still down: stale since the first failure, not the latest
        assert again["west"]["error"]
        later = next(
            c for c in _statement(central, "2026-10")["clusters"] if c["cluster"] == "west"
        )
        assert later["stale_since"] == state["stale_since"]
    finally:
        _start(west)
    _ingest(west, "gpu_samples", gpu_samples(start=NOV + 3600, seconds=1800))
    _close(west, "2026-11")
    reports = _pull(central)
    assert reports["west"]["fetched"] == ["2026-11"]
    assert reports["west"]["error"] is None
    body = _statement(central, "2026-11")
    assert body["stale_clusters"] == []
    own = _own(west, "2026-11")
    assert _cents([x for x in body["lines"] if x["cluster"] == "west"]) == _cents(own["lines"])
    assert body["reconciles"]
    hours = _hours(central, "2026-11")
    caught = [r for r in hours["hours"]["cost"] if r["cluster"] == "west"]
    assert sum(r["total_cents"] for r in caught) == own["total_cents"] > 0
    assert hours["adds_up"]


def _payload() -> dict[str, Any]:
    lines = pl.DataFrame(
        [
            {
                "month": "2026-10",
                "for_month": "2026-10",
                "team": "search",
                "model": "chat-small",
                "requests": 2,
                "prompt_tokens": 200,
                "completion_tokens": 100,
                "gpu_hours": 0.5,
                "energy_kwh": 0.1,
                "compute_cents": 80,
                "energy_cents": 2,
                "idle_cents": 0,
                "total_cents": 82,
            }
        ],
        schema=LINE_SCHEMA,
    )
    return month_payload("east", "2026-10", "list", empty_pools(), lines).to_json()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"cluster": "west"}, "says it is 'west'"),
        ({"month": "2026-11"}, "answered '2026-11'"),
        ({"total_cents": 83}, "the cluster's total is 83"),
        ({"basis": "allocation"}, "does not match its digest"),
        ({"lines": "nope"}, "not a closed month's payload"),
        ({"prices": {"pue": "high"}}, "not a closed month's payload"),
    ],
)
def test_a_payload_that_is_not_what_was_asked_for_is_refused(
    change: dict[str, Any], why: str
) -> None:
    """Another cluster's or month's answer, a total its lines do not make, or content changed
    after its digest was taken is never stored."""
    with pytest.raises(FederationError, match=why):
        parse_payload(_payload() | change, "east", "2026-10")


def test_a_payload_round_trips_with_its_digest() -> None:
    """What a cluster serves parses back to the same content and digest."""
    body = _payload()
    parsed = parse_payload(orjson.loads(orjson.dumps(body)), "east", "2026-10")
    assert parsed.to_json() == body
    tampered = body["lines"][0] | {"total_cents": 81}
    with pytest.raises(FederationError):
        parse_payload(body | {"lines": [tampered], "total_cents": 81}, "east", "2026-10")


def _hourly_payload(cost_cents: int = 82) -> dict[str, Any]:
    """``_payload``'s month with one hour of each kind, its cost ``cost_cents`` (the month's
    lines: 82 cents)."""
    hour = month_hours("2026-10")[0] + 5
    key = {"month": "2026-10", "hour": hour}
    hours = {
        "cost": pl.DataFrame(
            [
                key
                | {
                    "replica": "small-0",
                    "gpu_model": "L40S",
                    "gpu_hours": 0.5,
                    "energy_kwh": 0.1,
                    "total_cents": cost_cents,
                }
            ]
        ),
        "usage": pl.DataFrame(
            [
                key
                | {
                    "team": "search",
                    "model": "chat-small",
                    "requests": 2,
                    "prompt_tokens": 200,
                    "completion_tokens": 100,
                    "gpu_hours": 0.5,
                    "total_cents": 82,
                }
            ]
        ),
        "reconciliation": pl.DataFrame(
            [
                key
                | {
                    "replica": "small-0",
                    "model": "chat-small",
                    "engine_tokens": 310,
                    "ledger_tokens": 300,
                    "difference_tokens": 10,
                    "hangup_tokens": 0,
                    "unattributed_tokens": 10,
                    "ledger_excess_tokens": 0,
                    "unreconciled_requests": 0,
                    "unreconciled_tokens": 0,
                }
            ]
        ),
    }
    hours["lifetimes"] = pl.DataFrame(
        [
            key
            | {
                "replica": "small-0",
                "model": "chat-small",
                "gpu_model": "L40S",
                "instances": 2,
                "started": 1,
                "stopped": 0,
                "ended_without_stop": 1,
                "instance_hours": 1.25,
                "gpu_hours": 1.25,
            }
        ]
    )
    body = _payload()
    lines = pl.DataFrame(body["lines"], schema=LINE_SCHEMA)
    return month_payload("east", "2026-10", "list", empty_pools(), lines, None, hours).to_json()


def test_a_payload_without_hours_keeps_the_digest_it_had_before_hours() -> None:
    """A cluster of an earlier version (no hours) is understood: its digest is the SHA-256 of
    the month's lines, basis and pools alone, as it always was, and it parses without hours."""
    body = _payload()
    assert "hours" not in body
    before = {"month": "2026-10", "basis": "list", "pools": [], "lines": body["lines"]}
    assert (
        body["digest"]
        == hashlib.sha256(orjson.dumps(before, option=orjson.OPT_SORT_KEYS)).hexdigest()
    )
    assert parse_payload(body, "east", "2026-10").hours is None


def test_a_payload_with_hours_round_trips_and_its_digest_covers_them() -> None:
    """Hours parse back to the same content and digest; an hour changed after the digest was
    taken is refused."""
    body = orjson.loads(orjson.dumps(_hourly_payload()))
    assert body["digest"] != _payload()["digest"]
    assert parse_payload(body, "east", "2026-10").to_json() == body
    changed = body["hours"]["usage"][0] | {"requests": 3}
    tampered = body | {"hours": body["hours"] | {"usage": [changed]}}
    with pytest.raises(FederationError, match="does not match its digest"):
        parse_payload(tampered, "east", "2026-10")


def _hours_changed(kind: str, **change: Any) -> dict[str, Any]:
    body = _hourly_payload()
    row = body["hours"][kind][0] | change
    return body | {"hours": body["hours"] | {kind: [row]}}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (_hours_changed("cost", month="2026-11"), "a cost hour of another month"),
        (_hours_changed("usage", hour=month_hours("2026-11")[0]), "a usage hour of another month"),
        (
            _hourly_payload(cost_cents=81),
            "its hours add up to 81 cents, its own lines to 82",
        ),
        (_hours_changed("reconciliation", engine_tokens="many"), "its reconciliation hours"),
        (_hours_changed("usage", team=None), "a usage hour with a missing value"),
        (_hours_changed("usage", prompt_tokens=-5), "a usage hour with a negative"),
        (_hours_changed("cost", gpu_hours=-0.5), "a cost hour with a negative"),
        (_hours_changed("lifetimes", instances=1, instance_hours=1.5), "more instance-hours"),
        (_payload() | {"hours": {"cost": []}}, "its hours are not"),
        (
            _payload()
            | {"hours": {"cost": {}, "usage": [], "reconciliation": [], "lifetimes": []}},
            "not a list",
        ),
    ],
)
def test_hours_that_are_not_the_months_are_refused(body: dict[str, Any], why: str) -> None:
    """An hour of another month, a cost that does not add up to the month's own lines, a row
    out of its schema, a quantity no cluster can have measured or a kind missing is never
    stored."""
    with pytest.raises(FederationError, match=why):
        parse_payload(body, "east", "2026-10")


def test_more_hours_than_the_cap_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A payload with more rows of a kind than ``MAX_HOUR_ROWS`` is refused before it is read."""
    monkeypatch.setattr("billing.federation.MAX_HOUR_ROWS", 0)
    with pytest.raises(FederationError, match="more than 0"):
        parse_payload(_hourly_payload(), "east", "2026-10")


def test_the_central_keeps_hours_with_their_month_and_a_cluster_without_them(
    tmp_path: Path,
) -> None:
    """A month pulled with hours replaces the old copy's hours whole (pulling it again adds
    nothing); a cluster of an earlier version is held without hours and still adds up."""
    ledger = Ledger.open(str(tmp_path / "central.duckdb"), ["search"], {})
    try:
        hourly = parse_payload(_hourly_payload(), "east", "2026-10")
        for _ in range(2):
            replace_month(ledger, hourly, time.time())
        old = parse_payload(_payload() | {"cluster": "west"}, "west", "2026-10")
        replace_month(ledger, old, time.time())
        held = federated_hours(ledger, "2026-10", ["east", "west"])
        assert {k: v.height for k, v in held.items()} == {
            "cost": 1,
            "usage": 1,
            "reconciliation": 1,
            "lifetimes": 1,
        }
        lines, states = federated_month(ledger, "2026-10", ["east", "west"], 0.0)
        body = central_hours("2026-10", held, lines, states)
        by = {c["cluster"]: c for c in body["clusters"]}
        assert by["east"]["hourly"]
        assert by["east"]["hourly_cents"] == 82
        assert by["east"]["instance_hours"] == 1.25
        assert not by["west"]["hourly"]
        assert body["adds_up"]
        assert body["reconciliation"]["difference_tokens"] == 10
        assert body["reconciliation"]["difference_share"] == pytest.approx(10 / 310)
    finally:
        ledger.close()


def test_a_month_with_more_hours_than_a_central_takes_is_served_without_them(
    ledger: Ledger, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster serves a closed month's hours, but not past ``MAX_HOUR_ROWS`` of a kind: then
    the month goes without them (its lines still federate), with the digest it would have had
    before hours were kept."""
    ledger.ingest(batch("gpu_samples", gpu_samples(start=OCT + 3600, seconds=3600)), now=NOV)
    ledger.ingest(batch("usage", [usage("search", OCT + 3700, 300)]), now=NOV)
    Chargeback(ledger, config).close("2026-10", now=NOV + 86400)
    served = payload_of(ledger, "east", "2026-10")
    assert served.hours is not None
    assert served.hours["cost"]
    monkeypatch.setattr("billing.federation.MAX_HOUR_ROWS", 0)
    bare = payload_of(ledger, "east", "2026-10")
    assert bare.hours is None
    assert bare.lines == served.lines
    assert bare.digest == digest("2026-10", bare.basis, bare.pools, bare.lines)


def test_a_closed_month_is_hashed_once_while_it_stays_closed(
    ledger: Ledger, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing the closed months again reads no month's content: its digest is kept while the
    month keeps its close time; a month closed at another time is not the one kept."""
    ledger.ingest(batch("gpu_samples", gpu_samples(start=OCT + 3600, seconds=3600)), now=NOV)
    ledger.ingest(batch("usage", [usage("search", OCT + 3700, 300)]), now=NOV)
    Chargeback(ledger, config).close("2026-10", now=NOV + 86400)
    digests = MonthDigests()
    first = closed_months(ledger, "east", digests)
    assert [m["digest"] for m in first] == [payload_of(ledger, "east", "2026-10").digest]

    def read_again(*args: Any) -> None:
        raise AssertionError("a month's content read again")

    monkeypatch.setattr("billing.federation_store.payload_of", read_again)
    assert closed_months(ledger, "east", digests) == first
    with pytest.raises(AssertionError, match="read again"):
        closed_months(ledger, "east", MonthDigests())
    closed_at = float(first[0]["closed_at"])  # type: ignore[arg-type]
    assert digests.get("2026-10", closed_at + 1) is None


@pytest.mark.parametrize(
    ("billing", "why"),
    [
        ({"role": "central", "clusters": [_CLUSTER, _CLUSTER]}, "a name of its own"),
        ({"clusters": [_CLUSTER]}, "billing.role: central only"),
        ({"role": "central", "clusters": [_CLUSTER | {"name": "eu/west"}]}, "should match pattern"),
        ({"role": "central", "clusters": [_CLUSTER | {"token_env": "has space"}]}, "pattern"),
    ],
)
def test_a_federation_the_configuration_cannot_make_is_refused(
    billing: dict[str, Any], why: str
) -> None:
    """Two clusters of one name, clusters on a cluster's billing, a "/" in a cluster's name (it
    separates cluster and team in the FOCUS sub-account) or a token variable that is not a
    variable's name fail validation."""
    with pytest.raises(pydantic.ValidationError, match=why):
        BillingSettings.model_validate(billing)


class _FlakyCluster(http.server.BaseHTTPRequestHandler):
    """A cluster's billing that answers 503 to every other request, and a listing of no month
    (with the right token) to the rest."""

    calls: ClassVar[list[int]] = []

    def do_GET(self) -> None:
        self.calls.append(len(self.calls))
        if len(self.calls) % 2 == 1:
            status, body = 503, b'{"error": {"message": "busy"}}'
        elif self.headers.get("Authorization") != "Bearer flaky-token":
            status, body = 401, b'{"error": {"message": "who?"}}'
        else:
            status, body = 200, orjson.dumps({"cluster": "flaky", "months": []})
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


async def test_a_busy_cluster_is_asked_again_with_backoff(tmp_path: Path) -> None:
    """A 503 is tried again (after the backoff) within the round, and the cluster is pulled;
    with one attempt only, the same 503 leaves it stale."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyCluster)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    ledger = Ledger.open(str(tmp_path / "central.duckdb"), ["search"], {})
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for attempts, stale in ((2, False), (1, True)):
            settings = BillingSettings.model_validate(
                {
                    "role": "central",
                    "clusters": [{"name": "flaky", "url": url, "token_env": "FLAKY"}],
                    "federation": {"attempts": attempts, "backoff_seconds": 0.05},
                }
            )
            puller = Puller(ledger, settings, environ={"FLAKY": "flaky-token"})
            _FlakyCluster.calls.clear()
            [report] = await puller.pull()
            assert len(_FlakyCluster.calls) == attempts
            assert (report.error is not None) == stale
            _, [state] = federated_month(ledger, "2026-10", ["flaky"], puller.started_at)
            assert state.stale == stale
    finally:
        ledger.close()
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_the_timer_outlives_a_round_the_ledger_fails(tmp_path: Path) -> None:
    """Rounds over a ledger that cannot be read (closed) are logged, and the timer goes on."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyCluster)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    ledger = Ledger.open(str(tmp_path / "central.duckdb"), ["search"], {})
    ledger.close()
    try:
        settings = BillingSettings.model_validate(
            {
                "role": "central",
                "clusters": [
                    {
                        "name": "flaky",
                        "url": f"http://127.0.0.1:{server.server_address[1]}",
                        "token_env": "FLAKY",
                    }
                ],
                "federation": {"attempts": 2, "backoff_seconds": 0.01, "interval_seconds": 0.05},
            }
        )
        _FlakyCluster.calls.clear()
        task = asyncio.create_task(Puller(ledger, settings, {"FLAKY": "flaky-token"}).run())
        await asyncio.sleep(0.6)
        assert not task.done()
        assert len(_FlakyCluster.calls) >= 4  # the cluster was asked in several rounds
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
