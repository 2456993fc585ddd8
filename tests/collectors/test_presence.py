"""Which readings of GPUs a page left out are forgotten, and which are only missing."""

from __future__ import annotations

import pytest

from collectors.energy import Point
from collectors.presence import absences, listed_keys
from tests.collectors.fakes import reading

A, B = ("node-a", "GPU-0", ""), ("node-a", "GPU-0", "2")


@pytest.mark.parametrize(
    ("age", "listed", "missing", "expected"),
    [
        (5.0, {A}, set(), (set(), set())),
        (5.0, set(), set(), (set(), {A})),
        (15.0, set(), set(), (set(), {A})),
        (16.0, set(), set(), ({A}, set())),
        (16.0, {A}, {A}, ({A}, set())),
        (16.0, {A}, set(), (set(), set())),
        (10.0, {A}, {A}, (set(), set())),
    ],
    ids=[
        "listed",
        "left-out-within-limit",
        "left-out-at-limit",
        "left-out-past-limit",
        "back-after-an-absence-past-limit",
        "on-the-page-past-limit-not-left-out",
        "back-within-limit",
    ],
)
def test_a_reading_is_forgotten_only_past_the_gap_limit_and_only_when_left_out(
    age, listed, missing, expected
):
    """Forgotten: older than the gap limit and left out by a page read; missing: left out now."""
    held = {A: Point(100.0 - age, 300.0, 1.0)}
    assert absences(held, listed, missing, now=100.0, gap_seconds=15.0) == expected


def test_a_page_lists_its_readings_under_each_boards_home():
    """A board sampled under another node this round is listed under that node."""
    pages = [reading(node="node-b", uuid="GPU-0", mig_instance="2"), reading(uuid="")]
    assert listed_keys(pages, {"GPU-0": "node-a"}) == {B, ("node-a", "", "")}
