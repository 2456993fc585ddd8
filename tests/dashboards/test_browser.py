"""Every dashboard page in real headless Chromium, against billing over a ledger of known contents.

One billing service, one dashboard and one browser serve the whole module; each test signs in
with the key it needs and checks the numbers on the page against the ledger itself.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from billing import overrides
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from dashboards.formatting import MISSING, parse_number
from exporters.chargeback_csv import chargeback_frame, write_csv
from exporters.focus import focus_frame
from infermeter.config import Config
from infermeter.months import month_of
from infermeter.overrides import Override, override_record
from tests.dashboards import records
from tests.dashboards.records import ADMIN_KEY, REPLICAS, TEAM_KEYS
from tests.dashboards.stack import (
    billing_thread,
    chromium,
    dashboard_config,
    dashboard_thread,
    metrics_thread,
)

# Half-hour offset and no daylight saving: a time shown in UTC or off by whole hours is caught.
VIEWER_TZ = "Asia/Kolkata"
DESIRED = '# TYPE infermeter_desired_replicas gauge\ninfermeter_desired_replicas{model="chat-small"} 3.0\n'


@dataclass
class Stack:
    config: Config
    ledger: Ledger
    fleet: records.Fleet
    url: str
    driver: webdriver.Chrome
    artifacts: Path
    downloads: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("dashboards")
    artifacts = (
        Path(os.environ.get("INFERMETER_TEST_ARTIFACTS") or tmp / "artifacts") / "dashboards"
    )
    artifacts.mkdir(parents=True, exist_ok=True)
    fleet = records.build(records.recent_start())
    with contextlib.ExitStack() as stack:
        metrics = stack.enter_context(metrics_thread(DESIRED))
        config = dashboard_config(metrics_urls=[metrics])
        ledger = records.open_ledger(config, tmp / "ledger.duckdb", fleet)
        stack.callback(ledger.close)
        billing = stack.enter_context(billing_thread(config, ledger))
        url = stack.enter_context(dashboard_thread(config, billing))
        driver = stack.enter_context(chromium(tmp / "downloads", VIEWER_TZ))
        yield Stack(config, ledger, fleet, url, driver, artifacts, tmp / "downloads")


def wait(stack: Stack, css: str, text: str | None = None, timeout: float = 20) -> str:
    """The text of the first element matching ``css`` once it shows (containing ``text``)."""

    def ready(driver: webdriver.Chrome) -> str | bool:
        found = driver.find_elements(By.CSS_SELECTOR, css)
        if not found or (text is not None and text not in found[0].text):
            return False
        return found[0].text or True

    result = WebDriverWait(stack.driver, timeout, poll_frequency=0.1).until(ready)
    return result if isinstance(result, str) else ""


def sign_in(stack: Stack, key: str, path: str) -> None:
    """Open ``path`` signed in with ``key`` through the sign-in form."""
    driver = stack.driver
    driver.get(stack.url + "/")
    driver.execute_script("window.sessionStorage.clear();")
    driver.get(stack.url + path)
    wait(stack, "#login-key")
    box = driver.find_element(By.ID, "login-key")
    box.clear()
    box.send_keys(key)
    driver.find_element(By.ID, "login-button").click()
    wait(stack, "#who", "admin" if key == ADMIN_KEY else "team")


def column(stack: Stack, table: str, name: str) -> list[str]:
    """Every body cell of column ``name`` in table ``table`` (the total row left out)."""
    cells = stack.driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody td[data-column='{name}']")
    return [c.text for c in cells]


def total(stack: Stack, table: str, name: str) -> str:
    """The total row's cell of column ``name`` in table ``table``."""
    return stack.driver.find_element(
        By.CSS_SELECTOR, f"#{table} tfoot td[data-column='{name}']"
    ).text


def rows(stack: Stack, table: str) -> list[list[str]]:
    """The table's body as text, row by row."""
    body = stack.driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")
    return [[td.text for td in tr.find_elements(By.TAG_NAME, "td")] for tr in body]


