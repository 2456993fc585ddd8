"""The teams page's "Projects and users" table in real Chromium, as a team signed in sees it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from billing.ledger import Ledger
from dashboards.formatting import parse_number
from infermeter.months import month_bounds, month_of
from tests.billing.conftest import batch, gpu_samples, usage
from tests.dashboards.records import TEAM_KEYS
from tests.dashboards.stack import billing_thread, chromium, dashboard_config, dashboard_thread
from tests.dashboards.test_browser import VIEWER_TZ, Stack, column, sign_in, wait


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Billing and the dashboard over this month's use of search (two projects, two users) and
    assistant, and a headless Chromium."""
    tmp = tmp_path_factory.mktemp("tags")
    config = dashboard_config({"INFERMETER__TEAMS__SEARCH__PROJECTS": "[alpha, beta]"})
    now = time.time()
    start = max(now - 1800, month_bounds(month_of(now))[0])
    records = [
        usage("search", start + 10, 300, user="ana", project="alpha"),
        usage("search", start + 20, 100, user="ben", project="alpha"),
        usage("search", start + 30, 200, project="beta"),
        usage("assistant", start + 40, 100, user="zed"),
    ]
    samples = gpu_samples(start=start, seconds=max(60.0, now - start - 1))
    with contextlib.ExitStack() as stack:
        ledger = Ledger.open(tmp / "ledger.duckdb", [t.name for t in config.teams], {})
        stack.callback(ledger.close)
        for kind, rows in (("usage", records), ("gpu_samples", samples)):
            assert ledger.ingest(batch(kind, rows), now=now).accepted == len(rows)
        billing = stack.enter_context(billing_thread(config, ledger))
        url = stack.enter_context(dashboard_thread(config, billing))
        driver = stack.enter_context(chromium(tmp / "downloads", VIEWER_TZ))
        yield Stack(config, ledger, None, url, driver, tmp, tmp / "downloads")  # type: ignore[arg-type]


def test_a_team_sees_its_own_projects_and_users_and_no_other_teams(stack: Stack) -> None:
    """Signed in as search: its three (project, user) rows, largest first (ana's 300 s in
    flight), and nothing of assistant's."""
    sign_in(stack, TEAM_KEYS["search"], "/teams")
    wait(stack, "#teams-tags-table tbody td")
    teams = column(stack, "teams-tags-table", "team")
    pairs = list(
        zip(
            column(stack, "teams-tags-table", "project"),
            column(stack, "teams-tags-table", "user"),
            strict=True,
        )
    )
    shown = [parse_number(c) for c in column(stack, "teams-tags-table", "cost_usd")]
    costs = [c for c in shown if c is not None]
    assert len(costs) == len(shown) == 3
    assert set(teams) == {"search"}
    assert pairs == [("alpha", "ana"), ("beta", "(no user)"), ("alpha", "ben")]
    assert costs == sorted(costs, reverse=True)
