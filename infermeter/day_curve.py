"""The daily shape of inference traffic: a night floor, a 10:00 peak and a smaller 15:00 one.

One curve for everything that needs a working day's demand: the simulator's traffic generator
paces its arrivals by it, and the autoscaler's replay takes it as its simulated demand, so a
policy is replayed over the day the demo fleet serves. Pure: no clock and no randomness here.
"""

from __future__ import annotations

import math

__all__ = ["hour_of_day", "share_of_peak"]


def hour_of_day(elapsed_seconds: float, day_seconds: float, start_hour: float = 0.0) -> float:
    """The wall-clock hour (0-24) ``elapsed_seconds`` into days compressed to ``day_seconds``."""
    return (start_hour + 24.0 * elapsed_seconds / day_seconds) % 24.0


def share_of_peak(hour: float) -> float:
    """The request rate at ``hour`` as a share of the day's peak: from 0.08 at night to 1.0."""
    peak = math.exp(-(((hour - 10.0) / 2.5) ** 2)) + 0.6 * math.exp(-(((hour - 15.0) / 3.0) ** 2))
    return 0.08 + 0.92 * min(1.0, peak)