def same_cells(shown: dict[str, str], file: dict[str, str]) -> bool:
    """True when every shown cell is the file's value, formatted (numbers compared as numbers)."""
    for name, text in shown.items():
        value = file[name]
        number = parse_number(text)
        if value == "" and text in ("", MISSING):  # an empty cell of the file is shown as missing
            continue
        if number is None or not value.lstrip("-").replace(".", "", 1).isdigit():
            if text != value:
                return False
        elif abs(number - float(value)) > 0.0015 * max(1.0, abs(float(value))):
            return False
    return True


def finish(stack: Stack, name: str) -> None:
    """Save a screenshot and fail on any severe browser console message."""
    stack.driver.save_screenshot(str(stack.artifacts / f"{name}.png"))
    logs = stack.driver.get_log("browser")  # type: ignore[no-untyped-call]
    severe = [e for e in logs if e["level"] == "SEVERE"]
    assert severe == [], severe


def test_unknown_key_is_refused(stack):
    """A key billing does not know leaves the user on the sign-in form with a reason."""
    stack.driver.get(stack.url + "/")
    stack.driver.execute_script("window.sessionStorage.clear();")
    stack.driver.get(stack.url + "/")
    wait(stack, "#login-key").strip()
    stack.driver.find_element(By.ID, "login-key").send_keys("im-not-a-key")
    stack.driver.find_element(By.ID, "login-button").click()
    assert "not known" in wait(stack, "#login-error", "not known")
    assert stack.driver.find_elements(By.CSS_SELECTOR, "#content .page") == []
    finish(stack, "login-refused")


def test_chargeback_table_is_the_export_and_reconciles(stack):
    """The admin's table is the CSV cell for cell, its total the statement's; downloads match."""
    month = month_of(stack.fleet.start)
    chargeback = Chargeback(stack.ledger, stack.config)
    statement = chargeback.statement(month)
    budgets = {t.name: t.budget_usd_per_month for t in stack.config.teams}
    csv_text = write_csv(chargeback_frame(statement, budgets))
    sign_in(stack, ADMIN_KEY, "/chargeback")
    wait(stack, "#chargeback-reconciles", "Reconciles to the cent")
    header, *body = [line.split(",") for line in csv_text.strip().splitlines()]
    *lines, last = body
    shown = rows(stack, "chargeback-lines")
    assert len(shown) == len(lines)
    # The month is the page's; a line's type and month for, all the month's usage, only repeat it.
    assert {line[header.index("for_month")] for line in lines} == {month}
    # The basis is said above the table, and a split no line has (no pools, no projects here)
    # is not a column of blanks.
    blank = {
        c
        for c in ("pricing_category", "pool", "project")
        if not any(line[header.index(c)] for line in lines)
    }
    hidden = {"month", "line_type", "for_month", "basis", *blank}
    visible = [c for c in header if c not in hidden]
    for cells, line in zip(shown, lines, strict=True):
        assert same_cells(
            dict(zip(visible, cells, strict=True)), dict(zip(header, line, strict=True))
        )
    assert last[header.index("line_type")] == "total"
    shown_total = sum(parse_number(x) or 0 for x in column(stack, "chargeback-lines", "total_usd"))
    assert round(shown_total * 100) == statement.total_cents == statement.fleet_cents
    assert (
        parse_number(total(stack, "chargeback-lines", "total_usd")) == statement.total_cents / 100
    )
    assert "$" in column(stack, "chargeback-lines", "total_usd")[0]
    assert f"${statement.total_cents / 100:,.2f}" in wait(stack, "#chargeback-total")
    # No invoice imported: the lines are on list prices, and each node pool shows its list cost.
    assert "List prices" in wait(stack, "#chargeback-basis")
    assert column(stack, "chargeback-pools", "pool") == statement.pools["pool"].to_list()
    shown_list = [parse_number(v) for v in column(stack, "chargeback-pools", "list_usd")]
    assert shown_list == [c / 100 for c in statement.pools["list_cents"].to_list()]
    stack.driver.find_element(By.ID, "chargeback-csv-button").click()
    target = stack.downloads / f"chargeback-{month}.csv"
    WebDriverWait(stack.driver, 10).until(lambda _: target.exists() and target.stat().st_size > 0)
    assert target.read_text() == csv_text
    stack.driver.find_element(By.ID, "chargeback-focus-button").click()
    focus = stack.downloads / f"focus-1.0-{month}.csv"
    WebDriverWait(stack.driver, 10).until(lambda _: focus.exists() and focus.stat().st_size > 0)
    # The FOCUS file has a row per line and instance.
    by_instance = chargeback.by_instance(statement)
    assert focus.read_text() == write_csv(focus_frame(by_instance, stack.config))
    finish(stack, "chargeback-admin")


