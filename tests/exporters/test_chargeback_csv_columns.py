"""The chargeback CSV's columns for the basis, the node pool and the project, on the worked month."""

from __future__ import annotations

import csv
import io

from exporters.chargeback_csv import CSV_COLUMNS, chargeback_frame, write_csv
from tests.exporters import month


def test_the_chargeback_csv_adds_basis_category_pool_and_project_at_the_end() -> None:
    """The old columns stay first in their order; a team's two projects are two rows; no user."""
    frame = chargeback_frame(month.statement(), {"assistant": 1000.0})
    header = frame.columns
    assert header == list(CSV_COLUMNS)
    assert header[:16] == [
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
    ]
    assert header[16:] == ["basis", "pricing_category", "pool", "project"]
    assert "user" not in header
    rows = frame.to_dicts()
    assistant = [r for r in rows if r["team"] == "assistant"]
    assert [
        (r["project"], r["pool"], r["pricing_category"], r["total_usd"]) for r in assistant
    ] == [
        ("alpha", "reserved", "committed", 160.0),
        ("beta", "reserved", "committed", 80.0),
    ]
    # The budget once per team, its use over both rows: 240 / 1000 = 24 %.
    assert [r["team_budget_usd"] for r in assistant] == [1000.0, None]
    assert assistant[0]["team_budget_used_percent"] == 24.0
    research = [(r["pool"], r["pricing_category"]) for r in rows if r["team"] == "research"]
    assert sorted(research) == [("owned", "owned"), ("spot", "spot")]
    *_, total = rows
    assert (total["line_type"], total["basis"], total["pool"], total["project"]) == (
        "total",
        "list",
        None,
        None,
    )
    assert round(total["total_usd"] * 100) == month.TOTAL_CENTS
    assert {r["basis"] for r in rows} == {"list"}


def test_the_chargeback_csv_defuses_a_project_and_keeps_plain_lines_working() -> None:
    """A project named like a formula gets its apostrophe; lines without the splits leave them empty."""
    rows = [(*month.ROWS[1][:7], "=HYPERLINK(1)", *month.ROWS[1][8:])]
    text = write_csv(chargeback_frame(month.statement(lines=month.lines(rows)), {}))
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert parsed[0]["project"] == "'=HYPERLINK(1)"
    plain = month.lines([month.ROWS[0]]).drop(*month.SPLIT)
    parsed = list(
        csv.DictReader(io.StringIO(write_csv(chargeback_frame(month.statement(lines=plain), {}))))
    )
    assert [(r["pool"], r["pricing_category"], r["project"], r["basis"]) for r in parsed] == [
        ("", "", "", "list")
    ] * 2


def test_the_total_row_s_budget_share_is_the_budgeted_teams_over_their_budgets() -> None:
    """With budgets for assistant and search only, the total row's percentage is their cost over
    their budgets: research (no budget) and any platform line are in no budget."""
    budgets = {"assistant": 1000.0, "search": 4000.0}
    rows = chargeback_frame(month.statement(), budgets).to_dicts()
    *lines, total = rows
    budgeted = sum(round(r["total_usd"] * 100) for r in lines if r["team"] in budgets)
    unbudgeted = [r for r in lines if r["team"] not in budgets and r["total_usd"]]
    assert unbudgeted, "the worked month has cost outside any budget"
    assert total["team_budget_usd"] == 5000.0
    assert total["team_budget_used_percent"] == round(budgeted / 5000.0, 2)
