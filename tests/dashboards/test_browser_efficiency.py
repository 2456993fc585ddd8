"""The Efficiency page in real headless Chromium, against billing over the dashboards' ledger.

It shares ``test_browser``'s ``stack`` fixture (one billing service, dashboard and browser for
the module), imported here, and checks what the page shows against the advisor run on the ledger itself.
"""

from __future__ import annotations

import time

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from billing.efficiency.store import read_report
from infermeter.months import month_of
from tests.dashboards.records import ADMIN_KEY, REPLICAS, TEAM_KEYS
from tests.dashboards.test_browser import Stack, column, finish, sign_in, stack, wait  # noqa: F401


def _expected(st: Stack, team: str | None = None) -> tuple[str, list[str], float]:
    """The month shown, and the advisor's titles and total saving computed on the ledger."""
    month = month_of(st.fleet.start)
    with st.ledger.reader() as cursor:
        found = read_report(cursor, st.config, month, time.time(), team).to_json()
    titles = [r["title"] for r in found["recommendations"]]
    return month, titles, found["saving_usd_per_month"]


def test_efficiency_page_shows_the_advisors_recommendations(request):
    """The admin sees every recommendation with its saving and evidence, each replica group's month, and six charts."""
    st: Stack = request.getfixturevalue("stack")
    month, titles, total = _expected(st)
    assert titles, "the dashboards' ledger should have something to save"
    sign_in(st, ADMIN_KEY, f"/efficiency?month={month}")
    status = wait(st, "#efficiency-total", "recommendation")
    assert f"{month}: {len(titles)} recommendation" in status
    assert f"${total:,.2f}" in status
    assert column(st, "efficiency-advice-table", "title") == titles
    assert all(column(st, "efficiency-advice-table", "evidence"))
    assert column(st, "efficiency-summary-table", "replica") == sorted(REPLICAS)
    WebDriverWait(st.driver, 20, poll_frequency=0.1).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#content .js-plotly-plot")) >= 6
    )
    finish(st, "efficiency-admin")


def test_efficiency_page_shows_a_team_its_own_advice(request):
    """With the search key the page lists only search's recommendations and no replica groups."""
    st: Stack = request.getfixturevalue("stack")
    month, titles, _ = _expected(st, "search")
    assert titles, "search sends short requests to the large model"
    sign_in(st, TEAM_KEYS["search"], f"/efficiency?month={month}")
    wait(st, "#efficiency-total", "recommendation")
    assert column(st, "efficiency-advice-table", "team") == ["search"] * len(titles)
    assert column(st, "efficiency-advice-table", "title") == titles
    assert "admin credential" in wait(st, "#efficiency-summary", "admin")
    finish(st, "efficiency-search")