def test_fleet_page_shows_the_ledgers_requests_and_desired_replicas(stack):
    """The fleet page counts every request of the range and shows the scaling signal."""
    sign_in(stack, ADMIN_KEY, "/?range=24h")
    wait(stack, "#fleet-requests-total", f"{len(stack.fleet.usage)} requests in range")
    desired = dict(
        zip(
            column(stack, "fleet-replicas-table", "model"),
            column(stack, "fleet-replicas-table", "desired"),
            strict=True,
        )
    )
    assert desired == {"chat-large": MISSING, "chat-small": "3"}
    wait(stack, "#fleet-reconciliation-table")
    assert column(stack, "fleet-reconciliation-table", "replica") == sorted(REPLICAS)
    # The totals can show before Plotly has drawn the graphs: it draws them asynchronously.
    WebDriverWait(stack.driver, 20, poll_frequency=0.1).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) >= 8
    )
    graphs = stack.driver.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")
    assert len(graphs) == 8
    finish(stack, "fleet-admin")


def test_team_key_sees_only_its_team(stack):
    """With the search key the teams, fleet and chargeback pages show only search's numbers."""
    spend = {s.team: s for s in Chargeback(stack.ledger, stack.config).spend()}
    sign_in(stack, TEAM_KEYS["search"], "/teams")
    wait(stack, "#teams-table")
    assert column(stack, "teams-table", "team") == ["search"]
    shown = parse_number(column(stack, "teams-table", "spent_usd")[0])
    assert shown == pytest.approx(spend["search"].spent_usd)
    finish(stack, "teams-search")

    stack.driver.get(stack.url + "/?range=24h")
    own = Counter(r["team"] for r in stack.fleet.usage)["search"]
    wait(stack, "#fleet-requests-total", f"{own} requests in range")
    wait(stack, "#fleet-admin-note", "admin only")
    wait(stack, "#fleet-reconciliation", "admin credential")
    assert not stack.driver.find_element(By.ID, "fleet-admin-figures").is_displayed()
    finish(stack, "fleet-search")

    stack.driver.get(stack.url + "/chargeback")
    wait(stack, "#chargeback-total", "Your team's lines")
    assert set(column(stack, "chargeback-lines", "team")) == {"search"}
    finish(stack, "chargeback-search")


def test_sla_compliance_equals_the_ledgers_share(stack):
    """Compliance per model is the ledger's share within target; hours are in the viewer's zone."""
    sign_in(stack, ADMIN_KEY, "/sla?range=24h")
    wait(stack, "#sla-models-table")
    shown = dict(
        zip(
            column(stack, "sla-models-table", "model"),
            column(stack, "sla-models-table", "compliance_pct"),
            strict=True,
        )
    )
    for model, pct in shown.items():
        target = stack.config.model(model).sla.ttft_p95_seconds
        reqs = [r for r in stack.fleet.usage if r["model"] == model]
        within = sum(r["first_token_at"] - r["received_at"] <= target for r in reqs)
        assert parse_number(pct) == pytest.approx(round(100 * within / len(reqs), 1), abs=0.051)
    assert len(column(stack, "sla-worst-table", "p95_seconds")) == 2
    local = dt.datetime.fromtimestamp(stack.fleet.start, ZoneInfo(VIEWER_TZ)).replace(tzinfo=None)
    assert set(column(stack, "sla-worst-table", "hour")) == {str(local)}
    finish(stack, "sla-admin")


