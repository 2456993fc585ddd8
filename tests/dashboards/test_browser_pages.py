"""Every page in real Chromium at 1280 and 1920 px, as the admin and as a team, against billing's API.

One ledger with the fleet's whole life (``tests/dashboards/rich.py``: a spare GPU, unattributed
tokens, scaling decisions, last month closed), a real Prometheus whose rule fires, billing and
the dashboard on loopback. Each page is checked for what a new user met (the rough edges of the
first pass) and its figures compared with billing's API for the same window; a screenshot of
each is kept under ``$INFERMETER_TEST_ARTIFACTS/dashboards``.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from billing.chargeback import Chargeback
from dashboards.formatting import MISSING, parse_number
from infermeter.months import month_bounds, month_of
from tests.dashboards import rich
from tests.dashboards.records import ADMIN_KEY, TEAM_KEYS
from tests.dashboards.stack import (
    billing_thread,
    chromium,
    dashboard_config,
    dashboard_thread,
    metrics_thread,
)
from tests.dashboards.test_browser import DESIRED, VIEWER_TZ, Stack, column, sign_in, wait

PAGES = {
    "fleet": "/",
    "teams": "/teams",
    "allocation": "/allocation",
    "chargeback": "/chargeback",
    "sla": "/sla",
    "planner": "/planner",
    "efficiency": "/efficiency",
}
KEYS = {"admin": ADMIN_KEY, "search": TEAM_KEYS["search"]}
WIDTHS = (1280, 1920)
# Words a numeric cell may hold besides a number and the missing-value dash.
WORDS = {"admin only", "does not fit"}
# What the first pass showed for a missing value, in three notations.
OTHER_MISSING = {"-", "n/a", "N/A", "no price", "None", "nan", "NaN", ""}

# Where every graph's legend and time-axis labels are: unchanged between two reads once drawn.
_GEOMETRY_JS = """
return Array.from(document.querySelectorAll('#content .js-plotly-plot')).map(gd =>
  Array.from(gd.querySelectorAll('.legend, .xtick text')).map(e => {
    const r = e.getBoundingClientRect();
    return [Math.round(r.left), Math.round(r.top), Math.round(r.width), Math.round(r.height)];
  }));
"""

_LAYOUT_JS = """
const overlaps = (a, b) => a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
const header = document.querySelector('header');
const cells = [];
for (const cell of document.querySelectorAll('#content .frame-table th, #content .frame-table td, #summary .tile-value')) {
  const table = cell.closest('table');
  cells.push({table: table ? table.id : 'summary', column: cell.getAttribute('data-column') || '',
              tag: cell.tagName, text: cell.textContent.trim(), body: !!cell.closest('tbody'),
              num: cell.classList.contains('num'), align: getComputedStyle(cell).textAlign});
}
const plots = [];
for (const gd of document.querySelectorAll('#content .js-plotly-plot')) {
  const legend = gd.querySelector('.legend');
  const box = legend ? legend.getBoundingClientRect() : null;
  const ticks = Array.from(gd.querySelectorAll('.xtick text')).map(t => t.getBoundingClientRect());
  plots.push({id: gd.parentElement ? gd.parentElement.id : '', names: (gd.data || []).map(t => t.name || ''),
              legendOverTicks: !!box && box.width > 0 && ticks.some(t => t.width > 0 && overlaps(box, t)),
              legendBox: box && [box.left, box.top, box.right, box.bottom],
              ticksUnder: ticks.filter(t => box && t.width > 0 && overlaps(box, t)).map(t => [t.left, t.top, t.right, t.bottom])});
}
return {
  scrollWidth: document.documentElement.scrollWidth,
  header: {scroll: header.scrollWidth, client: header.clientWidth,
           outside: Array.from(header.querySelectorAll('a, button, #who, label')).filter(e => {
             const r = e.getBoundingClientRect(); return r.width > 0 && r.right > window.innerWidth + 0.5;
           }).map(e => e.textContent)},
  scrolled: Array.from(document.querySelectorAll('#content .table-wrap')).filter(w => w.scrollWidth > w.clientWidth + 1)
    .map(w => w.querySelector('table') ? w.querySelector('table').id : '?'),
  clipped: Array.from(document.querySelectorAll('#content .frame-table th')).filter(th => th.scrollWidth > th.clientWidth + 1)
    .map(th => th.textContent),
  cells: cells, plots: plots,
};
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("pages-rich")
    artifacts = (
        Path(os.environ.get("INFERMETER_TEST_ARTIFACTS") or tmp / "artifacts") / "dashboards"
    )
    artifacts.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        prometheus = stack.enter_context(rich.alerting_prometheus(tmp))
        metrics = stack.enter_context(metrics_thread(DESIRED))
        config = dashboard_config(metrics_urls=[metrics], prometheus_url=prometheus)
        ledger, fleet = rich.open_ledger(config, tmp / "ledger.duckdb")
        stack.callback(ledger.close)
        billing = stack.enter_context(billing_thread(config, ledger))
        url = stack.enter_context(dashboard_thread(config, billing))
        driver = stack.enter_context(chromium(tmp / "downloads", VIEWER_TZ))
        _wait_for_the_alert(prometheus)
        site = Stack(config, ledger, fleet, url, driver, artifacts, tmp / "downloads")
        site.billing = billing  # type: ignore[attr-defined]
        yield site


