"""Schedule advice: engines by the hour of the day from each hour's measured busiest minute."""

from __future__ import annotations

import pytest

from billing.efficiency.advice import Policy
from billing.efficiency.schedule import segments
from billing.ledger import Ledger
from tests.billing.conftest import OCT, gpu_samples
from tests.billing.test_efficiency import engine, fill, kinds, report, requests


def _day(ledger: Ledger, night: float, day: float, waiting_at_night: float = 0.0) -> None:
    """small-0 and small-1 (one L40S each, $1.60/h) for a day: ``night`` running each 00-08, ``day`` after."""
    samples = []
    for hour in range(24):
        start = OCT + hour * 3600
        running = night if hour < 8 else day
        waiting = waiting_at_night if hour < 8 else 0.0
        for replica in ("small-0", "small-1"):
            samples += engine(replica, running, waiting, start=start)
    gpus = []
    for replica, gpu in (("small-0", "0"), ("small-1", "1")):
        gpus += gpu_samples(replica, start=OCT, seconds=86400, every=60, watts=0.0, gpu=gpu)
    fill(ledger, usage=requests(10) + requests(10, replica="small-1"), gpu_samples=gpus,
         engine_samples=samples)  # fmt: skip


def test_schedule_fires_when_the_night_needs_fewer_engines(ledger, config):
    """20 sequences at night need one engine of 128, 200 by day two: one L40S saved 8 h a day, less its start-up."""
    _day(ledger, night=10, day=100)
    found = report(ledger, config)
    [rec] = kinds(found, "schedule")
    assert rec.action["schedule"] == [
        {"from": "00:00", "to": "08:00", "engines": 1},
        {"from": "08:00", "to": "00:00", "engines": 2},
    ]
    # 8 engine-hours at $1.60, less 180 s of one engine starting at 08:00, over 24 hours measured.
    assert rec.saving_usd_per_month == pytest.approx((8 * 1.60 - 0.05 * 1.60) * 730 / 24)
    assert kinds(found, "right_size") == []  # the day needs both engines


def test_schedule_does_not_fire_when_every_hour_needs_the_same(ledger, config):
    """A fleet busy around the clock has no hours to scale down in."""
    _day(ledger, night=100, day=100)
    assert kinds(report(ledger, config), "schedule") == []


def test_hours_in_which_requests_queued_keep_their_engines(ledger, config):
    """Nights with a queue needed both engines, however few sequences ran."""
    _day(ledger, night=10, day=100, waiting_at_night=3)
    assert kinds(report(ledger, config), "schedule") == []


def test_schedule_counts_only_what_right_size_leaves(ledger, config):
    """With the day needing one engine and the night one, right-size saves it all and the schedule nothing."""
    _day(ledger, night=10, day=40)
    found = report(ledger, config)
    assert [r.kind for r in found.recommendations] == ["right_size"]


def test_an_unmeasured_hour_keeps_the_level_before_it():
    """Gaps take the previous hour's level, and midnight follows 23:00."""
    levels = [None, 1, 1, None, 3] + [None] * 19
    assert [(s.start, s.end, s.engines) for s in segments(levels)] == [
        (0, 1, 3),
        (1, 4, 1),
        (4, 24, 3),
    ]


def test_start_up_time_comes_from_the_scaling_section(config):
    """The report's policy starts engines as long before the hour as scaling.startup_seconds says."""
    from billing.efficiency.store import policy_of

    assert policy_of(config).startup_seconds == config.scaling.startup_seconds
    assert Policy().startup_seconds == 180.0
