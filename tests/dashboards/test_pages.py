"""Every page, as the admin and as a team, on a fresh ledger and on a populated one, in Chromium.

Each page is screenshotted (kept under ``$INFERMETER_TEST_ARTIFACTS/dashboards``) and must have
no empty figure (every chart draws data or says why it has none), no horizontal scrolling at
1280 px, and a summary row whose figures are the ledger's.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from billing.chargeback import Chargeback
from dashboards.formatting import MISSING, parse_number, usd
from launcher.cli import main
from tests.dashboards import records
from tests.dashboards.records import ADMIN_KEY, TEAM_KEYS
from tests.dashboards.stack import (
    billing_thread,
    chromium,
    dashboard_config,
    dashboard_thread,
    metrics_thread,
)
from tests.dashboards.test_browser import DESIRED, VIEWER_TZ, Stack, sign_in, wait

PAGES = {
    "/?range=24h": "fleet",
    "/teams": "teams",
    "/allocation": "allocation",
    "/chargeback": "chargeback",
    "/sla?range=24h": "sla",
    "/planner": "planner",
}
KEYS = {"admin": ADMIN_KEY, "search": TEAM_KEYS["search"]}
WIDTH = 1280

# Every plot the page shows: drawn, and either holding data or a sentence in place of it.
_FIGURES_JS = """
return Array.from(document.querySelectorAll('.js-plotly-plot')).filter(function (gd) {
  return gd.offsetParent !== null;
}).map(function (gd) {
  var traces = (gd.data || []).filter(function (t) {
    return (t.x && t.x.length) || (t.y && t.y.length);
  }).length;
  var notes = ((gd.layout || {}).annotations || []).filter(function (a) {
    return a.text && a.xref === 'paper';
  }).length;
  return {id: gd.id, traces: traces, notes: notes,
          title: ((gd.layout || {}).title || {}).text || ''};
});
"""


@pytest.fixture(scope="module", params=["fresh", "populated"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp(f"pages-{request.param}")
    artifacts = (
        Path(os.environ.get("INFERMETER_TEST_ARTIFACTS") or tmp / "artifacts") / "dashboards"
    )
    artifacts.mkdir(parents=True, exist_ok=True)
    fleet = records.build(records.recent_start())
    if request.param == "fresh":
        fleet = records.Fleet(fleet.start, [], [], [])
    with contextlib.ExitStack() as stack:
        metrics = stack.enter_context(metrics_thread(DESIRED))
        config = dashboard_config(metrics_urls=[metrics])
        ledger = records.open_ledger(config, tmp / "ledger.duckdb", fleet)
        stack.callback(ledger.close)
        billing = stack.enter_context(billing_thread(config, ledger))
        url = stack.enter_context(dashboard_thread(config, billing))
        driver = stack.enter_context(chromium(tmp / "downloads", VIEWER_TZ))
        driver.set_window_size(WIDTH, 1600)
        result = Stack(config, ledger, fleet, url, driver, artifacts, tmp / "downloads")
        result.billing = billing  # type: ignore[attr-defined]
        result.kind = request.param  # type: ignore[attr-defined]
        yield result


def figures_settled(stack: Stack, expected: int) -> list[dict[str, object]]:
    """The page's ``expected`` figures once every one has been drawn by its callback."""

    def ready(driver: object) -> tuple[list[dict[str, object]]] | bool:
        found = stack.driver.execute_script(_FIGURES_JS)
        if len(found) < expected:
            return False
        loading = any(f["traces"] == 0 and f["notes"] == 1 and f["title"] == "" for f in found)
        busy = stack.driver.find_elements(By.CSS_SELECTOR, "[data-dash-is-loading='true']")
        return False if loading or busy else (found,)  # a page may have no figure at all

    result = WebDriverWait(stack.driver, 30, poll_frequency=0.2).until(ready)
    assert isinstance(result, tuple)
    figures: list[dict[str, object]] = result[0]
    return figures


def summary_value(stack: Stack, key: str) -> str:
    """The value shown in the summary tile ``key``."""
    return wait(stack, f"#summary-{key}-value")