def test_planner_sizes_70b_fp8(stack):
    """The planner's default (70B at fp8, 16 x 8k tokens) needs 124.2 GB and one H200."""
    sign_in(stack, ADMIN_KEY, "/planner")
    assert "= 124.2 GB" in wait(stack, "#plan-total", "GB")
    gpus = dict(
        zip(column(stack, "plan-gpus", "gpu"), column(stack, "plan-gpus", "gpus"), strict=True)
    )
    assert gpus["H200"] == "1"
    assert gpus["H100"] == "2"
    assert gpus["T4"] == "does not fit"
    prices = dict(
        zip(
            column(stack, "plan-gpus", "gpu"),
            column(stack, "plan-gpus", "usd_per_hour"),
            strict=True,
        )
    )
    assert prices["H100"] == "$7.80"
    assert prices["H200"] == MISSING  # and the note says why
    assert "no price in prices.usd_per_gpu_hour for H200" in wait(stack, "#plan-missing")
    finish(stack, "planner")


def test_tables_sort_by_a_clicked_header(stack):
    """A header click sorts the rows by that column as numbers, again reverses; the total stays last."""
    sign_in(stack, ADMIN_KEY, "/chargeback")
    wait(stack, "#chargeback-reconciles", "Reconciles")
    header = stack.driver.find_element(
        By.CSS_SELECTOR, "#chargeback-lines th[data-column='total_usd']"
    )
    before = total(stack, "chargeback-lines", "total_usd")
    header.click()
    shown = [parse_number(v) or 0.0 for v in column(stack, "chargeback-lines", "total_usd")]
    assert shown == sorted(shown)
    assert header.get_attribute("aria-sort") == "ascending"
    header.click()
    shown = [parse_number(v) or 0.0 for v in column(stack, "chargeback-lines", "total_usd")]
    assert shown == sorted(shown, reverse=True)
    assert total(stack, "chargeback-lines", "total_usd") == before
    finish(stack, "chargeback-sorted")


def test_the_teams_page_shows_an_override_in_force_and_no_revoked_one(stack):
    """Billing's admin let research past its budget for an hour and revoked analytics' override:
    the teams table shows research's override with its end in the viewer's zone, analytics'
    none (a revocation lets no one past), nor any other team's."""
    now = time.time()
    grants = [
        Override("research", now + 3600, "quarter-end batch", now - 5),
        Override("analytics", now + 3600, "granted by mistake", now - 60),
        Override("analytics", now - 30, "revoked", now - 30),
    ]
    with stack.ledger.writing() as cur:
        for grant in grants:
            overrides.keep(cur, override_record(grant, "billing:@admin"), now)
    sign_in(stack, ADMIN_KEY, "/teams")
    wait(stack, "#teams-table")
    WebDriverWait(stack.driver, 20, poll_frequency=0.1).until(
        lambda _: any(
            text.startswith("until") for text in column(stack, "teams-table", "budget_override")
        )
    )
    shown = dict(
        zip(
            column(stack, "teams-table", "team"),
            column(stack, "teams-table", "budget_override"),
            strict=True,
        )
    )
    end = dt.datetime.fromtimestamp(now + 3600, ZoneInfo(VIEWER_TZ)).strftime("%Y-%m-%d %H:%M")
    assert shown["research"] == f"until {end}"
    assert {team for team, text in shown.items() if text != MISSING} == {"research"}
    finish(stack, "teams-override")
