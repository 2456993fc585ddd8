"""The Efficiency page in real headless Chromium, against billing over the dashboards' ledger.

It shares ``test_browser``'s ``stack`` fixture (one billing service, dashboard and browser for
the module), imported here, and checks what the page shows against the advisor run on the
ledger itself. That ledger is built by rule, with TTFTs no engine profile gives: the advisor
cannot vouch for its groups, and the page says so instead of offering a plan.
"""

from __future__ import annotations

import time

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from billing.efficiency.store import read_report
from infermeter.months import month_of
from tests.dashboards.records import ADMIN_KEY, REPLICAS, TEAM_KEYS
from tests.dashboards.test_browser import Stack, column, finish, sign_in, stack, wait  # noqa: F401


def _expected(st: Stack, team: str | None = None) -> tuple[str, list[str], list[str]]:
    """The month shown, and the advisor's titles and notes computed on the ledger."""
    month = month_of(st.fleet.start)
    with st.ledger.reader() as cursor:
        found = read_report(cursor, st.config, month, time.time(), team).to_json()
    return (
        month,
        [r["title"] for r in found["recommendations"]],
        [n["text"] for n in found["notes"]],
    )


def test_efficiency_page_shows_the_plan_or_why_there_is_none(request):
    """The admin sees the plan (here none), each note on why, each replica group's month, and six charts."""
    st: Stack = request.getfixturevalue("stack")
    month, titles, notes = _expected(st)
    assert notes, "the dashboards' ledger is built by rule: its replay cannot match it"
    sign_in(st, ADMIN_KEY, f"/efficiency?month={month}")
    status = wait(st, "#efficiency-total", month)
    if titles:
        assert f"{month}: one plan of {len(titles)} change" in status
        assert "spend forecast's basis" in status
    else:
        assert f"{month}: no change to offer" in status
        wait(st, "#efficiency-advice", "Nothing to save")
    assert column(st, "efficiency-advice-table", "title") == titles
    shown = [li.text for li in st.driver.find_elements(By.CSS_SELECTOR, "#efficiency-notes li")]
    assert shown == notes
    assert column(st, "efficiency-summary-table", "replica") == sorted(REPLICAS)
    WebDriverWait(st.driver, 20, poll_frequency=0.1).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#content .js-plotly-plot")) >= 6
    )
    finish(st, "efficiency-admin")


def test_efficiency_page_shows_a_team_its_own_view(request):
    """With the search key the page lists only search's changes, no notes and no replica groups."""
    st: Stack = request.getfixturevalue("stack")
    month, titles, notes = _expected(st, "search")
    assert notes == []
    sign_in(st, TEAM_KEYS["search"], f"/efficiency?month={month}")
    wait(st, "#efficiency-total", month)
    assert column(st, "efficiency-advice-table", "title") == titles
    assert st.driver.find_elements(By.CSS_SELECTOR, "#efficiency-notes li") == []
    assert "admin credential" in wait(st, "#efficiency-summary", "admin")
    finish(st, "efficiency-search")
