"""The daily traffic shape shared by the simulator's generator and the autoscaler's replay."""

from __future__ import annotations

import pytest

from infermeter.day_curve import hour_of_day, share_of_peak


def test_share_peaks_at_ten_and_has_a_night_floor():
    """The share is 1.0 at 10:00, 0.08 in the small hours, and a second bump around 15:00."""
    shares = {hour: share_of_peak(hour) for hour in range(24)}
    assert max(shares, key=shares.__getitem__) == 10
    assert shares[10] == pytest.approx(1.0)
    assert shares[3] == pytest.approx(0.08, abs=0.001)
    assert shares[14] < shares[15] > shares[16]


@pytest.mark.parametrize(
    ("elapsed", "day_seconds", "start_hour", "hour"),
    [(0, 600, 8.0, 8.0), (150, 600, 8.0, 14.0), (600, 600, 8.0, 8.0), (43_200, 86_400, 0.0, 12.0)],
)
def test_hour_of_day_compresses_the_day(elapsed, day_seconds, start_hour, hour):
    """``day_seconds`` of elapsed time are 24 hours, counted from ``start_hour`` and wrapping."""
    assert hour_of_day(elapsed, day_seconds, start_hour) == pytest.approx(hour)
