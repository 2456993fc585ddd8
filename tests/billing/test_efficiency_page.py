"""The Efficiency page's plan, drawn from billing's answer on a simulated month."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from dashboards.pages.efficiency import plan_frame, plan_status, plan_table
from tests.billing.fleet_month import Group, Month, Stream, hourly, month_config, run
from tests.conftest import config_ledger


@pytest.fixture(scope="module")
def body() -> dict[str, Any]:
    """Billing's answer (as JSON) for two days of two L40S replicas whose load one holds."""
    config = month_config()
    ledger = config_ledger(config)
    month = Month(
        (Group("small-0"), Group("small-1")),
        (Stream("search", "chat-small", hourly(8, 8), 300, 150),),
        days=2,
    )
    report = run(config, month, ledger).report
    ledger.close()
    assert report is not None
    found: dict[str, Any] = orjson.loads(orjson.dumps(report.to_json()))
    return found


def _cells(component: Any) -> Iterator[tuple[str, str, Any]]:
    """(section, column, text) of every table cell under ``component``."""
    if type(component).__name__ in ("Tbody", "Tfoot"):
        for cell in _tds(component):
            yield type(component).__name__, getattr(cell, "data-column"), cell.children
        return
    children = getattr(component, "children", None)
    for child in children if isinstance(children, list) else [children]:
        if child is not None and not isinstance(child, str):
            yield from _cells(child)


def _tds(component: Any) -> Iterator[Any]:
    if type(component).__name__ == "Td":
        yield component
        return
    children = getattr(component, "children", None)
    for child in children if isinstance(children, list) else [children]:
        if child is not None and not isinstance(child, str):
            yield from _tds(child)


def test_the_plan_reads_as_a_table_with_its_replay(body):
    """Each change: its saving, its share of the cost it rests on in percent, the replay's
    GPU-hours and each team's p95s before and after against the target, the evidence labelled."""
    [row] = plan_frame(body["recommendations"]).iter_rows(named=True)
    assert row["saving_usd_per_month"] == pytest.approx(1.60 * 730)
    assert row["share_of_cost_pct"] == pytest.approx(50.0)
    assert row["replay"] == "chat-small: GPU-hours 96.0 -> 48.0"
    assert row["sla"].startswith("chat-small/search: TTFT ")
    assert "(target 500 ms), inter-token " in row["sla"]
    assert "engines ran by hour 2 every hour" in row["evidence"]
    assert "hours measured 48" in row["evidence"]


def test_the_plan_table_has_a_total_row_in_the_same_units(body):
    """With more than one change the last row is the plan: its saving, its share in percent."""
    two = {
        **body,
        "recommendations": body["recommendations"] * 2,
        "plan": {**body["plan"], "saving_usd": 2 * body["plan"]["saving_usd"]},
    }
    cells = list(_cells(plan_table(two)))
    totals = {column: text for section, column, text in cells if section == "Tfoot"}
    assert totals["saving_usd_per_month"] == "$2,336.00"
    assert totals["share_of_cost_pct"] == "100.0 %"
    rows = [(column, text) for section, column, text in cells if section == "Tbody"]
    assert [t for c, t in rows if c == "share_of_cost_pct"] == ["50.0 %", "50.0 %"]
    assert [t for c, t in rows if c == "saving_usd_per_month"] == ["$1,168.00", "$1,168.00"]


def test_the_plan_stands_beside_the_forecast_on_its_basis(body):
    """The status gives the plan a month at the run rate measured, and this month on the spend
    forecast's basis, next to the forecast."""
    text = plan_status("2026-10", body, 500.0)
    assert text.startswith(
        "2026-10: one plan of 1 change, $1,168.00 a month at the run rate of the 48 hours"
    )
    assert "on the spend forecast's basis $76.80, of a forecast spend of $500.00" in text


def test_a_month_without_a_plan_says_so(body):
    """No change to offer: the status says so, with the hours it looked at."""
    empty = {**body, "recommendations": []}
    assert (
        plan_status("2026-10", empty, 500.0)
        == "2026-10: no change to offer from the 48 hours measured"
    )