@pytest.mark.parametrize("who", list(KEYS))
@pytest.mark.parametrize("path", list(PAGES))
def test_page_draws_every_figure_and_fits(stack, who, path):
    """The page has no empty figure, no horizontal scroll at 1280 px, and a summary row."""
    sign_in(stack, KEYS[who], path)
    if path != "/planner":
        wait(stack, "#summary-spend-value", "$")
    # The fleet page's fleet-wide charts are a sentence for a team; the teams page has one chart.
    expected = {"fleet": 8 if who == "admin" else 4, "teams": 1, "allocation": 1}.get(
        PAGES[path], 0
    )
    figures = figures_settled(stack, expected)
    assert len(figures) == expected
    for figure in figures:
        assert figure["traces"] or figure["notes"], figure
    if PAGES[path] == "fleet" and who != "admin":
        wait(stack, "#fleet-admin-sentence", "admin only")
    time.sleep(0.3)  # Plotly finishes drawing after its data is set
    width = stack.driver.execute_script("return document.documentElement.scrollWidth")
    assert width <= WIDTH, f"{path} is {width} px wide"
    stack.driver.save_screenshot(
        str(stack.artifacts / f"page-{stack.kind}-{who}-{PAGES[path]}.png")
    )
    logs = stack.driver.get_log("browser")
    assert [e for e in logs if e["level"] == "SEVERE"] == []  # no callback failed


def test_summary_is_the_ledgers(stack):
    """The admin's summary tiles equal the ledger's spend, requests, SLA share and GPU use."""
    sign_in(stack, ADMIN_KEY, "/?range=24h")
    spend = Chargeback(stack.ledger, stack.config).spend()
    assert summary_value(stack, "spend") == usd(sum(s.spent_usd for s in spend))
    usage = stack.fleet.usage
    detail = wait(stack, "#summary-requests .tile-detail")
    assert parse_number(detail.split()[0]) == len(usage)
    if not usage:
        assert summary_value(stack, "sla") == MISSING
        assert summary_value(stack, "gpu") == MISSING
        return
    within = sum(
        r["first_token_at"] - r["received_at"]
        <= stack.config.model(r["model"]).sla.ttft_p95_seconds
        for r in usage
    )
    assert summary_value(stack, "sla") == f"{100 * within / len(usage):.1f} %"
    assert summary_value(stack, "gpu") == "55.0 %"  # boards at 50 % and 60 %, two of each
    statement = Chargeback(stack.ledger, stack.config).statement(spend[0].month)
    idle = int(statement.lines["idle_cents"].sum()) / statement.total_cents
    assert summary_value(stack, "idle") == f"{100 * idle:.1f} %"


def test_summary_agrees_with_the_api_and_the_command_line(stack, capsys, monkeypatch):
    """Spend on the dashboard, on /v1/spend and in the CLI's chargeback file is the same figure."""
    sign_in(stack, ADMIN_KEY, "/teams")
    shown = parse_number(summary_value(stack, "spend"))
    answer = httpx.get(
        f"{stack.billing}/v1/spend", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    ).json()
    api = round(sum(row["spent_usd"] for row in answer), 2)
    month = answer[0]["month"]
    monkeypatch.setenv("INFERMETER_ADMIN_TOKEN", ADMIN_KEY)
    assert main(["chargeback", "--month", month, "--billing-url", stack.billing]) == 0
    csv_text = capsys.readouterr().out
    total = list(csv.DictReader(io.StringIO(csv_text)))[-1]
    assert total["line_type"] == "total"
    assert shown == api == float(total["total_usd"])
    assert parse_number(wait(stack, "#teams-table tfoot td[data-column='spent_usd']")) == api


def test_signed_out_shows_only_the_sign_in_form(stack):
    """Signed out: the sign-in form, and no navigation, range picker, sign-out or figures."""
    stack.driver.get(stack.url + "/")
    stack.driver.execute_script("window.sessionStorage.clear();")
    stack.driver.get(stack.url + "/teams")
    wait(stack, "#login-key")
    for element in ("nav", "logout", "range", "summary-wrap"):
        assert not stack.driver.find_element(By.ID, element).is_displayed(), element
    assert stack.driver.find_elements(By.CSS_SELECTOR, ".js-plotly-plot") == []
    stack.driver.save_screenshot(str(stack.artifacts / f"signed-out-{stack.kind}.png"))


def test_sign_out_clears_the_key(stack):
    """Signing out empties the key box and the session, and hides every page again."""
    sign_in(stack, TEAM_KEYS["search"], "/teams")
    stack.driver.find_element(By.ID, "logout").click()
    wait(stack, "#login-key")
    WebDriverWait(stack.driver, 10).until(
        lambda d: (
            d.find_element(By.ID, "login").is_displayed()
            and not d.find_element(By.ID, "nav").is_displayed()
        )
    )
    assert stack.driver.find_element(By.ID, "login-key").get_attribute("value") == ""
    stored = stack.driver.execute_script("return JSON.stringify(window.sessionStorage);")
    assert "im-demo-search" not in stored
    assert stack.driver.find_elements(By.CSS_SELECTOR, "#content .page") == []
