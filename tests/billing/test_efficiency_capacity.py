"""Engines by the hour of the day: what ran, what is needed, and a fleet capped to it."""

from __future__ import annotations

import pytest

from billing.efficiency.capacity import (
    capped,
    cuts,
    engine_capacity,
    engines_by_hour,
    hour_segments,
    needed_by_hour,
)
from billing.efficiency.replay import Arrival, GroupSetup, ModelReplay, ModelSetup, Run
from infermeter.config import EngineProfile

H = 3600.0
PROFILE = EngineProfile(max_num_seqs=16, kv_cache_tokens=8000)


def _group(replica: str = "g", usd: float = 1.60, gpus: int = 2) -> GroupSetup:
    return GroupSetup(replica, "m", "L40S", gpus, usd, PROFILE, False, True)


def _day(counts: list[int], replica: str = "g") -> list[Run]:
    """Pods as an autoscaler ran them over one day: ``counts[h]`` live in hour ``h``."""
    runs = []
    for k in range(max(counts)):
        h = 0
        while h < 24:
            if counts[h] <= k:
                h += 1
                continue
            first = h
            while h < 24 and counts[h] > k:
                h += 1
            runs.append(Run(replica, f"{replica}-{k}-{first}", first * H, h * H, first * H))
    return runs


def _hours(setup: ModelSetup) -> float:
    return sum(r.end - r.start for r in setup.runs) / H


def test_what_ran_is_the_most_engines_live_in_each_hour():
    """Two pods all day and a third from 12:30 to 14:00: 3 in hours 12 and 13."""
    runs = [
        Run("g", "a", 0, 24 * H, 0),
        Run("g", "b", 0, 24 * H, 0),
        Run("g", "c", 12.5 * H, 14 * H, 12.5 * H),
    ]
    assert engines_by_hour(runs) == [2] * 12 + [3, 3] + [2] * 10


def test_a_cap_saves_only_the_hours_above_it():
    """A group scaling 1-4 (2.25 engines on average) capped at 2 saves the 12 engine-hours above 2,
    not half its cost."""
    counts = [1] * 6 + [2] * 6 + [4] * 6 + [2] * 6
    setup = ModelSetup("m", (_group(),), tuple(_day(counts)))
    after = capped(setup, (2,) * 24, startup_seconds=180)
    assert _hours(setup) - _hours(after) == pytest.approx(2 * 6)
    assert engines_by_hour(after.runs) == [1] * 6 + [2] * 18


def test_a_cap_that_ran_already_changes_nothing():
    """A fleet already at 1 by night and 3 by day, capped to that, keeps every engine-hour."""
    counts = [1] * 8 + [3] * 12 + [1] * 4
    setup = ModelSetup("m", (_group(),), tuple(_day(counts)))
    assert not cuts(tuple(counts), engines_by_hour(setup.runs))
    assert _hours(capped(setup, tuple(counts), 180)) == pytest.approx(_hours(setup))


def test_an_engine_needed_again_later_pays_its_start_up():
    """Two replicas all day, capped to 1 from 00 to 08: the second starts 180 s before 08:00."""
    setup = ModelSetup("m", (_group(),), (Run("g", "a", 0, 24 * H, 0), Run("g", "b", 0, 24 * H, 0)))
    after = capped(setup, (1,) * 8 + (2,) * 16, startup_seconds=180)
    b = [r for r in after.runs if r.instance.startswith("b")]
    assert [(r.start, r.ready, r.end) for r in b] == [(8 * H - 180, 8 * H, 24 * H)]


def test_a_gap_shorter_than_a_start_up_keeps_the_engine_running():
    """Capped for only 2 minutes, an engine that would take 3 to start again is kept."""
    setup = ModelSetup(
        "m",
        (_group(),),
        (Run("g", "a", 0, 2 * H, 0), Run("g", "b", 0, 2 * H, 0), Run("g", "c", H, H + 120, H)),
    )
    after = capped(setup, (2, 2) + (5,) * 22, startup_seconds=180)
    assert _hours(after) == pytest.approx(_hours(setup) - 120 / H)


def test_the_cheaper_engines_are_kept():
    """Capped to one of two groups' replicas, the L40S (cheaper per hour) stays, the H100 goes."""
    groups = (_group("cheap", 1.60, 1), _group("dear", 3.90, 2))
    setup = ModelSetup("m", groups, (Run("cheap", "cheap", 0, H, 0), Run("dear", "dear", 0, H, 0)))
    after = capped(setup, (1,) * 24, 180)
    assert [r.replica for r in after.runs] == ["cheap"]


def test_an_hour_needs_its_busiest_days_peak_with_headroom():
    """Peaks of 20 and 30 at 09:00 on two days need ceil(30 x 1.25 / 16) = 3; an idle hour that
    ran needs the floor; an hour that never ran needs nothing."""
    r = ModelReplay("m", [], peak_in_engines={9: 20.0, 24 + 9: 30.0, 10: 2.0})
    ran = [0] * 8 + [1] * 16
    need = needed_by_hour(r, capacity=16, headroom=0.25, floor=1, ran=ran)
    assert need[9] == 3
    assert (need[10], need[11], need[7]) == (1, 1, None)


def test_an_engine_holds_what_its_kv_cache_holds():
    """8,000 KV tokens hold 4 requests of 1,500 prompt and 500 output tokens: fewer than 16."""
    arrivals = [Arrival(0.0, "t", "m", 1500, 500)] * 3
    assert engine_capacity(_group(), arrivals) == pytest.approx(4.0)
    assert engine_capacity(_group(), []) == 16


def test_caps_read_as_runs_of_hours():
    """Equal hours run together; an uncapped hour keeps the level before it."""
    caps = (1,) * 8 + (3,) * 12 + (None,) + (1,) * 3
    assert hour_segments(caps) == [(0, 8, 1), (8, 21, 3), (21, 24, 1)]
