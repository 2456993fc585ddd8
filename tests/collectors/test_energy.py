"""Energy between readings: counters, resets, power integration and gaps; and back-off."""

from __future__ import annotations

import pytest

from collectors.energy import Energy, Point, counter_increase, interval_energy, next_baseline
from collectors.loop import backoff_seconds

GAP = 30.0  # 3 intervals of 10 s


@pytest.mark.parametrize(
    ("previous", "current", "increase"),
    [(100.0, 250.0, 150.0), (100.0, 100.0, 0.0), (5_000.0, 40.0, 40.0), (0.0, 0.0, 0.0)],
    ids=["grows", "flat", "reset-counts-from-zero", "zero"],
)
def test_counter_increase(previous, current, increase):
    """A decrease means the counter was reset: the increase is the new value."""
    assert counter_increase(previous, current) == increase


@pytest.mark.parametrize(
    ("previous", "current", "expected"),
    [
        (None, Point(100, 300, 5e6), Energy(0.0, 0.0)),
        (Point(100, 300, 5e6), Point(110, 300, 8e6), Energy(3000.0, 10.0)),
        (Point(100, 300, 9e9), Point(110, 300, 2e6), Energy(2000.0, 10.0)),
        (Point(100, 200, None), Point(110, 400, None), Energy(3000.0, 10.0)),
        (Point(100, 200, 5e6), Point(110, 400, None), Energy(3000.0, 10.0)),
        (Point(100, 300, 5e6), Point(130, 300, 14e6), Energy(9000.0, 30.0)),
        (Point(100, 300, 5e6), Point(140, 300, 17e6), Energy(None, 40.0, gap=True)),
        (Point(100, 300, None), Point(200, 300, None), Energy(None, 100.0, gap=True)),
        (Point(100, 300, 5e6), Point(100, 300, 5e6), Energy(0.0, 0.0)),
    ],
    ids=[
        "first-reading",
        "counter",
        "counter-reset-after-reboot",
        "power-trapezoid",
        "counter-missing-on-one-side",
        "at-gap-limit",
        "gap",
        "gap-without-counter",
        "same-instant",
    ],
)
def test_interval_energy(previous, current, expected):
    """Counter difference, else power integrated; longer than the gap limit is a gap."""
    assert interval_energy(previous, current, GAP) == expected


@pytest.mark.parametrize(
    ("previous", "current", "kept"),
    [
        (None, Point(100, 300, 5e6), "current"),
        (Point(100, 300, 5e6), Point(110, 300, 8e6), "current"),
        (Point(100, 300, 5e6), Point(100, 300, 6e6), "previous"),
        (Point(100, 300, 5e6), Point(98, 300, 6e6), "previous"),
    ],
    ids=["first-reading", "later", "same-instant", "earlier"],
)
def test_the_baseline_moves_only_to_a_later_reading(previous, current, kept):
    """A reading at no later instant measured nothing, so the next interval starts before it."""
    assert next_baseline(previous, current) == {"previous": previous, "current": current}[kept]


@pytest.mark.parametrize(
    ("failures", "wait"),
    [(0, 0.0), (1, 10.0), (2, 20.0), (3, 40.0), (5, 160.0), (6, 300.0), (40, 300.0)],
)
def test_backoff_doubles_up_to_the_cap(failures, wait):
    """One interval after the first failure, doubling after each further one, capped."""
    assert backoff_seconds(failures, 10.0, 300.0) == wait


@pytest.mark.parametrize(
    ("previous", "current", "expected"),
    [
        # 875 W for 10 + 60 s is 61.25 kJ: a counter within it is the measure.
        (Point(100, 300, 5e9), Point(110, 300, 5e9 + 61_250_000), Energy(61_250.0, 10.0)),
        (Point(100, 300, 5e9), Point(110, 300, 5e9 + 1e12), Energy(3000.0, 10.0, False, True)),
        (Point(100, 300, 5e9), Point(110, 300, 4.9e9), Energy(3000.0, 10.0, False, True)),
        (Point(100, 300, 5e9), Point(110, 300, 2e6), Energy(2000.0, 10.0)),
    ],
    ids=["within", "jump", "back-not-to-zero", "reset"],
)
def test_a_counter_increase_no_board_can_draw_is_measured_from_power(previous, current, expected):
    """Over the board's most (W) for the interval and the refresh slack: power measures it."""
    assert interval_energy(previous, current, GAP, max_watts=875.0) == expected
