"""The pages' data helpers: local times, the scaling signal, statements rebuilt from JSON."""

from __future__ import annotations

import datetime as dt

import polars as pl
import pytest

from dashboards.data import (
    desired_replicas,
    local_times,
    recent_months,
    statement_from_json,
    time_range,
    window,
)
from infermeter.statement import empty_lines
from tests.dashboards.stack import metrics_thread

JAN_15_NOON_UTC = 1768478400


@pytest.mark.parametrize(
    ("tz", "hour"),
    [("UTC", 12), ("Europe/Berlin", 13), ("America/New_York", 7), ("Not/AZone", 12), (None, 12)],
)
def test_times_are_shown_in_the_viewers_zone(tz, hour):
    """UTC seconds become the viewer's wall-clock time; an unknown zone falls back to UTC."""
    frame = local_times(pl.DataFrame({"t": [JAN_15_NOON_UTC]}), tz)
    assert frame["t"][0] == dt.datetime(2026, 1, 15, hour, 0)


def test_desired_replicas_from_prometheus_text():
    """The desired count per model is read from every reachable URL; others add nothing."""
    text = (
        "# HELP infermeter_desired_replicas Replicas wanted.\n# TYPE infermeter_desired_replicas gauge\n"
        'infermeter_desired_replicas{model="chat-large"} 4.0\ninfermeter_current_replicas{model="chat-large"} 2.0\n'
    )
    with metrics_thread(text) as url:
        assert desired_replicas([url, "http://127.0.0.1:9/metrics"]) == {"chat-large": 4.0}
    assert desired_replicas([]) == {}


def test_statement_from_json_keeps_lines_and_totals():
    """A statement rebuilt from billing's JSON has the same lines, fleet and adjustment cents."""
    line = dict.fromkeys(empty_lines().columns, 0) | {
        "month": "2026-01",
        "for_month": "2026-01",
        "team": "search",
        "model": "m",
        "total_cents": 250,
    }
    body = {
        "month": "2026-01",
        "closed": False,
        "lines": [line],
        "total_cents": 250,
        "fleet_cents": 250,
        "adjustment_cents": 0,
    }
    statement = statement_from_json(body)
    assert statement.total_cents == 250
    assert statement.reconciles
    assert statement.lines.schema == empty_lines().schema


def test_recent_months_lists_a_year_newest_first():
    """The month picker offers the last 12 months plus any older month with data."""
    months = recent_months(["2024-03"], now=JAN_15_NOON_UTC)
    assert months[0] == "2026-01"
    assert months[11] == "2025-02"
    assert months[-1] == "2024-03"


def test_time_range_of_a_preset_is_that_long():
    """A preset is the last hour, 6 hours, day or week; without data, fitting is the last hour."""
    assert time_range("7d", now=1e6) == (1e6 - 7 * 86400, 1e6)
    assert time_range("1h", now=1e6) == (1e6 - 3600, 1e6)
    assert time_range("fit", now=10_000.0) == (6_400.0, 10_000.0)


@pytest.mark.parametrize(
    ("age", "shown", "label"),
    [
        (20 * 60, 20 * 60, "the data so far (20 minutes)"),
        (60, 300, "the data so far (1 minute)"),  # at least 5 minutes drawn
        (105 * 60, 105 * 60, "the data so far (1 h 45 min)"),
        (3 * 86400, 3 * 86400, "the data so far (3 days)"),
        (90 * 86400, 7 * 86400, "the last 7 days"),
    ],
)
def test_fitting_shows_the_datas_span(age, shown, label):
    """A 20-minute-old ledger is drawn over its 20 minutes, one older than a week over the week."""
    now = 1e9
    found = window("fit", (now - age, now), now)
    assert (found.start, found.end, found.label) == (now - shown, now, label)
