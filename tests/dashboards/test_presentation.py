"""How the pages present figures: cell formats, headers, totals, charts and the summary tiles."""

from __future__ import annotations

import datetime as dt

import polars as pl
import pytest

from dashboards.components import csv_table, frame_table
from dashboards.figures import colours_for, complete_buckets, empty_figure, line_figure
from dashboards.formatting import MISSING, compact, format_cell, kind_of, label, parse_number, usd
from dashboards.pages.teams import budget_used_percent
from dashboards.summary import tiles

X_RANGE = (dt.datetime(2026, 12, 1, 10), dt.datetime(2026, 12, 1, 11))


@pytest.mark.parametrize(
    ("column", "value", "shown"),
    [
        ("total_usd", 1234.5, "$1,234.50"),
        ("total_usd", -0.05, "-$0.05"),
        ("requests", 94495, "94,495"),
        ("prompt_tokens", 6000, "6,000"),
        ("budget_used_pct", 0.0625, "0.06 %"),
        ("team_budget_used_percent", 12.5, "12.5 %"),
        ("utilization", 0.55, "55.0 %"),
        ("over_target", False, "No"),
        ("over_target", True, "Yes"),
        ("p95_seconds", 2.5051, "2.505 s"),
        ("gpu_hours", 0.1479, "0.148"),
        ("team", "search", "search"),
        ("budget_usd", None, MISSING),
    ],
)
def test_cells_are_formatted_by_their_column(column, value, shown):
    """Money, counts, percentages, shares, booleans and times each read one way everywhere."""
    assert format_cell(value, kind_of(column)) == shown


@pytest.mark.parametrize(
    ("column", "header"),
    [
        ("total_usd", "Total"),
        ("prompt_tokens", "Prompt tokens"),
        ("gpu_hours", "GPU-hours"),
        ("usd_per_million_tokens", "Cost per 1M tokens"),
        ("some_new_column", "Some new column"),
    ],
)
def test_headers_are_words(column, header):
    """Column names become headers in words, new columns included."""
    assert label(column) == header


def test_formatted_numbers_parse_back():
    """What a cell shows parses back to its number (the browser tests compare this way)."""
    for text, number in (
        ("$1,234.56", 1234.56),
        ("-$0.05", -0.05),
        ("12.5 %", 12.5),
        ("6,000", 6000),
    ):
        assert parse_number(text) == number
    assert usd(None) == MISSING == "\u2014"
    assert compact(84954) == "85 k"
    assert compact(950) == "950"


def test_frame_table_adds_a_total_row():
    """The named columns are summed in a footer labelled Total; other cells stay empty."""
    frame = pl.DataFrame({"team": ["a", "b"], "spent_usd": [1.5, 2.25], "requests": [1000, 2]})
    table = frame_table(frame, "t", total=("spent_usd", "requests")).children
    head, _, foot = table.children
    assert [th.children for th in head.children.children] == [
        "Team",
        "Spent (month to date)",
        "Requests",
    ]
    assert [td.children for td in foot.children.children] == ["Total", "$3.75", "1,002"]


def test_csv_table_shows_the_files_total_as_the_footer():
    """The CSV's total row becomes the footer, and its cells are formatted for reading."""
    text = "month,team,line_type,total_usd\n2026-12,a,usage,1.5\n2026-12,,total,1.5\n"
    table = csv_table(text, "t", hidden=("month",)).children
    head, body, foot = table.children
    assert [th.children for th in head.children.children] == ["Team", "Line", "Total"]
    assert [td.children for td in body.children[0].children] == ["a", "usage", "$1.50"]
    assert [td.children for td in foot.children.children] == ["Total", "", "$1.50"]


def test_the_bucket_still_filling_is_dropped():
    """A bucket that ends after the range's end is left out of the chart."""
    frame = pl.DataFrame({"t": [0.0, 60.0, 120.0], "v": [1.0, 1.0, 0.2]})
    assert complete_buckets(frame, 60, 170.0)["t"].to_list() == [0.0, 60.0]


def test_an_empty_chart_says_why():
    """A chart with no rows is its title and a sentence, with no axes drawn."""
    frame = pl.DataFrame(schema={"t": pl.Null, "model": pl.Null, "v": pl.Null})
    fig = line_figure(
        frame, "v", "model", "Requests per second", "requests/s", X_RANGE, empty="No requests."
    )
    assert fig.data == ()
    assert [a.text for a in fig.layout.annotations] == ["No requests."]
    assert fig.layout.xaxis.visible is False
    assert empty_figure("T", "why").layout.annotations[0].text == "why"