def _wait_for_the_alert(prometheus: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alerts = httpx.get(f"{prometheus}/api/v1/alerts").json()["data"]["alerts"]
        if any(a["state"] == "firing" for a in alerts):
            time.sleep(2)  # a range query's first samples
            return
        time.sleep(0.5)
    pytest.fail("the test rule did not fire within 30 s")


def api(site: Stack, key: str, path: str, **params: Any) -> Any:
    """What billing answers ``key`` at ``path``."""
    response = httpx.get(
        f"{site.billing}{path}",  # type: ignore[attr-defined]
        params=params,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def settled(site: Stack) -> None:
    """Until no callback is running and every graph has been drawn by its callback."""

    def ready(driver: Any) -> bool:
        busy = driver.find_elements(By.CSS_SELECTOR, "[data-dash-is-loading='true']")
        loading = driver.execute_script(
            "return Array.from(document.querySelectorAll('#content .js-plotly-plot')).some("
            "gd => (gd.layout.annotations || []).some(a => a.text === 'Loading...'));"
        )
        return not busy and not loading

    WebDriverWait(site.driver, 60, poll_frequency=0.2).until(ready)
    # Plotly finishes drawing after its data is set, and lays a graph out again once it knows
    # its container's size: read the page once no legend or axis label has moved for 0.5 s.
    last: list[Any] = [None]

    def still(driver: Any) -> bool:
        now = driver.execute_script(_GEOMETRY_JS)
        moved, last[0] = now != last[0], now
        return not moved

    WebDriverWait(site.driver, 30, poll_frequency=0.5).until(still)


def check_layout(site: Stack, page: str, width: int) -> dict[str, Any]:
    """The rough edges of the first pass, none of which may be back; returns what was read."""
    found: dict[str, Any] = site.driver.execute_script(_LAYOUT_JS)
    assert found["scrollWidth"] <= width, f"{page} scrolls sideways: {found['scrollWidth']} px"
    assert found["header"]["scroll"] <= found["header"]["client"], found["header"]
    assert found["header"]["outside"] == [], (
        f"header cut at {width} px: {found['header']['outside']}"
    )
    assert found["scrolled"] == [], f"tables behind a sideways scroll: {found['scrolled']}"
    assert found["clipped"] == [], f"headers cut: {found['clipped']}"
    for cell in found["cells"]:
        text = cell["text"]
        where = f"{page} {cell['table']}.{cell['column']} {text!r}"
        if cell["body"] or cell["table"] == "summary":
            assert text not in OTHER_MISSING or (text == "" and not cell["num"]), (
                f"missing as {where}"
            )
        if parse_number(text) is not None and cell["table"] != "summary":  # tiles are cards
            assert cell["align"] in ("right", "end"), f"a number left-aligned: {where}"
        if cell["num"] and cell["body"]:
            assert parse_number(text) is not None or text in (MISSING, *WORDS), (
                f"not a number: {where}"
            )
    for plot in found["plots"]:
        assert not plot["legendOverTicks"], (
            f"{page}: the legend covers the time axis of {plot['id']}: legend "
            f"{plot['legendBox']}, labels under it {plot['ticksUnder']} (left, top, right, bottom)"
        )
        assert not any("(no replica)" in n for n in plot["names"]), plot
    logs = site.driver.get_log("browser")  # type: ignore[no-untyped-call]
    assert [e for e in logs if e["level"] == "SEVERE"] == []
    return found


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("who", list(KEYS))
@pytest.mark.parametrize("page", list(PAGES))
def test_page_fits_reads_one_way_and_shows_billings_figures(site, page, who, width):
    """No sideways scroll or cut header, one missing-value dash, numbers right, the API's figures."""
    site.driver.set_window_size(width, 1800)
    sign_in(site, KEYS[who], PAGES[page])
    if page != "planner":
        wait(site, "#summary-spend-value", "$")
    COMPARE[page](site, who)
    settled(site)
    found = check_layout(site, page, width)
    site.driver.save_screenshot(str(site.artifacts / f"rich-{page}-{who}-{width}.png"))
    if page == "fleet" and who == "admin":
        names = next(p["names"] for p in found["plots"] if p["id"] == "fleet-gpu-util")
        assert names.count("unassigned") == 1, names


# -- each page's figures against billing's API, for the window the page shows ---------------


def _week(site: Stack) -> dict[str, float]:
    """A window holding every record of this month's hour (the data is an hour or two old)."""
    now = time.time()
    return {"from": now - 7 * 86400, "to": now}


def _fleet(site: Stack, who: str) -> None:
    usage = api(site, KEYS[who], "/v1/query/team_usage", **_week(site))
    requests = sum(row[usage["columns"].index("requests")] for row in usage["rows"])
    wait(site, "#fleet-requests-total", f"{requests:,} requests in range")
    requests_chart = _traces(site, "fleet-requests")
    kinds = {n for n in requests_chart if n in ("scale events", "alerts fired", "month closes")}
    if who == "admin":
        assert kinds == {"scale events", "alerts fired", "month closes"}
    else:  # scaling and alerts span every team
        assert kinds == {"month closes"}
    # The range fits the data: the time axis starts at the caller's first minute (the admin's
    # data includes last month's, so a week back), not an hour ago.
    first = max(api(site, KEYS[who], "/v1/query/span")["rows"][0][0], time.time() - 7 * 86400)
    start = _axis_start(site, "fleet-requests")
    local_first = dt.datetime.fromtimestamp(first, ZoneInfo(VIEWER_TZ)).replace(tzinfo=None)
    assert abs((start - local_first).total_seconds()) <= 90, (start, local_first)


def _traces(site: Stack, graph: str) -> list[str]:
    def drawn(driver: Any) -> Any:
        return driver.execute_script(
            f"const gd = document.querySelector('#{graph} .js-plotly-plot');"
            "return gd && gd.data && gd.data.length ? gd.data.map(t => t.name || '') : null;"
        )

    names: list[str] = WebDriverWait(site.driver, 30, poll_frequency=0.2).until(drawn)
    return names


def _axis_start(site: Stack, graph: str) -> dt.datetime:
    text = site.driver.execute_script(
        f"return document.querySelector('#{graph} .js-plotly-plot').layout.xaxis.range[0];"
    )
    return dt.datetime.fromisoformat(str(text).replace(" ", "T"))


def _teams(site: Stack, who: str) -> None:
    spend = {r["team"]: r["spent_usd"] for r in api(site, KEYS[who], "/v1/query/spend")}
    wait(site, "#teams-table")
    shown = dict(
        zip(
            column(site, "teams-table", "team"),
            column(site, "teams-table", "spent_usd"),
            strict=True,
        )
    )
    platform = site.config.billing.platform_account
    expected = {
        (f"{t} (idle capacity, unattributed tokens)" if t == platform else t): v
        for t, v in spend.items()
    }
    assert {t: parse_number(v) for t, v in shown.items()} == pytest.approx(expected)
    if who == "admin":  # the platform's tokens are its unattributed ones, not requests of its own
        row = {
            c: column(site, "teams-table", c)[-1]
            for c in ("team", "requests", "unattributed_tokens")
        }
        assert row == {
            "team": "platform (idle capacity, unattributed tokens)",
            "requests": MISSING,
            "unattributed_tokens": str(rich.UNATTRIBUTED_TOKENS),
        }
    _bars_are_seen_with_their_labels(site)


def _bars_are_seen_with_their_labels(site: Stack) -> None:
    """Every bar of a team that spent is wider than 2 px, its label just past its end."""
    boxes = site.driver.execute_script(
        "return Array.from(document.querySelectorAll('#teams-spend-figure .bars .point')).map(p => {"
        "const bar = p.querySelector('path').getBoundingClientRect(); const t = p.querySelector('text');"
        "const label = t ? t.getBoundingClientRect() : null;"
        "return {width: bar.width, right: bar.right, top: bar.top, bottom: bar.bottom, text: t ? t.textContent : '',"
        " left: label ? label.left : null, middle: label ? (label.top + label.bottom) / 2 : null};});"
    )
    spent = [b for b in boxes if not b["text"].startswith("0 %")]
    assert spent, boxes
    for bar in spent:
        assert bar["width"] >= 2, bar
        assert 0 <= bar["left"] - bar["right"] <= 10, bar
        assert bar["top"] - 2 <= bar["middle"] <= bar["bottom"] + 2, bar


def _allocation(site: Stack, who: str) -> None:
    now = time.time()
    start = month_bounds(month_of(now))[0]
    answer = api(site, KEYS[who], "/v1/allocation", **{"from": start, "to": now, "by": "team"})
    wait(site, "#alloc-rows")
    teams = [r[0] for r in answer["rows"]]
    assert column(site, "alloc-rows", "team") == teams
    shown = [parse_number(v) for v in column(site, "alloc-rows", "total_usd")]
    assert shown == [r[answer["columns"].index("total_usd")] for r in answer["rows"]]
    statement = Chargeback(site.ledger, site.config).statement(month_of(now))
    lines = (
        statement.lines
        if who == "admin"
        else statement.lines.filter(statement.lines["team"] == who)
    )
    total = (
        parse_number(
            site.driver.find_element(
                By.CSS_SELECTOR, "#alloc-rows tfoot td[data-column='total_usd']"
            ).text
        )
        if len(teams) > 1
        else shown[0]
    )
    assert round((total or 0) * 100) == int(lines["total_cents"].sum())


def _chargeback(site: Stack, who: str) -> None:
    month = month_of(time.time())
    body = api(site, KEYS[who], f"/v1/query/statement/{month}")
    wait(site, "#chargeback-lines")
    cents = sum(int(line["total_cents"]) for line in body["lines"])
    shown = sum(parse_number(v) or 0 for v in column(site, "chargeback-lines", "total_usd"))
    assert round(shown * 100) == cents
    if who != "admin":
        assert set(column(site, "chargeback-lines", "team")) == {who}


def _sla(site: Stack, who: str) -> None:
    rows = api(site, KEYS[who], "/v1/query/sla", **_week(site))
    wait(site, "#sla-models-table")
    by_model: dict[str, list[int]] = {}
    cols = rows["columns"]
    for row in rows["rows"]:
        part = by_model.setdefault(row[cols.index("model")], [0, 0])
        part[0] += row[cols.index("within_sla")]
        part[1] += row[cols.index("ttft_requests")]
    shown = dict(
        zip(
            column(site, "sla-models-table", "model"),
            column(site, "sla-models-table", "compliance_pct"),
            strict=True,
        )
    )
    for model, (within, asked) in by_model.items():
        assert parse_number(shown[model]) == pytest.approx(
            round(100 * within / asked, 2), abs=0.051
        )


def _planner(site: Stack, who: str) -> None:
    wait(site, "#plan-total", "124.2 GB")
    prices = dict(
        zip(
            column(site, "plan-gpus", "gpu"), column(site, "plan-gpus", "usd_per_hour"), strict=True
        )
    )
    assert prices["H100"] == f"${2 * site.config.prices.usd_per_gpu_hour['H100']:,.2f}"
    assert prices["H200"] == MISSING
    assert "no price in prices.usd_per_gpu_hour for H200" in wait(site, "#plan-missing")


def _efficiency(site: Stack, who: str) -> None:
    wait(site, "#efficiency-total")


COMPARE = {
    "fleet": _fleet,
    "teams": _teams,
    "allocation": _allocation,
    "chargeback": _chargeback,
    "sla": _sla,
    "planner": _planner,
    "efficiency": _efficiency,
}


def test_allocation_drills_into_a_clicked_row_and_downloads_what_it_shows(site):
    """A click on search's row filters on search and groups by model; the CSV is that table."""
    site.driver.set_window_size(1280, 1800)
    sign_in(site, ADMIN_KEY, "/allocation")
    wait(site, "#alloc-rows")
    row = site.driver.find_element(
        By.XPATH, "//table[@id='alloc-rows']//tbody//tr[td[1][text()='search']]"
    )
    row.click()
    wait(site, "#alloc-filter", "Team: search")
    WebDriverWait(site.driver, 30, poll_frequency=0.2).until(
        lambda d: column(site, "alloc-rows", "model") != []
    )
    models = column(site, "alloc-rows", "model")
    statement = Chargeback(site.ledger, site.config).statement(month_of(time.time()))
    own = statement.lines.filter(statement.lines["team"] == "search")
    assert sorted(models) == sorted(own["model"].to_list())
    shown = {
        m: parse_number(v)
        for m, v in zip(models, column(site, "alloc-rows", "total_usd"), strict=True)
    }
    assert shown == {m: c / 100 for m, c in own.select("model", "total_cents").iter_rows()}
    site.driver.find_element(By.ID, "alloc-csv-button").click()
    WebDriverWait(site.driver, 20).until(
        lambda _: any(site.downloads.glob("allocation-model-*.csv"))
    )
    text = next(site.downloads.glob("allocation-model-*.csv")).read_text()
    records = list(csv.DictReader(io.StringIO(text)))
    assert list(records[0])[2:] == [
        "model",
        "requests",
        "tokens",
        "gpu_hours",
        "compute_usd",
        "energy_usd",
        "idle_usd",
        "total_usd",
        "efficiency_pct",
        "usd_per_million_tokens",
    ]
    assert {r["model"]: float(r["total_usd"]) for r in records[:-1]} == shown
    assert records[-1]["model"] == "total"
    site.driver.save_screenshot(str(site.artifacts / "rich-allocation-drilled.png"))


def test_a_month_without_data_says_so(site):
    """Picking a month the ledger holds nothing for shows a note, not a table of zeros alone."""
    site.driver.set_window_size(1280, 1800)
    empty = month_of(month_bounds(month_of(time.time()))[0] - 100 * 86400)
    sign_in(site, ADMIN_KEY, f"/chargeback?month={empty}")
    note = wait(site, "#chargeback-empty", f"No data for {empty}")
    assert "Months with data:" in note
    site.driver.save_screenshot(str(site.artifacts / "rich-chargeback-empty-month.png"))