def test_one_point_is_drawn_with_a_marker_on_the_picked_range():
    """A single point shows as a marker, and the time axis spans the range picked."""
    frame = pl.DataFrame({"t": [X_RANGE[0]], "model": ["m"], "v": [3.0]})
    fig = line_figure(frame, "v", "model", "T", "y", X_RANGE)
    assert fig.data[0].mode == "lines+markers"
    assert list(fig.layout.xaxis.range) == list(X_RANGE)


def test_a_zero_series_gets_a_visible_axis():
    """All-zero values are drawn on a 0..1 axis rather than around zero."""
    frame = pl.DataFrame({"t": list(X_RANGE), "model": ["m", "m"], "v": [0.0, 0.0]})
    assert list(line_figure(frame, "v", "model", "T", "y", X_RANGE).layout.yaxis.range) == [0, 1]


def test_shares_are_drawn_in_percent():
    """Utilization-like shares use a 0-100 % axis."""
    frame = pl.DataFrame({"t": list(X_RANGE), "replica": ["r", "r"], "u": [0.5, 0.6]})
    fig = line_figure(frame, "u", "replica", "GPU utilization", "busy", X_RANGE, kind="share")
    assert fig.layout.yaxis.tickformat == ".0%"
    assert list(fig.layout.yaxis.range) == [0, 1.02]


def test_a_model_has_one_colour_everywhere():
    """Colours follow the configuration's model order, so a model is the same colour on every chart."""
    colours = colours_for(["chat-large", "chat-small"])
    frame = pl.DataFrame({"t": list(X_RANGE), "model": ["chat-small"] * 2, "v": [1.0, 2.0]})
    fig = line_figure(frame, "v", "model", "T", "y", X_RANGE, colours=colours)
    assert fig.data[0].line.color == colours["chat-small"] != colours["chat-large"]


def test_summary_tiles_add_up_what_billing_answered():
    """Spend, requests, tokens, SLA share, GPU use and idle share from billing's rows (the
    budget against what the teams that have one spent: b's dollar is in no budget)."""
    spend = [
        {"team": "a", "spent_usd": 2.0, "budget_usd": 10.0, "forecast_usd": 5.0},
        {"team": "b", "spent_usd": 1.0, "budget_usd": 0.0, "forecast_usd": 2.5},
    ]
    lines = pl.DataFrame({"total_cents": [200, 100], "idle_cents": [50, 25]})
    usage = pl.DataFrame(
        {"requests": [3, 4], "prompt_tokens": [100, 200], "completion_tokens": [10, 20]}
    )
    sla = pl.DataFrame({"ttft_requests": [4, 4], "within_sla": [4, 2]})
    gpus = pl.DataFrame({"utilization": [0.5, 1.0], "gpus": [3.0, 1.0]})
    found = {t.key: t for t in tiles(spend, lines, usage, sla, gpus, "the last hour")}
    assert (found["spend"].value, found["spend"].detail) == (
        "$3.00",
        "$2.00 of $10.00 budgeted; forecast $7.50 at month end",
    )
    assert found["requests"].raw == 7
    assert found["tokens"].raw == 330
    assert found["sla"].value == "75.0 %"
    assert found["gpu"].value == "62.5 %"
    assert found["idle"].value == "25.0 %"
    team = tiles(spend[:1], lines, usage, sla, None, "the last hour")
    assert "gpu" not in {t.key for t in team}


def test_an_empty_table_is_a_sentence():
    """A table without rows says why instead of showing headers alone, under the table's id."""
    frame = pl.DataFrame(schema={"model": pl.String, "cost_usd": pl.Float64})
    shown = frame_table(frame, "t", empty="No usage this month yet.")
    assert shown.id == "t"  # type: ignore[attr-defined]
    assert shown.children.children == "No usage this month yet."
    only_total = "month,team,line_type,total_usd\n2026-12,,total,0\n"
    assert csv_table(only_total, "c").children.children == "No charges for this month yet."


def test_the_teams_total_share_of_budget_is_the_budgeted_teams_over_their_budgets():
    """Team a spent $50 of $100, team b $50 without a budget, the platform $20: the total row
    says 50 %, as the chargeback CSV's total does, not 120 % (every dollar over a's budget)."""
    frame = pl.DataFrame(
        {
            "team": ["a", "b", "platform"],
            "spent_usd": [50.0, 50.0, 20.0],
            "budget_usd": [100.0, 0.0, None],
        }
    )
    assert budget_used_percent(frame) == 50.0
    assert budget_used_percent(frame.filter(pl.col("team") != "a")) is None
